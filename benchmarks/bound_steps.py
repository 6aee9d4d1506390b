"""Every weight resident: the plain module, offload's bound forward and what the recorder times.

    python benchmarks/bound_steps.py --model llama8b_hf --steps 20

A host-bound step (Llama decode: 12 ms of kernels under 25 ms of launches) is the host's, so
the recorder's all-resident figures carry over only if it times the forward the way offload
runs it. In one process, on the same weights (random, built on the device; no checkpoint):
  plain       the module with its weights on the device, `--steps` synced steps in a row
  bound       engine.offload(budget_mb=None): the weights bound once, hooks off, same steps
  recorder    engine.record's all-resident steps: the pipelined step through the hooks and
              the bound step it times after each one (header pipelined_step_ns, plain_step_ns)
  plain again the first row repeated, for the host's drift over the run
Prints each row's median, min and max (ms).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402

DECODE = SimpleNamespace(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096)


def synced_ms(fn: Callable[[], Any], steps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def row(name: str, times: list[float]) -> str:
    return f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | {len(times)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama8b_hf")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    module = build_module(cfg).to_empty(device="cuda")
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    inputs = example_inputs(cfg, module, DECODE, torch.device("cuda"))

    def run() -> None:
        with torch.no_grad():
            module(**inputs)

    lines = ["| path | median ms | min | max | steps |", "|---|---|---|---|---|",
             row("plain", synced_ms(run, args.steps))]
    h = engine.offload(module, budget_mb=None, example_inputs=inputs, eviction="priority", lookahead=2)
    assert h.bound
    lines.append(row("bound (offload, budget None)", synced_ms(run, args.steps)))
    h.remove()
    trace = engine.record(module, inputs)
    hd = trace.header
    lines.append(f"| recorder: pipelined through the hooks / bound | {hd['pipelined_step_ns'] / 1e6:.2f} / "
                 f"{(hd.get('plain_step_ns') or 0) / 1e6:.2f} | | | |")
    lines.append(row("plain again", synced_ms(run, args.steps)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
