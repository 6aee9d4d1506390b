"""A spec model's host pace, three ways, interleaved over time on one all-resident executor.

    python benchmarks/host_pace.py --model llama8b --workload decode --rounds 25   # on a CUDA machine

Writes the model's random weights (`mode=materialize`, into --dir), then for each round:
  drained       one forward that drains the device before each kernel, then holds the stream
                (engine.measure.probes.HeldStreamHost, group 1): the sum of its kernels' host ns
  held          the same, draining every GROUP kernels (the recorder's host time)
  free          one forward with the stream running free: host wall time and GPU step
  pipelined     5 forwards back to back (as mode=execute runs them): the median GPU step
Rounds are 0.3 s apart, so a host whose pace drifts shows it. Prints one row per round and the
medians and minimums; deletes the weight file.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIPELINED = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--workload", default="decode")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()

    import torch
    from hydra import compose, initialize_config_dir

    from engine.config import register
    from engine.executor.setup import forward_order, open_weight_file, streamed_executor
    from engine.measure.clocks import CudaClock
    from engine.measure.probes import GROUP, HeldStreamHost
    from engine.models import build_spec, forward, make_inputs

    path = Path(args.dir) / f"pace-{args.model}.ptd"
    try:
        subprocess.run([sys.executable, "-m", "engine", f"model={args.model}", f"workload={args.workload}",
                        "mode=materialize", f"out={path}", "hydra.run.dir=/tmp/pace-materialize"],
                       check=True, capture_output=True, cwd=ROOT)
        register()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"model={args.model}", f"workload={args.workload}",
                                               f"weights.file={path}"])
        spec = build_spec(cfg.model, cfg.workload)
        device = torch.device("cuda")
        clock = CudaClock(device)
        rows = []
        with ExitStack() as stack:
            wf = open_weight_file(cfg, spec, stack)
            inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
            executor = streamed_executor(stack, wf, forward_order(spec), backend="cuda", source=cfg.weights.source,
                                         budget_bytes=None, eviction="priority", lookahead=1)

            def step(source: object) -> None:
                with torch.no_grad(), executor.step():
                    forward(spec, source, inputs)

            for _ in range(PIPELINED):  # the first copies the weights in
                step(executor)
            clock.synchronize()
            start = time.perf_counter()
            print("| t s | drained host ms | held host ms | free host wall ms | free GPU step ms | pipelined ms |")
            print("|---|---|---|---|---|---|")
            for _ in range(args.rounds):
                host_ms = []
                for group in (1, GROUP):
                    held = HeldStreamHost(executor, clock, group)
                    step(held)
                    host_ms.append(sum(held.host_ns()) / 1e6)
                    clock.synchronize()
                a = clock.stamp()
                t0 = time.perf_counter_ns()
                step(executor)
                wall_ms = (time.perf_counter_ns() - t0) / 1e6
                b = clock.stamp()
                clock.synchronize()
                stamps = []
                for _ in range(PIPELINED):
                    s = clock.stamp()
                    step(executor)
                    stamps.append((s, clock.stamp()))
                clock.synchronize()
                pipelined = statistics.median(clock.ns(s, e) for s, e in stamps) / 1e6
                rows.append((*host_ms, wall_ms, clock.ns(a, b) / 1e6, pipelined))
                print(f"| {time.perf_counter() - start:.1f} | {' | '.join(f'{v:.2f}' for v in rows[-1])} |",
                      flush=True)
                time.sleep(0.3)
        cols = list(zip(*rows))
        print(f"| median | {' | '.join(f'{statistics.median(c):.2f}' for c in cols)} |")
        print(f"| min | {' | '.join(f'{min(c):.2f}' for c in cols)} |")
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
