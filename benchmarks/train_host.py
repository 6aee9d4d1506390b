"""Where a host-bound LoRA step's time goes: the same step plain and through the executor,
with and without the deterministic kernels mode=execute compares bitwise under.

    python benchmarks/train_host.py                       # LTX-2, 8 blocks, 6144 video tokens
    python benchmarks/train_host.py --profile 3           # + cProfile's top over 3 executor steps

Weights: random bf16, every one resident on the device. Rows:
  plain           lora_step over a dict of the weights (what mode=record times)
  executor        the same step through a WeightExecutor with no budget (every fetch a hit),
                  as mode=execute's budget=null runs it
each with torch's default kernels and with deterministic ones (torch.use_deterministic_algorithms,
what a bitwise comparison of the backward needs). Step: CUDA events,
median of --steps after a warm-up, the stream running free; host: perf_counter of the Python
call alone; held: the GPU time with the stream held behind a spin kernel while the host
queues the step (what the recorder's step_ns is). Table last.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine.executor.runtime import WeightExecutor  # noqa: E402
from engine.measure.clocks import CudaClock  # noqa: E402
from engine.executor.setup import forward_order  # noqa: E402
from engine.executor.training import StreamedWeights, lora_step, train_order  # noqa: E402
from engine.models import make_inputs  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from executor_bench import ltx_spec, median_ms  # noqa: E402
from module_host_cost import measure as free_running  # noqa: E402



@contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """A bitwise comparison needs kernels that sum in a fixed order (cuBLAS
    workspaces, attention backward); the timed steps then run those kernels too."""
    if not on:
        yield
        return
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def measure(fn, steps: int) -> tuple[float, float, float]:
    """(median step ms free-running, median host ms, median GPU ms with the stream held)."""
    free, host = free_running(fn, steps)
    clock = CudaClock(torch.device("cuda"))

    def hold() -> None:  # the host queues the step behind a spin longer than its host time
        torch.cuda.synchronize()
        clock.hold(round(1.5 * host * 1e6))
    held, _ = median_ms(fn, 0, steps, before=hold)
    return free, host, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ltx")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--video-tokens", type=int, default=6144)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    device = torch.device("cuda")
    wl = SimpleNamespace(name="train_lora", kind="train_lora", batch=1, video_tokens=args.video_tokens,
                         audio_tokens=128, text_tokens=256, context_tokens=0, lora_rank=32)
    spec = ltx_spec(args.model, args.layers, wl)
    weights = random_weights(spec, device=device, draw_on_device=True)
    inputs = make_inputs(spec, wl, device)
    lora = init_lora(spec, 32, device=device, seed=1)
    executor = WeightExecutor(train_order(forward_order(spec)), {n: t.cpu() for n, t in weights.items()},
                              budget_bytes=None, eviction="priority", backend="cuda")
    streamed = StreamedWeights(executor, len(spec.kernels))

    def plain() -> None:
        lora_step(spec, DictSource(spec, weights), inputs, lora)

    def through_executor() -> None:
        with executor.step():
            streamed.start_step()
            lora_step(spec, streamed, inputs, lora)
            streamed.finish()

    rows = []
    for det in (False, True):
        with deterministic(det):
            for name, fn in (("plain", plain), ("executor", through_executor)):
                free, host, held = measure(fn, args.steps)
                rows.append((name, det, free, host, held))
                print(f"{name} deterministic={det}: step {free:.1f} ms, host {host:.1f} ms, held GPU {held:.1f} ms",
                      flush=True)
    if args.profile:
        with deterministic(True):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                through_executor()
            torch.cuda.synchronize()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    executor.close()
    print(f"\n{args.model}, {args.layers} blocks, {args.video_tokens} video tokens, LoRA rank 32; "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; {len(spec.kernels)} spec kernels")
    print("| path | deterministic | step ms (free) | host ms | GPU ms (held) |")
    print("|---|---|---|---|---|")
    for name, det, free, host, held in rows:
        print(f"| {name} | {det} | {free:.1f} | {host:.1f} | {held:.1f} |")


if __name__ == "__main__":
    main()
