"""Executor benchmark on a GPU: an LTX-2-shaped model streamed through the capped pool.

    python benchmarks/executor_bench.py                    # 48 blocks, budgets 8000,16000,24000 MB
    python benchmarks/executor_bench.py --blocks 16 --evictions belady

Measures, with CUDA events after warm-up (medians, random bf16 weights):
- H2D bandwidth from the registered weight-file mapping (256 MiB copies);
- the all-resident forward (every weight on the GPU beforehand);
- the executor at each budget and eviction, the PCIe floor of its streamed
  bytes (bytes / bandwidth) and the target max(compute, floor);
- the same decisions replayed without the policy's host cost (what the
  executor alone reaches), the bare policy's host time per step;
- budget = model size (nothing streamed after the first step) vs all resident;
- the capped pool at budget + the default slack, and with room to grow (how
  much it reserves): does it ever refuse an allocation while the logical bytes
  are under the budget (fragmentation)?
Writes bench.json next to --out and prints a table last.

Results: benchmarks/results/executor-h100-2026-11-22.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.errors import ExecutorError  # noqa: E402
from engine.executor import WeightExecutor  # noqa: E402
from engine.executor.cuda import CudaBackend  # noqa: E402
from engine.policy.placement import pool_slack_bytes  # noqa: E402
from engine.executor.setup import (bitwise_equal, compute_device, device_name, forward_order,  # noqa: E402
                                   shared_host_weights)
from engine.models import build_spec, forward, load_model_config, make_inputs  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.policy import AccessOrder, Decision  # noqa: E402
from engine.policy.weights import WeightResidency  # noqa: E402
from engine.units import MB  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402

GiB = 1 << 30
WORKLOAD = SimpleNamespace(name="infer", kind="infer", batch=1, video_tokens=6144, audio_tokens=128,
                           text_tokens=256, context_tokens=0, lora_rank=0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ltx_spec(model: str, blocks: int | None, workload: SimpleNamespace = WORKLOAD):
    cfg = load_model_config(model)
    if blocks is not None and blocks != cfg.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=blocks)
    return build_spec(cfg, workload)


def resident_outputs(spec, wf: WeightFile, inputs: dict) -> dict:
    """One forward with every weight of `wf` on the GPU: the reference outputs; the
    weights' memory is given back."""
    with torch.no_grad():
        weights = {n: t.to("cuda") for n, t in wf.tensors().items()}
        out = forward(spec, DictSource(spec, weights), inputs)
        del weights
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free if path.exists() else 0


def choose_dir(need: int, candidates: list[Path]) -> Path | None:
    for d in candidates:
        d.mkdir(parents=True, exist_ok=True)
        if free_bytes(d) > need + 2 * GiB:
            return d
    return None


