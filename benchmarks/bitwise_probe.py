"""Why a model's offloaded output is not bitwise its plain module's: the plain module's own
run-to-run variation, by attention backend, and by where its parameters lie.

    python benchmarks/bitwise_probe.py --model sd35_large --steps 6

The model of benchmarks/real_models.py (`--model`, its workload) with random bf16 weights
written once to --dir. Rows, each --steps synced forwards on the same inputs:

  plain, SDPA default      every weight its own allocation (load_state_dict), as real_models.py's
                           reference: how many distinct outputs its steps give
  plain, SDPA <backend>    the same under one attention backend each (flash, efficient, cudnn, math)
  plain, misaligned P      every parameter moved to an address 128 bytes past a 256-byte boundary
                           (P=all), or only those the packed spans place so (P=packed): whether an
                           address's alignment alone changes the output
  offload, budget B        engine.offload(checkpoint=..., budget_mb=B; None: bound, every weight resident)

Per row: the steps' distinct outputs, whether any equals a default plain output, the largest
difference from the first default plain output and that output's largest magnitude, and per step
the host's time to return from the forward and the synced step (perf_counter), medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.modules.build import build_module, example_inputs, first_output  # noqa: E402
from engine.modules.checkpoint import load_resident, module_weights  # noqa: E402
from engine.modules.outcomes import distinct  # noqa: E402
from engine.weightfile import materialize  # noqa: E402
from real_models import MODELS, WORKLOADS  # noqa: E402

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def steps(fn: Callable[[], Any], n: int) -> tuple[list[torch.Tensor], float, float]:
    """n synced forwards: their outputs, the median host time to return, the median step."""
    outs, host, step = [], [], []
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        for _ in range(n):
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            outs.append(first_output(out).clone())
            host.append(t1 - t0)
            step.append(t2 - t0)
    return outs, 1e3 * statistics.median(host), 1e3 * statistics.median(step)


def misaligned(module: torch.nn.Module, names: set[str] | None) -> list[torch.Tensor]:
    """Move the named parameters (None: every one) to addresses 128 bytes past a 256-byte
    boundary; returns the allocations holding them."""
    held = []
    for name, p in module.named_parameters():
        if names is not None and name not in names:
            continue
        nbytes = p.numel() * p.element_size()
        buf = torch.empty(nbytes + 384, dtype=torch.uint8, device=p.device)
        start = (-buf.data_ptr()) % 256 + 128
        view = buf[start:start + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        held.append(buf)
    return held


def packed_offsets(table: Any) -> set[str]:
    """The parameters a block's packed file span places off a 256-byte boundary."""
    off, start, out = 0, {}, set()
    for name, spec in table.weights.items():
        block = ".".join(name.split(".")[:2])
        start.setdefault(block, off)
        if (off - start[block]) % 256:
            out.add(name)
        nbytes = 1
        for d in spec.shape:
            nbytes *= d
        off += nbytes * 2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sd35_large", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budgets", default="0,8000", help="offload rows: 0 is budget_mb=None")
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[args.model]}.yaml")
    device = torch.device("cuda")
    path = Path(args.dir) / f"{args.model}.safetensors"
    module = build_module(cfg)
    table = module_weights(module, cfg.name)
    if not path.exists():
        materialize(table, path, seed=0, device="cuda", order=list(table.weights))
    inputs = example_inputs(cfg, module, SimpleNamespace(**WORKLOADS[args.model]), device)
    rows: list[tuple[str, list[torch.Tensor], float, float]] = []
    ref = load_resident(build_module(cfg), path, device)
    rows.append(("plain, SDPA default", *steps(lambda: ref(**inputs), args.steps)))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                rows.append((f"plain, SDPA {backend.lower()}", *steps(lambda: ref(**inputs), args.steps)))
        except RuntimeError as err:
            print(f"plain, SDPA {backend.lower()}: {str(err).splitlines()[0][:120]}")
    for label, names in (("packed", packed_offsets(table)), ("all", None)):
        state = {n: p.data for n, p in ref.named_parameters()}
        held = misaligned(ref, names)
        rows.append((f"plain, misaligned {label} ({len(held)} params)",
                     *steps(lambda: ref(**inputs), args.steps)))
        for n, p in ref.named_parameters():
            p.data = state[n]
        del held
    ref = None  # its weights freed before the offload rows
    torch.cuda.empty_cache()
    for b in [float(x) for x in args.budgets.split(",")]:
        m = build_module(cfg)
        h = engine.offload(m, budget_mb=b or None, example_inputs=inputs, checkpoint=path, eviction="priority",
                           lookahead=2)
        rows.append((f"offload, budget {b:g}" + (" (bound)" if h.bound else ""), *steps(lambda: m(**inputs),
                                                                                       args.steps)))
        h.remove()
        m = h = None
        torch.cuda.empty_cache()
    base = distinct(rows[0][1])
    first = base[0].float()
    print(f"\n{cfg.name}: {WORKLOADS[args.model]}; output magnitude max {first.abs().max().item():.3g}\n")
    print("| run | distinct outputs | one of the default plain's | max diff from the first plain | "
          "host ms (median) | synced step ms (median) |")
    print("|---|---|---|---|---|---|")
    for label, outs, host, step in rows:
        d = distinct(outs)
        same = all(any(torch.equal(o, s) for s in base) for o in outs)
        diff = max((o.float() - first).abs().max().item() for o in outs)
        print(f"| {label} | {len(d)} | {same} | {diff:.3g} | {host:.1f} | {step:.1f} |")


if __name__ == "__main__":
    main()
