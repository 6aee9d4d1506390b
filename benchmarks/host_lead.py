"""How far a step's host runs ahead of the GPU, and what holds it back: measured against simulated.

    python benchmarks/host_lead.py --label train -- +model=ltx model.num_layers=8 workload=train_lora \\
        workload.video_tokens=16384 trace=data/traces/ltx2_train_lora.jsonl.gz activations=sync budget=null
    python benchmarks/host_lead.py --label decode -- model=llama8b workload=decode budget=12000 \\
        weights.eviction=belady trace=data/traces/full/llama8b-decode-full.jsonl.gz
    python benchmarks/host_lead.py --label hf-decode -- model=llama8b_hf workload=decode budget=12000 \\
        weights.eviction=belady weights.lookahead=1

On a CUDA machine: writes the model's random weights into --dir (`mode=materialize`) unless the
overrides name weights.file, records a real module's trace (`mode=record`) unless they name
trace=, then runs `mode=execute` twice, plainly and under torch.profiler (CPU and CUDA
activities), marking the end of each step (engine.executor.setup.end_of_step, which every
execute loop calls). From the profile, for each of the last --steps steps (the host's time
from one step's end to the next):
  launches      CUDA launches the host made in the step (kernels, copies, memsets), and per record
  queued        at each launch, how many launched GPU operations had not yet finished, on the
                stream that ran the most kernels (median, 90th percentile, max)
  lead ms       how long after its launch each operation started on the GPU (median, max)
  blocked       the host's time inside calls that wait for the device (synchronizes, blocking
                copies, cudaFree/Malloc/HostAlloc) and inside launches over --slow-launch-us
                (a launch waits there when the device's queue is full), with the queue at each
With --stacks the profile keeps Python stacks and the engine's functions are listed by the host
time spent inside them in the last step (inclusive; they nest, so the times do not add up).
The simulator's run of the same trace and config reports its launcher's lead in records. Writes
OUT/host_lead-LABEL.json (and the profile, gzipped, with --keep-profile); prints a table last.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Host calls that return only once the device has reached some point.
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaHostRegister",
            "cudaHostUnregister", "cuMemFree", "cuMemAlloc", "cuMemMap", "cuMemUnmap", "cuMemCreate",
            "cuMemRelease", "cuMemSetAccess")
STEP_TAG = "host_lead step "


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def blocking(name: str) -> bool:
    return any(b in name for b in BLOCKING) and not name.endswith("Async")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def analyse(events: list[dict], records_per_step: int, slow_launch_us: float) -> list[dict]:
    """Per tagged step of a Kineto chrome trace's events: launches, queue at each, lead, blocked calls."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("args", {}).get("correlation") in launches]
    streams = Counter(e["args"].get("stream") for e in gpu if e["cat"] == "kernel")
    main_stream = streams.most_common(1)[0][0] if streams else None
    ops = sorted(((launches[e["args"]["correlation"]]["ts"], e["ts"], e["ts"] + e.get("dur", 0))
                  for e in gpu if e["args"].get("stream") == main_stream))
    launch_ts = [o[0] for o in ops]
    host_calls = sorted((e for e in events if e.get("cat") in LAUNCH_CATS), key=lambda e: e["ts"])
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_TAG)),
                   key=lambda e: e["ts"])
    out = []
    for before, tag in zip(marks, marks[1:]):  # a step: from the previous step's end to its own
        a, b = before["ts"], tag["ts"]
        mine = [o for o in ops[bisect.bisect_left(launch_ts, a):bisect.bisect_right(launch_ts, b)]]
        ends_before = sorted(o[2] for o in ops[:bisect.bisect_right(launch_ts, b)])

        def queued(t: float) -> int:
            launched = bisect.bisect_right(launch_ts, t)
            return launched - bisect.bisect_right(ends_before, t)

        depth = [queued(o[0]) for o in mine]
        lead = [(o[1] - o[0]) / 1e3 for o in mine]
        calls = [c for c in host_calls if a <= c["ts"] <= b]
        held: dict[str, list[float]] = defaultdict(list)
        held_at: dict[str, list[int]] = defaultdict(list)
        for c in calls:
            slow = c["name"].startswith(("cudaLaunch", "cuLaunch")) and c.get("dur", 0) > slow_launch_us
            if blocking(c["name"]) or slow:
                key = c["name"] + (" (slow)" if slow else "")
                held[key].append(c.get("dur", 0) / 1e3)
                held_at[key].append(queued(c["ts"]))
        n_launch = sum(1 for c in calls if c.get("args", {}).get("correlation") in launches
                       and c["name"].startswith(("cudaLaunch", "cuLaunch", "cudaMemcpy", "cudaMemset")))
        out.append({
            "step": tag["name"][len(STEP_TAG):],
            "window": [a, b],
            "host_ms": (b - a) / 1e3,
            "launches": n_launch,
            "stream_ops": len(mine),
            "launches_per_record": n_launch / records_per_step,
            "queued_median": statistics.median(depth) if depth else 0,
            "queued_p90": pct(depth, 0.9),
            "queued_max": max(depth, default=0),
            "lead_ms_median": statistics.median(lead) if lead else 0.0,
            "lead_ms_max": max(lead, default=0.0),
            "blocked": {k: {"calls": len(v), "ms": round(sum(v), 3), "queued_median": statistics.median(held_at[k])}
                        for k, v in sorted(held.items(), key=lambda kv: -sum(kv[1]))},
        })
    return out