def median_ms(fn, warmup: int, reps: int, before=None) -> tuple[float, list[float]]:
    """The median device ms of `reps` calls of `fn` after `warmup` untimed ones (CUDA events),
    and each; `before`, if given, runs ahead of each timed call, untimed (e.g. a hold)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), times


def h2d_gbps(src: torch.Tensor, chunk: int = 256 << 20, reps: int = 8) -> float:
    """Host-to-device bandwidth copying `chunk` bytes of `src` (uint8) at a time."""
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    n = src.numel() // chunk

    def run() -> None:
        with torch.cuda.stream(stream):
            for i in range(reps):
                j = i % n
                dst.copy_(src[j * chunk:(j + 1) * chunk], non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    ms, _ = median_ms(run, 1, 5)
    return reps * chunk / ms / 1e6


class Replay:
    """A policy stand-in that answers with a recorded log: the executor's cost without the policy's."""

    def __init__(self, log: list[Decision], n: int):
        self._by = {}
        for d in log:
            self._by.setdefault((d.step, d.position), []).append(d)
        self._n = n
        self._issued = -1
        self.log: list[Decision] = []

    def issue(self, position: int) -> list[Decision]:
        self._issued += 1
        step = self._issued // self._n
        return self._by.get((step, position), [])


def recorded_log(order: AccessOrder, budget: int | None, eviction: str, lookahead: int, steps: int):
    policy = WeightResidency(order, budget, eviction, lookahead)
    per_step = []
    for _ in range(steps):
        t = time.perf_counter()
        for i in range(len(order)):
            policy.issue(i)
        per_step.append((time.perf_counter() - t) * 1e3)
    return policy.log, statistics.median(per_step[1:] or per_step)


def run_executor(spec, order, host, inputs, reference, budget, eviction, lookahead, steps, replay=None) -> dict:
    ex = WeightExecutor(order, host, budget_bytes=budget, eviction=eviction, lookahead=lookahead, backend="cuda")
    if replay is not None:
        ex.policy = replay
    issue_ms = []
    outs = None
    try:
        with torch.no_grad():
            for _ in range(steps):
                t = time.perf_counter()
                with ex.step():
                    outs = forward(spec, ex, inputs)
                issue_ms.append((time.perf_counter() - t) * 1e3)
    except ExecutorError as err:
        ex.close()
        return {"budget_bytes": budget, "eviction": eviction, "replayed": replay is not None,
                "refused": str(err)[:400]}
    rows = ex.telemetry()
    bitwise = all(bitwise_equal(outs[k], reference[k]) for k in reference)
    cap, reserved = ex.backend.cap_bytes, ex.backend.reserved_peak_bytes()
    ex.close()
    steady = rows[1:]
    return {
        "budget_bytes": budget, "eviction": eviction, "lookahead": lookahead, "replayed": replay is not None,
        "step_ms": statistics.median(r["step_ms"] for r in steady),
        "step_ms_all": [round(r["step_ms"], 2) for r in rows],
        "host_issue_ms": statistics.median(issue_ms[1:]),
        "h2d_bytes": statistics.median(r["h2d_bytes"] for r in steady),
        "fetches": steady[-1]["fetches"], "prefetches": steady[-1]["prefetches"],
        "hits": steady[-1]["hits"], "evictions": steady[-1]["evictions"],
        "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
        "peak_resident_bytes": max(r["peak_resident_bytes"] for r in rows),
        "pool_cap_bytes": cap, "pool_reserved_peak_bytes": reserved, "bitwise_equal": bitwise,
    }


def pool_probe(order, host, budget, lookahead, log, slack, steps=3) -> dict:
    """Replay a policy log's allocations, frees and copies (no compute) in a pool of
    budget + slack: does fragmentation ever refuse a block the accounting allows?"""
    backend = CudaBackend(budget, slack_bytes=slack)
    ex = WeightExecutor(order, host, budget_bytes=budget, lookahead=lookahead, backend=backend)
    ex.policy = Replay(log, len(order))
    error = None
    try:
        for _ in range(steps):
            with ex.step():
                for i in range(len(order)):
                    ex.fetch(i)
    except ExecutorError as err:
        error = str(err)[:300]
    rows = ex.telemetry()
    out = {"budget_bytes": budget, "slack_bytes": slack, "refused": error,
           "steps_done": len(rows),
           "used_high": max((r["peak_device_bytes"] for r in rows), default=0),
           "logical_high": max((r["peak_resident_bytes"] for r in rows), default=0),
           "reserved_high": backend.reserved_peak_bytes()}
    ex.close()
    return out


def alloc_wrap_us(reps: int = 2000) -> float:
    """Host cost of one pool allocation + torch wrap + mark + free (the per-fetch fixed cost)."""
    b = CudaBackend(1 << 30, slack_bytes=0)
    t = time.perf_counter()
    for _ in range(reps):
        block = b.alloc(8 << 20)
        b.free_after(block, b.mark())
    us = (time.perf_counter() - t) / reps * 1e6
    b.close()
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ltx")
    ap.add_argument("--blocks", default="auto", help="number of blocks, or auto: 48 if the file fits, else 16")
    ap.add_argument("--dir", default=None, help="where the weight file goes (default: /dev/shm, then ./.bench)")
    ap.add_argument("--budgets", default="8000,16000,24000")
    ap.add_argument("--evictions", default="belady,lru,priority")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per config; the first warms and is not counted")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    device = compute_device("cuda", no_cuda="executor_bench.py needs a CUDA device")
    result: dict = {"device": device_name(device), "torch": torch.__version__}
    out_path = Path(args.out) / "bench.json"

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    full = ltx_spec(args.model, None)
    candidates = [Path(args.dir)] if args.dir else [Path("/dev/shm/offload-bench"), Path(".bench")]
    if args.blocks == "auto":
        where = choose_dir(full.model_bytes, candidates)
        blocks = full.num_layers if where else 16
        where = where or choose_dir(ltx_spec(args.model, 16).model_bytes, candidates)
    else:
        blocks = int(args.blocks)
        where = choose_dir(ltx_spec(args.model, blocks).model_bytes, candidates)
    if where is None:
        raise SystemExit(f"no room for the weight file in {candidates}")
    spec = ltx_spec(args.model, blocks)
    order = forward_order(spec)
    result.update(model=spec.name, blocks=blocks, model_bytes=spec.model_bytes, weights=len(spec.weights),
                  kernels=len(spec.kernels), file_dir=str(where), file_dir_free=free_bytes(where))
    log(f"{spec.name}: {blocks} blocks, {spec.model_bytes / 1e9:.2f} GB, {len(spec.weights)} weights, "
        f"{len(spec.kernels)} kernels; file in {where} ({free_bytes(where) / 1e9:.0f} GB free)")

    path = where / f"{spec.name}-{blocks}.ptd"
    t = time.perf_counter()
    materialize(spec, path, seed=0)
    result["materialize_s"] = time.perf_counter() - t
    log(f"materialized {path} in {result['materialize_s']:.1f} s")

    stack = ExitStack()
    wf = WeightFile(path, spec)
    stack.callback(wf.close)
    t = time.perf_counter()
    host = shared_host_weights(stack, wf, "mmap_registered", "cuda")  # registered once for every config
    result["register_s"] = time.perf_counter() - t
    flat = wf.data_view()[:4 << 30]
    result["h2d_gbps"] = h2d_gbps(flat)
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    result["h2d_pinned_gbps"] = h2d_gbps(pinned)
    del flat, pinned
    result["alloc_wrap_free_us"] = alloc_wrap_us()
    log(f"registered in {result['register_s']:.2f} s; H2D {result['h2d_gbps']:.1f} GB/s from the mapping, "
        f"{result['h2d_pinned_gbps']:.1f} pinned; alloc+wrap+free {result['alloc_wrap_free_us']:.1f} us")
    save()

    inputs = make_inputs(spec, WORKLOAD, device="cuda", seed=1)
    weights = {n: t.to("cuda", non_blocking=True) for n, t in host.items()}
    torch.cuda.synchronize()
    outs = []

    def resident() -> None:
        with torch.no_grad():
            outs.append(forward(spec, DictSource(spec, weights), inputs))

    result["resident_ms"], times = median_ms(resident, 2, 5)
    reference = outs[0]
    result["resident_repeatable"] = all(bitwise_equal(o[k], reference[k]) for o in outs for k in reference)
    result["resident_ms_all"] = [round(x, 2) for x in times]
    del weights, outs
    torch.cuda.empty_cache()
    log(f"all resident: {result['resident_ms']:.1f} ms {result['resident_ms_all']} "
        f"(repeatable bitwise: {result['resident_repeatable']})")
    save()

    bw = result["h2d_gbps"] * 1e9
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = [(ev, b) for ev in args.evictions.split(",") for b in budgets if b * MB < spec.model_bytes]
    logs: dict = {}
    policy_ms = result["policy_ms_per_step"] = {}
    for ev, b in configs:
        logs[ev, b], policy_ms[f"{ev}-{b}"] = recorded_log(order, b * MB, ev, args.lookahead, args.steps)
    log(f"bare policy host ms/step: {', '.join(f'{k} {v:.0f}' for k, v in policy_ms.items())}")
    save()

    largest = max(order.sizes.values())
    probes = result["pool_probes"] = []
    for ev, b in configs:
        for slack in (pool_slack_bytes(largest), b * MB // 2):
            p = pool_probe(order, host, b * MB, args.lookahead, logs[ev, b], slack)
            p["eviction"] = ev
            probes.append(p)
            log(f"pool {ev} {b} MB + slack {slack / MB:.0f} MB: "
                f"refused={'no' if p['refused'] is None else 'YES'}; used high {p['used_high'] / MB:.0f}, logical "
                f"high {p['logical_high'] / MB:.0f}, reserved high {p['reserved_high'] / MB:.0f} MB")
        save()

    runs = result["runs"] = []

    def record(r: dict, label: str) -> None:
        runs.append(r)
        if "refused" in r:
            log(f"{label}: REFUSED {r['refused']}")
        else:
            r["pcie_floor_ms"] = r["h2d_bytes"] / bw * 1e3
            r["target_ms"] = max(result["resident_ms"], r["pcie_floor_ms"])
            log(f"{label}: {r['step_ms']:.1f} ms (steps {r['step_ms_all']}), {r['h2d_bytes'] / 1e9:.2f} GB/step, "
                f"floor {r['pcie_floor_ms']:.1f} ms, host issue {r['host_issue_ms']:.1f} ms, "
                f"peak used {r['peak_device_bytes'] / MB:.0f} MB, bitwise {r['bitwise_equal']}")
        save()

    for ev, b in configs:
        r = run_executor(spec, order, host, inputs, reference, b * MB, ev, args.lookahead, args.steps)
        r["policy_ms"] = policy_ms[f"{ev}-{b}"]
        record(r, f"{ev} {b} MB")
        if ev == "belady":
            r = run_executor(spec, order, host, inputs, reference, b * MB, ev, args.lookahead, args.steps,
                             replay=Replay(logs[ev, b], len(order)))
            r["policy_ms"] = 0.0
            record(r, f"belady {b} MB, decisions replayed (no policy cost)")

    mid = budgets[len(budgets) // 2]
    for lookahead in (4, 8):
        r = run_executor(spec, order, host, inputs, reference, mid * MB, "belady", lookahead, args.steps)
        record(r, f"belady {mid} MB, lookahead {lookahead}")

    model_mb = math.ceil(spec.model_bytes / MB)
    r = run_executor(spec, order, host, inputs, reference, model_mb * MB, "belady", args.lookahead,
                     args.steps)
    record(r, f"budget = model size ({model_mb} MB)")
    if "refused" not in r:
        r["target_ms"] = result["resident_ms"]
        log(f"budget = model size vs all resident: {r['step_ms'] / result['resident_ms'] - 1:+.1%}")
    stack.close()

    print()
    print(f"device: {result['device']}; {spec.name} {blocks} blocks, {spec.model_bytes / 1e9:.2f} GB bf16, "
          f"{WORKLOAD.video_tokens} video tokens; H2D {result['h2d_gbps']:.1f} GB/s (registered mmap)")
    print(f"all resident forward: {result['resident_ms']:.1f} ms")
    print("| eviction | budget MB | step ms | streamed GB/step | PCIe floor ms | target ms | vs target "
          "| host issue ms | policy ms/step | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        name = r["eviction"] + (" (replayed)" if r["replayed"] else "") + (
            f" lookahead {r['lookahead']}" if r.get("lookahead", args.lookahead) != args.lookahead else "")
        if "refused" in r:
            print(f"| {name} | {r['budget_bytes'] // MB} | refused | | | | | | | |")
            continue
        print(f"| {name} | {r['budget_bytes'] // MB} | {r['step_ms']:.1f} | {r['h2d_bytes'] / 1e9:.2f} | "
              f"{r['pcie_floor_ms']:.1f} | {r['target_ms']:.1f} | {r['step_ms'] / r['target_ms'] - 1:+.1%} | "
              f"{r['host_issue_ms']:.1f} | {r.get('policy_ms', float('nan')):.0f} | {r['bitwise_equal']} |")


if __name__ == "__main__":
    main()
