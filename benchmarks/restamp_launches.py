"""Count each record's CUDA launches in recorded traces, on a GPU, and write them in.

    python benchmarks/restamp_launches.py data/traces/full/*.jsonl.gz data/traces/modules/*.jsonl.gz --out DIR

Traces recorded before the recorders counted launches (engine/measure/launches.py) carry
none, and the simulator then takes one launch a record. This runs one step of each trace's
model on the device with random weights (the count does not depend on their values) and
counts launches per record as the recorders do:
  spec traces    engine.measure.timing.count_launches over the spec (training: the backward's
                 launches at each kernel's first unpack, and each forward kernel's saved-tensor
                 hook calls, "packs")
  module traces  the module built from its model config, parameters random on the device (a
                 training trace: its LoRA adapters and checkpointing too); a mark at each
                 record's module as it starts (its backward: as checkpointing recomputes it)
Each trace is written to DIR under its own name with every record's "launches" (and "packs")
replaced, nothing else changed. Prints per trace the records, launches a step and a record.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARM_UPS = 1  # steps before the counted one: cuBLAS and the allocator set up on the first


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_configs() -> dict[str, str]:
    """Spec or module name (a trace header's "model") -> its config in conf/model/."""
    from omegaconf import OmegaConf

    return {OmegaConf.load(p).name: p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")}


def config_of(header: dict) -> Any:
    from hydra import compose, initialize_config_dir

    from engine.config import register

    register()
    wl = header.get("workload") or {}
    kind = wl.get("kind", "infer")
    overrides = [f"model={model_configs()[header['model']]}", f"workload={wl.get('name', kind)}"]
    overrides += [f"workload.{k}={v}" for k, v in wl.items()
                  if k in ("batch", "video_tokens", "audio_tokens", "text_tokens", "context_tokens", "lora_rank",
                           "checkpointing")]
    if "num_layers" in header and "module" not in header:
        overrides.append(f"model.num_layers={header['num_layers']}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def spec_counts(cfg: Any, trace: Any) -> tuple[list[int], dict[int, int]]:
    import torch

    from engine.job import prepare
    from engine.measure.clocks import CudaClock
    from engine.measure.timing import count_launches
    from engine.models import make_inputs
    from engine.models.lora import init_lora
    from engine.models.run import TORCH_DTYPES, DictSource

    device = torch.device("cuda")
    spec = prepare(cfg, Path("/tmp/restamp-launches")).spec
    weights = {n: torch.randn(w.shape, dtype=TORCH_DTYPES[w.dtype], device=device) * 0.02
               for n, w in spec.weights.items()}
    inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
    training = cfg.workload.kind == "train_lora"
    lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1) if training else None
    for _ in range(WARM_UPS + 1):
        counted = count_launches(spec, DictSource(spec, weights), inputs, CudaClock(device), lora=lora)
    launches = counted.forward + (counted.backward[::-1] if counted.backward else [])
    return launches, counted.packs


def module_counts(cfg: Any, trace: Any) -> tuple[list[int], dict[int, int]]:
    import torch

    from engine.measure.launches import Census
    from engine.modules.adapters import ALL_LINEAR, TrainingLoss, add_lora, enable_checkpointing
    from engine.modules.build import build_module, example_inputs
    from engine.modules.streamed import call_args

    device = torch.device("cuda")
    module = build_module(cfg.model)
    for name, p in list(module.named_parameters()):
        owner, leaf = module.get_submodule(name.rpartition(".")[0]) if "." in name else module, name.rpartition(".")[2]
        owner._parameters[leaf] = torch.nn.Parameter(torch.randn(p.shape, dtype=p.dtype, device=device) * 0.02,
                                                     requires_grad=False)
    module.to(device)
    training = cfg.workload.kind == "train_lora"
    if training:
        targets = cfg.model.get("lora_targets", ALL_LINEAR)
        add_lora(module, cfg.workload.lora_rank, targets if isinstance(targets, str) else list(targets),
                 device=device, seed=cfg.seed + 1)
        if cfg.workload.checkpointing:
            enable_checkpointing(module)
    args, kwargs = call_args(example_inputs(cfg.model, module, cfg.workload, device, seed=cfg.seed))
    forward = [r.name for r in trace.records if r.phase == "fwd"]
    state = {"census": None, "backward": False}

    def marker(name: str) -> Any:
        def pre(_m: Any, _a: Any) -> None:
            c = state["census"]
            if c is not None:
                c.mark(name + (".bwd" if state["backward"] else ""))
        return pre

    handles = [module.get_submodule(n).register_forward_pre_hook(marker(n)) for n in forward]
    loss_fn = TrainingLoss(seed=cfg.seed + 2) if training else None
    try:
        for step in range(WARM_UPS + 1):
            state["backward"] = False
            with Census(step == WARM_UPS) as census:
                state["census"] = census if census.on else None
                if training:
                    out = module(*args, **kwargs)
                    state["backward"] = True
                    census.mark(forward[-1] + ".bwd")  # the loss and the backward's start: the last record's
                    loss_fn(out).backward()
                else:
                    with torch.no_grad():
                        module(*args, **kwargs)
            state["census"] = None
    finally:
        for h in handles:
            h.remove()
    counts = census.counts
    del module, args, kwargs
    return [counts.get(r.name, 0) for r in trace.records], {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch

    from engine.trace import read_trace, write_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in args.traces:
        trace = read_trace(path)
        cfg = config_of(trace.header)
        t0 = time.perf_counter()
        module = "module" in trace.header
        launches, packs = (module_counts if module else spec_counts)(cfg, trace)
        n_fwd = sum(r.phase == "fwd" for r in trace.records)
        records = tuple(dataclasses.replace(r, launches=n, packs=packs.get(i, r.packs) if i < n_fwd else 0)
                        for i, (r, n) in enumerate(zip(trace.records, launches)))
        write_trace(out / Path(path).name, dataclasses.replace(trace, records=records))
        unmarked = sum(n == 0 for n in launches)
        rows.append((Path(path).name, len(records), sum(launches), sum(launches) / len(records),
                     sum(packs.values()), unmarked))
        log(f"{path}: {sum(launches)} launches over {len(records)} records, {unmarked} unmarked, "
            f"{time.perf_counter() - t0:.0f} s")
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| trace | records | launches a step | per record | packs a step | records without a launch |")
    print("|---|---|---|---|---|---|")
    for name, n, total, per, packs, unmarked in rows:
        print(f"| {name} | {n} | {total} | {per:.1f} | {packs} | {unmarked} |")


if __name__ == "__main__":
    main()