def engine_functions(events: list[dict], window: list[float], top: int = 25) -> list[tuple[str, tuple[int, float]]]:
    """The engine's Python functions (a with_stack profile's python_function events, on any
    thread) by total inclusive ms inside `window`, outermost calls of each name only."""
    a, b = window
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and a <= e["ts"] <= b and "engine/" in e["name"]:
            spans[e["name"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    totals = {}
    for name, ss in spans.items():
        ss.sort()
        calls, ms, end = 0, 0.0, -1.0
        for s0, s1 in ss:
            if s0 >= end:  # not inside an earlier call of the same function (recursion)
                calls += 1
                ms += (s1 - s0) / 1e3
                end = s1
        totals[name] = (calls, ms)
    return sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]


def simulated_lead(result: Any, records: int) -> dict:
    """The simulated launcher's lead, in records, at each launch of the last step."""
    host = sorted(t for t, track, what in result.events if track == "host" and what.startswith("start "))
    ends = sorted(t for t, track, what in result.events if track == "compute" and what.startswith("end "))
    last = host[-records:]
    depth = [(len(host) - records + i) - bisect.bisect_right(ends, t) for i, t in enumerate(last)]
    return {"queued_median": statistics.median(depth), "queued_p90": pct(depth, 0.9), "queued_max": max(depth),
            "step_ms": result.prediction["step_ms"]}


@contextmanager
def marked_steps(modes: list[Any], prof: Any) -> Iterator[None]:
    """A profiler mark at each step's end in the execute loops of `modes` (the modules that
    call end_of_step); the profiler starts at the first, after the reference runs."""
    import torch

    count = iter(range(10**6))
    originals = [(m, m.end_of_step) for m in modes]

    def marking(fn: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            fn(*args, **kw)
            i = next(count)
            if i == 0:
                prof.start()
            with torch.profiler.record_function(f"{STEP_TAG}{i}"):
                pass
        return wrapped

    for m, fn in originals:
        m.end_of_step = marking(fn)
    try:
        yield
    finally:
        for m, fn in originals:
            m.end_of_step = fn
        if next(count) > 0:  # it started
            prof.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--steps", type=int, default=3, help="steps analysed (the last ones)")
    ap.add_argument("--run-steps", type=int, default=6, help="workload.steps of each run")
    ap.add_argument("--slow-launch-us", type=float, default=50.0)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--keep-profile", action="store_true")
    ap.add_argument("--stacks", action="store_true", help="profile Python stacks; list the engine's functions")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import engine.modes.execute as execute
    import engine.modes.module as module_mode
    from engine.config import register
    from engine.job import is_module_model, prepare
    from engine.units import budget_bytes
    from sim import simulate

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    register()

    def config(extra: list[str]) -> Any:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            # compose takes a config group as `model=X` where the command line takes `+model=X`
            return compose("config", overrides=[o.removeprefix("+") if o.startswith("+model=") else o
                                                for o in [*args.overrides, *extra]])

    def engine_cli(*extra: str) -> None:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "engine", *args.overrides, *extra], check=True, cwd=ROOT)
        log(f"{extra[0]} in {time.perf_counter() - t:.0f} s")

    extra = ["mode=execute", f"workload.steps={args.run_steps}", "sim.timeline=false"]
    module = is_module_model(config([]).model)
    weight_file = None
    if not any(o.startswith("weights.file=") for o in args.overrides):
        weight_file = Path(args.dir) / f"host-lead-{args.label}{'.safetensors' if module else '.ptd'}"
        engine_cli("mode=materialize", f"out={weight_file}", f"hydra.run.dir=/tmp/host-lead-{args.label}-materialize")
        extra.append(f"weights.file={weight_file}")
    try:
        if module and not any(o.startswith("trace=") for o in args.overrides):
            rec = Path(f"/tmp/host-lead-{args.label}-record")
            engine_cli("mode=record", *extra[3:], f"hydra.run.dir={rec}")
            extra.append(f"trace={rec / 'trace.jsonl'}")
        cfg = config(extra)
        job = prepare(cfg, Path(f"/tmp/host-lead-{args.label}"))
        plain = execute.execute_mode(job).report["measurement"]
        log(f"plain run: step {plain['step_ms']:.2f} ms")
        profile_path = out / f"host_lead-{args.label}.trace.json"
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            with_stack=args.stacks)
        with marked_steps([execute, module_mode], prof):
            profiled = execute.execute_mode(job).report["measurement"]
        prof.export_chrome_trace(str(profile_path))
        log(f"profiled run: step {profiled['step_ms']:.2f} ms")
    finally:
        if weight_file is not None:
            weight_file.unlink(missing_ok=True)
    events = json.loads(profile_path.read_text())["traceEvents"]
    if args.keep_profile:
        with gzip.open(str(profile_path) + ".gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    profile_path.unlink()
    records = len(job.trace.records)
    steps = analyse(events, records, args.slow_launch_us)[-args.steps:]
    weights = cfg.weights  # a module's execute wrote what an "auto" chose into it
    if job.choice is not None:  # a spec model's eviction or lookahead "auto": simulate what the run used
        weights = OmegaConf.merge(weights, {"eviction": job.choice.eviction, "lookahead": job.choice.lookahead})
    sim = simulate(job.trace, weights, cfg.activations, cfg.hardware, budget_bytes(cfg.budget), args.run_steps,
                   allow_below_floor=False, loop=cfg.workload.loop)
    sim_lead = simulated_lead(sim, records)
    result = {"label": args.label, "overrides": args.overrides, "device": (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "records_per_step": records, "plain_step_ms": plain["step_ms"], "profiled_step_ms": profiled["step_ms"],
              "steps": steps, "simulated": {**sim_lead, "launch_queue_depth": cfg.hardware.launch_queue_depth,
                                            "hardware": cfg.hardware.name}}
    (out / f"host_lead-{args.label}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.label}: {records} records a step; step {plain['step_ms']:.2f} ms plain, "
          f"{profiled['step_ms']:.2f} ms profiled; simulated {sim_lead['step_ms']:.2f} ms ({cfg.hardware.name})")
    print("| step | host ms | launches (per record) | queued median / p90 / max | lead ms median / max |")
    print("|---|---|---|---|---|")
    for s in steps:
        print(f"| {s['step']} | {s['host_ms']:.1f} | {s['launches']} ({s['launches_per_record']:.1f}) | "
              f"{s['queued_median']:.0f} / {s['queued_p90']:.0f} / {s['queued_max']} | "
              f"{s['lead_ms_median']:.2f} / {s['lead_ms_max']:.2f} |")
    print(f"| simulated, in records | | | {sim_lead['queued_median']:.0f} / {sim_lead['queued_p90']:.0f} / "
          f"{sim_lead['queued_max']} (a queue of {cfg.hardware.launch_queue_depth} launches) | |")
    if args.stacks and steps:
        print("\nengine functions by inclusive host ms in the last step: function: calls, ms")
        for name, (calls, ms) in engine_functions(events, steps[-1]["window"]):
            print(f"  {name}: {calls}, {ms:.2f}")
    print("\nthe host blocked in (last step): call: calls, ms, queued median")
    for k, v in steps[-1]["blocked"].items() if steps else ():
        print(f"  {k}: {v['calls']}, {v['ms']:.2f} ms, {v['queued_median']:.0f}")


if __name__ == "__main__":
    main()
