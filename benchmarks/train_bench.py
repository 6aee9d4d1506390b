"""LTX-2-shaped LoRA training step with activation spill: time, peak memory, gradients.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/train_bench.py           # the H100 run
    python benchmarks/train_bench.py --device cpu --model tiny --layers 4 --video-tokens 64 \\
        --audio-tokens 16 --text-tokens 8 --rank 4 --min-tensor-bytes 0 --steps 2 --sync-layers 2,3  # smoke, timings meaningless

The step: `--layers` blocks of the `--model` spec (default: 16 blocks of ltx,
12.56 GB of bf16 frozen base weights resident on the device, drawn with
random_weights' scales), LoRA rank 32 on to_q/to_k/to_v/to_out.0, 6144 video /
128 audio / 256 text tokens, batch 1; the loss is the mean square of the outputs.

Rows:
  off             no offload
  keep-all        the offloader with a watermark nothing crosses: the hooks' own cost
  watermark S=..  high watermark = saved bytes - S (low 0.5 GB under it), S picked
                  from the no-offload peak: S = k x 13% of it, so the peak can drop 13%
  sync K=..       TransformerEngine-style sync dict derived for K offloaded layers
  spilling rows run with the config's copies in flight (64 each way) and
  restore_lookahead (8) and restores ahead under the low watermark, or with --caps /
  --lookahead / --no-restore-within-low
  save_on_cpu     torch.autograd.graph.save_on_cpu(pin_memory=True)
Each row: --warmup steps, then --steps steps, each timed with CUDA events around
the whole step (forward + backward, after a synchronize); the table shows the
median, the peak allocated device memory (max over the timed steps), the bytes
spilled, the compute-stream stalls on copies, and max |grad - grad(off)| over
every LoRA gradient ("spread" is the no-offload row against its own previous
step). Each offloaded row's slab pool is sized exactly from the recorded step:
one class per spilled size, as many slabs as the policy books at once (no
misses, no rounding). The table is printed last; --out writes every row as JSON.

Results: benchmarks/results/train-bench-h100-2026-11-23.md (and the peers run of these rows,
peers-h100-2026-11-23.md).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import pstats
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, ContextManager

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import ActivationsConfig, PoolConfig  # noqa: E402
from engine.executor.model_hooks import ResidentWeights  # noqa: E402
from engine.executor.offloader import ActivationOffloader  # noqa: E402
from engine.executor.setup import compute_device  # noqa: E402
from engine.executor.training import lora_step  # noqa: E402
from engine.models import build_spec, load_model_config, make_inputs  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.models.spec import ModelSpec  # noqa: E402
from engine.policy.activations import build_activation_policy  # noqa: E402
from engine.policy.pool_sizing import exact_pool  # noqa: E402
from engine.policy.schedule import Question  # noqa: E402
from engine.measure.clocks import Clock, clock_for  # noqa: E402

GB = 1e9
MB = 1e6
TARGET_REDUCTION = 0.13  # Activation Stagehand: 19.4 -> 16.9 GB




@dataclasses.dataclass
class Row:
    name: str
    step_ms: list[float]
    host_ms: list[float]
    peak_bytes: int
    grads: list[dict[str, torch.Tensor]]  # the last two timed steps'
    telemetry: dict | None = None
    questions: list[Question] | None = None  # an offloaded row's last step
    mallocs: int = 0
    retries: int = 0


def run_row(name: str, step: Callable[[], dict], wrap: Callable[[], ContextManager], clock: Clock,
            device: torch.device, warmup: int, steps: int) -> Row:
    times, host, peaks, grads = [], [], [], []
    mallocs = retries = 0
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            before = torch.cuda.memory_stats()
        clock.synchronize()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start, t0 = clock.stamp(), time.perf_counter()
        with wrap():
            g = step()
        end, t1 = clock.stamp(), time.perf_counter()
        clock.synchronize()
        ms = clock.ns(start, end) / 1e6
        if i >= warmup:
            times.append(ms)
            host.append((t1 - t0) * 1e3)
            peaks.append(torch.cuda.max_memory_allocated() if device.type == "cuda" else 0)
            grads = (grads + [g])[-2:]
    if device.type == "cuda":  # cudaMalloc calls and OOM retries (each frees the cache: a device sync)
        after = torch.cuda.memory_stats()
        mallocs = after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0)
        retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
    row = Row(name, times, host, max(peaks), grads, mallocs=mallocs, retries=retries)
    print(f"  {name}: median {statistics.median(times):.1f} ms (steps {', '.join(f'{t:.0f}' for t in times)}), "
          f"host {statistics.median(host):.0f} ms, peak {row.peak_bytes / GB:.2f} GB, "
          f"{mallocs} cudaMallocs and {retries} alloc retries in the timed steps", flush=True)
    return row


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def profile_spill(step: Callable, name: str, act: ActivationsConfig, spec: ModelSpec, weights: dict,
                  device: torch.device) -> None:
    """One step of a spilling row under torch.profiler: the host's time in CUDA runtime calls
    (a copy or allocation that blocks the host shows here) and the GPU's kernel and copy time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    policy = build_activation_policy(act, spec.num_layers)
    with ActivationOffloader(policy, act, device, weights=ResidentWeights(weights)) as off:
        for _ in range(2):  # warm: the allocator's pools and the slabs
            with off.step():
                step(off)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with off.step():
                step(off)
            torch.cuda.synchronize()
    print(f"  {name}, one step under torch.profiler, by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def profile(step: Callable, keep_all: ActivationsConfig, spec: ModelSpec, weights: dict, device: torch.device) -> None:
    """Where the time goes: the GPU's kernel time in a no-offload step (is the step host-bound?),
    and the host's profile of a keep-all step (the hooks' own cost)."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(f"  GPU kernel time of one no-offload step: {busy:.1f} ms", flush=True)
    policy = build_activation_policy(keep_all, spec.num_layers)
    with ActivationOffloader(policy, keep_all, device, weights=ResidentWeights(weights)) as off:
        with off.step():
            step(off)
        gc_s, started = [0.0], [0.0]

        def timed_gc(phase: str, _info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                gc_s[0] += time.perf_counter() - started[0]

        before = [s["collections"] for s in gc.get_stats()]
        gc.callbacks.append(timed_gc)
        prof = cProfile.Profile()
        prof.enable()
        with off.step():
            step(off)
        if device.type == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        gc.callbacks.remove(timed_gc)
        after = [s["collections"] for s in gc.get_stats()]
    print(f"  keep-all step: gc collections per generation {[a - b for a, b in zip(after, before)]}, "
          f"{gc_s[0] * 1e3:.1f} ms in gc")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ltx")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--video-tokens", type=int, default=6144)
    p.add_argument("--audio-tokens", type=int, default=128)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--spill-factors", default="1,1.5,2", help="watermark rows: S = factor x 13%% of the peak")
    p.add_argument("--sync-layers", default="4,5")
    p.add_argument("--min-tensor-bytes", type=int, default=1 << 20)
    p.add_argument("--caps", type=int, default=None, help="max_inflight_d2h/h2d (default: the config's, 64)")
    p.add_argument("--lookahead", type=int, default=None, help="restore_lookahead (default: the config's, 8)")
    p.add_argument("--no-restore-within-low", action="store_true",
                   help="watermark rows restore only restore_lookahead tensors ahead, not also while under "
                        "the low watermark (restore_within_low_watermark=false)")
    p.add_argument("--profile", action="store_true",
                   help="also: GPU kernel time of one no-offload step, the host profile of one keep-all step, "
                        "and torch.profiler over one step of the first spilling row")
    p.add_argument("--no-save-on-cpu", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    device = compute_device(args.device, no_cuda="no CUDA device; run with --device cpu (timings then mean nothing)")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    clock = clock_for(device)
    model_cfg = dataclasses.replace(load_model_config(args.model), num_layers=args.layers)
    workload = SimpleNamespace(kind="train_lora", batch=1, video_tokens=args.video_tokens,
                               audio_tokens=args.audio_tokens, text_tokens=args.text_tokens, context_tokens=0,
                               lora_rank=args.rank)
    spec = build_spec(model_cfg, workload)
    t0 = time.perf_counter()
    weights = random_weights(spec, device=device, draw_on_device=True)  # 6 G values on the host take minutes
    lora = init_lora(spec, args.rank, device=device, seed=1)
    inputs = make_inputs(spec, workload, device=device, seed=2)
    clock.synchronize()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{spec.name}: {args.layers} blocks, {spec.model_bytes / GB:.2f} GB of weights, "
          f"{sum(t.numel() for t in lora.values()) / 1e6:.1f} M LoRA parameters, on {name} "
          f"(torch {torch.__version__}); set up in {time.perf_counter() - t0:.1f} s", flush=True)

    def step(off: ActivationOffloader | None = None) -> dict[str, torch.Tensor]:
        lora_step(spec, DictSource(spec, weights), inputs, lora, off)
        return {k: t.grad.detach().clone() for k, t in lora.items()}

    def offloaded(row_name: str, act: ActivationsConfig) -> Row:
        policy = build_activation_policy(act, spec.num_layers)
        with ActivationOffloader(policy, act, device, weights=ResidentWeights(weights)) as off:
            row = run_row(row_name, lambda: step(off), off.step, clock, device, args.warmup, args.steps)
            row.telemetry = off.telemetry()[-1]
            row.questions = off.questions
        if device.type == "cpu":  # no allocator to ask: the logical bytes of saved tensors
            row.peak_bytes = int(row.telemetry["vram_peak_mb"] * MB)
        return row

    rows = [run_row("off", step, nullcontext, clock, device, args.warmup, args.steps)]
    base = ActivationsConfig(mode="watermark", pool=PoolConfig([1.0], [1]), min_tensor_bytes=args.min_tensor_bytes)
    keep_all = dataclasses.replace(base, high_watermark_mb=1e9, low_watermark_mb=1e9)
    rows.append(offloaded("keep-all", keep_all))
    questions = rows[-1].questions
    saved = sum(q[2] for q in questions if q[0] == "save")
    if device.type == "cpu":
        rows[0].peak_bytes = rows[1].peak_bytes  # keep-all holds what no offload holds
    peak = rows[0].peak_bytes
    print(f"  {sum(q[0] == 'save' for q in questions)} saved groups, {saved / GB:.2f} GB; "
          f"no-offload peak {peak / GB:.2f} GB", flush=True)

    # The config's copies in flight and restore lookahead, or --caps / --lookahead where given.
    knobs = dict(max_inflight_d2h=args.caps or base.max_inflight_d2h, max_inflight_h2d=args.caps or base.max_inflight_h2d,
                 restore_lookahead=base.restore_lookahead if args.lookahead is None else args.lookahead,
                 restore_within_low_watermark=not args.no_restore_within_low)
    plans: list[tuple[str, ActivationsConfig]] = []
    for k in (float(f) for f in args.spill_factors.split(",") if f):
        target = k * TARGET_REDUCTION * peak
        high = max(saved - target, 0) / MB
        plans.append((f"watermark S={target / GB:.1f}GB", dataclasses.replace(
            base, high_watermark_mb=high, low_watermark_mb=max(high - 500, 0), **knobs)))
    for layers in (int(n) for n in args.sync_layers.split(",") if n):
        plans.append((f"sync K={layers}", dataclasses.replace(base, mode="sync", num_offload_layers=layers, **knobs)))
    profiled: list[str] = []
    for row_name, act in plans:
        act = dataclasses.replace(act, pool=PoolConfig(**exact_pool(act, questions, spec.num_layers)))
        pool_gb = sum(s * n for s, n in zip(act.pool.class_sizes_mb, act.pool.slabs_per_class)) / 1e3
        print(f"  {row_name}: pool of {len(act.pool.class_sizes_mb)} classes, {pool_gb:.2f} GB pinned", flush=True)
        rows.append(offloaded(row_name, act))
        if args.profile and device.type == "cuda" and not profiled:
            profiled.append(row_name)
            profile_spill(step, row_name, act, spec, weights, device)
    if not args.no_save_on_cpu:
        pinned = device.type == "cuda"
        rows.append(run_row("save_on_cpu(pin_memory)", step,
                            lambda: torch.autograd.graph.save_on_cpu(pin_memory=pinned),
                            clock, device, args.warmup, args.steps))

    if args.profile:
        profile(step, keep_all, spec, weights, device)

    ref = rows[0]
    spread = max_diff(ref.grads[-1], ref.grads[0]) if len(ref.grads) == 2 else float("nan")
    base_ms = statistics.median(ref.step_ms)
    records = []
    for r in rows:
        t = r.telemetry or {}
        ms = statistics.median(r.step_ms)
        rec = {
            "row": r.name, "step_ms": ms, "step_ms_all": r.step_ms, "host_ms": statistics.median(r.host_ms),
            "overhead_pct": 100 * (ms / base_ms - 1), "peak_gb": r.peak_bytes / GB,
            "peak_reduction_pct": 100 * (1 - r.peak_bytes / ref.peak_bytes) if ref.peak_bytes else 0.0,
            "spilled_gb": t.get("spill_bytes", 0) / GB, "stall_ms": t.get("stall_time_ms", 0.0),
            "finalize_wait_ms": t.get("finalize_wait_ms", 0.0), "pool_misses": t.get("pool_misses", 0),
            "max_abs_grad_diff": max_diff(r.grads[-1], ref.grads[-1]), "telemetry": t,
            "cuda_mallocs": r.mallocs, "alloc_retries": r.retries,
        }
        records.append(rec)
        if t:
            print(f"  telemetry {r.name}: {json.dumps(t)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": name, "args": vars(args) | {"out": str(args.out)},
                                        "spread": spread, "rows": records}, indent=1))

    print(f"\n{spec.name} x{args.layers}, {args.video_tokens} video tokens, rank {args.rank}, on {name}; "
          f"median of {args.steps} after {args.warmup} warm-up; no-offload grad spread {spread:.3g}; "
          f"copies in flight {knobs['max_inflight_d2h']}, restore_lookahead {knobs['restore_lookahead']}, "
          f"restore_within_low_watermark {knobs['restore_within_low_watermark']}")
    print(f"{'row':<28}{'step ms':>9}{'host ms':>9}{'overhead':>10}{'peak GB':>9}{'-peak':>8}{'spilled GB':>12}"
          f"{'stall ms':>10}{'misses':>8}{'max|dgrad|':>12}{'mallocs':>9}{'retries':>9}")
    for rec in records:
        print(f"{rec['row']:<28}{rec['step_ms']:>9.1f}{rec['host_ms']:>9.0f}{rec['overhead_pct']:>9.1f}%"
              f"{rec['peak_gb']:>9.2f}{rec['peak_reduction_pct']:>7.1f}%{rec['spilled_gb']:>12.2f}"
              f"{rec['stall_ms']:>10.1f}{rec['pool_misses']:>8}{rec['max_abs_grad_diff']:>12.3g}"
              f"{rec['cuda_mallocs']:>9}{rec['alloc_retries']:>9}")


if __name__ == "__main__":
    main()
