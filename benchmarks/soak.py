"""Soak on a GPU: N LTX-2 weight-streaming steps through the capped pool; does anything grow?

    python benchmarks/soak.py                          # 200 steps, all 48 blocks (a 37.75 GB file)
    python benchmarks/soak.py --steps 200 --blocks 8   # the same blocks, fewer of them

The weight file is materialized once into --dir (default /dev/shm: a page-cache
warm mapping, registered with CUDA). The budget defaults to 40% of the model,
so every step evicts and copies. Two phases in one process, each a new
executor, pool and registration:

- "as shipped": the executor's and the policy's decision logs and the step
  telemetry are kept, as the product keeps them;
- "logs trimmed": the same, with those three lists cleared after every step,
  which shows what grows besides them.

At steps 1, 10, 50, 100, 200 (those within --steps) and the last it prints:
pool used bytes, the pool's reserved high-water, live pool blocks, registered
host ranges and bytes, pinned bytes of torch's host allocator, torch's device
allocator bytes, free device memory, host RSS, Python objects alive and the
decisions logged; then each phase's drift from step 10 to the last, and
whether the outputs at every checkpoint were bitwise the all-resident forward.
A pool refusal ends the phase and is printed with the books at that step.

Results: benchmarks/results/soak-h100-2026-11-23.md.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_bench import WORKLOAD, ltx_spec, resident_outputs  # noqa: E402

from engine.errors import ExecutorError  # noqa: E402
from engine.executor import WeightExecutor  # noqa: E402
from engine.executor.setup import bitwise_equal, forward_order, streamed_executor  # noqa: E402
from engine.models import forward, make_inputs  # noqa: E402
from engine.units import MB  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402

CHECKPOINTS = (1, 10, 50, 100, 200)
SETTLED = 10  # drift is measured from this step (the first steps fill the pool and warm allocators)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def pinned_bytes() -> int:
    """Bytes torch's pinned host allocator holds (the executor's own pinned memory is registered, below)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return int(stats.get("allocated_bytes.current", -1))


def sample(step: int, ex: WeightExecutor) -> dict:
    torch.cuda.synchronize()
    gc.collect()
    b = ex.backend
    return {
        "step": step,
        "pool_used": b.used_bytes(),
        "pool_reserved_peak": b.reserved_peak_bytes(),
        "live_blocks": b.live_blocks(),
        "registered_ranges": len(b.registered),
        "registered_bytes": sum(b.registered.values()),
        "pinned": pinned_bytes(),
        "torch_allocated": torch.cuda.memory_allocated(),
        "device_free": torch.cuda.mem_get_info()[0],
        "rss": rss_bytes(),
        "objects": len(gc.get_objects()),
        "decisions_logged": len(ex.log) + len(ex.policy.log),
    }


def phase(name: str, spec, order, wf: WeightFile, inputs: dict, reference: dict | None, budget: int,
          steps: int, trim: bool, eviction: str, lookahead: int) -> tuple[list[dict], bool | None, float, str | None]:
    rows, bitwise, stopped = [], None if reference is None else True, None
    relocations = relocated = 0
    marks = set(c for c in CHECKPOINTS if c <= steps) | {steps}
    with ExitStack() as stack:
        ex = streamed_executor(stack, wf, order, backend="cuda", source="mmap_registered", budget_bytes=budget,
                               eviction=eviction, lookahead=lookahead)
        start = time.perf_counter()
        with torch.no_grad():
            for step in range(1, steps + 1):
                try:
                    with ex.step():
                        out = forward(spec, ex, inputs)
                except ExecutorError as err:  # a refusal is a result of the soak: record where and why
                    rows.append(sample(step, ex))
                    stopped = f"stopped in step {step}: {err}"
                    print(f"[{time.strftime('%H:%M:%S')}] {name}: {stopped}", flush=True)
                    break
                if step in marks:
                    if reference is not None:
                        bitwise = bitwise and all(bitwise_equal(out[k], reference[k]) for k in reference)
                    rows.append(sample(step, ex))
                    print(f"[{time.strftime('%H:%M:%S')}] {name}: step {step}", flush=True)
                del out
                relocations += ex.steps[-1].relocations
                relocated += ex.steps[-1].relocated_bytes
                if trim:
                    ex.log.clear(), ex.policy.log.clear(), ex.steps.clear()
        seconds = time.perf_counter() - start
    print(f"{name}: {relocations} relocations ({relocated / MB:.0f} MB copied in again)", flush=True)
    return rows, bitwise, seconds, stopped


def drift(rows: list[dict]) -> dict:
    first = next((r for r in rows if r["step"] >= SETTLED), rows[0])
    last = rows[-1]
    return {k: last[k] - first[k] for k in last if k != "step"} | {"from": first["step"], "to": last["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: the model's 48)")
    ap.add_argument("--model", default="ltx")
    ap.add_argument("--budget", type=float, default=None, help="MB (default: --budget-fraction of the model)")
    ap.add_argument("--budget-fraction", type=float, default=0.4)
    ap.add_argument("--eviction", default="belady")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("soak.py needs a CUDA device; the host-backend soak is tests/test_soak.py")

    spec = ltx_spec(args.model, args.blocks)
    order = forward_order(spec)
    budget = int(args.budget * MB) if args.budget is not None else int(args.budget_fraction * spec.model_bytes)
    path = args.dir / f"{spec.name}-{spec.num_layers}blocks-seed0.ptd"
    if not path.exists():
        materialize(spec, path, seed=0, device="cuda")
    inputs = make_inputs(spec, WORKLOAD, device="cuda", seed=1)
    wf = WeightFile(path, spec)
    reference = None
    free, _ = torch.cuda.mem_get_info()
    if spec.model_bytes < 0.5 * free:
        reference = resident_outputs(spec, wf, inputs)

    results = {}
    for name, trim in (("as shipped", False), ("logs trimmed", True)):
        results[name] = phase(name, spec, order, wf, inputs, reference, budget, args.steps, trim,
                              args.eviction, args.lookahead)
    wf.close()

    print()
    print(f"soak: {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"`python3 benchmarks/soak.py {' '.join(sys.argv[1:])}`")
    print(f"{spec.name}, {spec.num_layers} blocks, {spec.model_bytes / 1e9:.2f} GB bf16, {len(order)} kernels, "
          f"{len(order.sizes)} weights; budget {budget / MB:.0f} MB, {args.eviction}, lookahead {args.lookahead}; "
          f"weight file in {args.dir}, registered")
    cols = ("step", "pool_used", "pool_reserved_peak", "live_blocks", "registered_ranges", "registered_bytes",
            "pinned", "torch_allocated", "device_free", "rss", "objects", "decisions_logged")
    for name, (rows, bitwise, seconds, stopped) in results.items():
        ran = rows[-1]["step"] - (stopped is not None)
        print(f"\n{name}: {ran} steps in {seconds:.1f} s ({seconds / max(ran, 1) * 1e3:.1f} ms a step); "
              f"outputs bitwise the all-resident forward at every checkpoint: {bitwise}")
        if stopped:
            print(stopped)
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")
        d = drift(rows)
        print(f"| drift {d['from']}->{d['to']} | " + " | ".join(f"{d[c]:+d}" for c in cols[1:]) + " |")


if __name__ == "__main__":
    main()
