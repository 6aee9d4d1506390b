"""Host cost of the activation offloader's hooks, per saved tensor, on the real diffusers LTX-2.

    python benchmarks/saved_tensor_cost.py                                  # GPU: 8 blocks, 1024 tokens
    python benchmarks/saved_tensor_cost.py --small --blocks 4 --tokens 256  # CPU-sized dims
    python benchmarks/saved_tensor_cost.py --profile 5                      # + cProfile of the hooks

The LoRA step (peft rank --rank on the attention and feed-forward linears, mean-square loss of
both outputs, backward) with the base frozen and resident, so the host time is the step's own
plus the hooks'. Rows, interleaved --rounds times on one model and batch:
  plain             no saved-tensor hooks
  no-op hooks       saved_tensors_hooks that return what they get: what any Python hook costs
  hooks, all kept   ActivationOffloader with a watermark no step reaches: every saved tensor
                    goes through the hooks and the policy, none is copied
  sync K            the first --sync layers spilled (the copies' host cost too)
Host: perf_counter around forward + backward, the device's queue drained before and after (at a
few thousand tokens the host, not the GPU, sets the step). Per saved tensor: (row - plain) / the
tensors autograd saved in the step, as the offloader counts them (activations, held leaves and
weight handles). Prints a table last; writes saved_tensor_cost.json under --out.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.executor.model_hooks import ResidentWeights  # noqa: E402
from engine.executor.offloader import ActivationOffloader  # noqa: E402
from engine.modules.adapters import TrainingLoss, add_lora  # noqa: E402
from engine.modules.build import ltx2_inputs  # noqa: E402
from engine.modules.kernels import find_blocks  # noqa: E402
from engine.modules.training import activations_config  # noqa: E402
from engine.policy.activations import build_activation_policy  # noqa: E402
from engine.policy.pool_sizing import exact_pool  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
# Dims small enough for a 2-core CPU; the block's structure (and so its saves) is LTX-2's.
SMALL = dict(num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64, audio_num_attention_heads=4,
             audio_attention_head_dim=8, audio_cross_attention_dim=32, caption_channels=48, in_channels=16,
             out_channels=16, audio_in_channels=16, audio_out_channels=16)


def build(blocks: int, small: bool, rank: int, device: torch.device) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    with device:
        model = diffusers.LTX2VideoTransformer3DModel(num_layers=blocks, **(SMALL if small else {}))
    model = torch.nn.Module.to(model, torch.bfloat16)
    add_lora(model, rank, TARGETS, device=device)
    return model


class Offloaded:
    """The offloader around a frozen-resident module, built from the public mechanism;
    `pool` None: one slab that nothing fits (the sizing step's, every spill a miss)."""

    def __init__(self, model: torch.nn.Module, act: dict[str, Any], device: torch.device,
                 pool: dict[str, list] | None = None):
        cfg = activations_config({**act, "pool": pool or {"class_sizes_mb": [0.001], "slabs_per_class": [1]}})
        blocks = find_blocks(model)
        modules = dict(model.named_modules())
        policy = build_activation_policy(cfg, len(blocks))
        resident = ResidentWeights({n: p.detach() for n, p in model.named_parameters() if not p.requires_grad})
        self.off = ActivationOffloader(policy, cfg, device, weights=resident, keep_steps=1)
        self.layers = {modules[b]: i for i, b in enumerate(blocks)}

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step with the layer hooks on (every runner shares the model: only one hooks it at a time)."""
        hooks = self.off.layer_hooks(self.layers)
        try:
            with self.off.step():
                yield
        finally:
            for h in hooks:
                h.remove()

    def close(self) -> None:
        self.off.close()

    def saves(self) -> int:
        t = self.off.telemetry()[-1]
        return t["activations_saved"] + t["held"] + t["weight_handles"]


class NoOp:
    """Saved-tensor hooks that do nothing: the floor any Python pack/unpack hook pays."""

    def __init__(self) -> None:
        self.count = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return t

    @contextmanager
    def step(self) -> Iterator[None]:
        self.count = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def saves(self) -> int:
        return self.count

    def close(self) -> None:
        pass


def timed_step(model: torch.nn.Module, inputs: dict, loss_fn: Callable, wrap: Callable[[], Any],
               sync: Callable[[], None]) -> float:
    for p in model.parameters():
        p.grad = None
    sync()
    t0 = time.perf_counter()
    with wrap():
        loss_fn(model(**inputs)).backward()
    sync()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="CPU-sized dims (SMALL), same block structure")
    ap.add_argument("--sync", type=int, default=2, help="K of the sync row (0: no sync row)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    ap.add_argument("--min-bytes", type=int, default=None,
                    help="activations.min_tensor_bytes (default: the config's 1 MiB; 0 with --small)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile N all-kept steps; print the top")
    ap.add_argument("--out", default="outputs/saved_tensor_cost")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build(args.blocks, args.small, args.rank, device)
    wl = SimpleNamespace(kind="train_lora", batch=1, video_tokens=args.tokens, audio_tokens=128, text_tokens=256)
    inputs = ltx2_inputs(model, wl, device, torch.bfloat16)
    loss_fn = TrainingLoss()
    floor = {} if args.min_bytes is None and not args.small else {"min_tensor_bytes": args.min_bytes or 0}
    rows: dict[str, Any] = {"plain": None,
                            "hooks, all kept": {"mode": "watermark", "high_watermark_mb": 1e9,
                                                "low_watermark_mb": 1e9, **floor}}
    if args.sync:
        rows[f"sync K={args.sync}"] = {"mode": "sync", "num_offload_layers": args.sync, **floor}
    runners: dict[str, Any] = {}
    for name, act in rows.items():
        if act is None:
            runners[name] = None
            if name == "plain":
                runners["no-op hooks"] = NoOp()
            continue
        sizing = Offloaded(model, act, device)  # one step to size the exact pinned pool, as training=True does
        timed_step(model, inputs, loss_fn, sizing.step, sync)
        sizing.close()
        pool = exact_pool(activations_config(act), sizing.off.questions,
                          len(sizing.layers))
        runners[name] = Offloaded(model, act, device, pool)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds + 2):  # two warm-up rounds
        for name, o in runners.items():
            ms = timed_step(model, inputs, loss_fn, o.step if o else nullcontext, sync)
            if r >= 2:
                times[name].append(ms)
        print(f"[{time.strftime('%H:%M:%S')}] round {r}: " +
              ", ".join(f"{n} {t[-1]:.1f}" for n, t in times.items() if t), file=sys.stderr, flush=True)
    plain = statistics.median(times["plain"])
    table = []
    for name, o in runners.items():
        ms = statistics.median(times[name])
        saves = o.saves() if o else 0
        t = o.off.telemetry()[-1] if isinstance(o, Offloaded) else {}
        table.append({"row": name, "host_ms": ms, "spread_ms": max(times[name]) - min(times[name]),
                      "saves": saves, "activations": t.get("activations_saved", 0),
                      "spilled": t.get("activations_spilled", 0),
                      "us_per_save": (ms - plain) * 1e3 / saves if saves else None})
    if args.profile:
        o = runners["hooks, all kept"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            timed_step(model, inputs, loss_fn, o.step, sync)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for o in runners.values():
        if o:
            o.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "saved_tensor_cost.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
         "date": time.strftime("%F"), "args": vars(args), "rows": table, "times_ms": times}, indent=1))
    print("| row | host ms (median) | spread ms | saved a step (activations) | spilled | us per saved tensor |")
    print("|---|---|---|---|---|---|")
    for t in table:
        per = f"{t['us_per_save']:.1f}" if t["us_per_save"] is not None else "-"
        print(f"| {t['row']} | {t['host_ms']:.1f} | {t['spread_ms']:.1f} | {t['saves']} ({t['activations']}) | "
              f"{t['spilled']} | {per} |")


if __name__ == "__main__":
    main()
