"""How long the simulator takes for one LTX-2 inference step (target: <= 100 ms).

    python benchmarks/sim_speed.py [--runs 7] [--budget 16000] [--eviction belady]

Composes the real config (+model=ltx, workload=infer, hardware h100_pcie5),
synthesizes the trace once, then times `simulate(steps=1)` end to end (policy
construction and decisions included), the weight policy's decisions alone,
and the simulator alone (the same decisions replayed), so each share is
visible; then `simulate(steps=workload.steps)`, the run the CLI makes, per
step. Prints medians.

Each run starts from a collected heap, so no run pays a full collection for
an earlier run's garbage; the collections a run triggers itself stay in its
time, and the time they took is printed beside it.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from engine.config import register  # noqa: E402
from engine.units import budget_bytes  # noqa: E402
from engine.policy import Decision  # noqa: E402
from engine.policy.weights import WeightResidency  # noqa: E402
from engine.models import build_spec  # noqa: E402
from engine.models.synthesize import synthesize  # noqa: E402
from sim import drive, simulate  # noqa: E402
from sim.link import source_gbps  # noqa: E402


class ReplayedWeights:
    """A WeightPolicy that answers from a recorded run: times the driver alone."""

    def __init__(self, answers: list[list[Decision]]):
        self.answers = answers
        self.log: list[Decision] = []

    def issue(self, position: int) -> list[Decision]:
        return self.answers[position]


class _GcClock:
    """Time the garbage collector spends while installed (gc.callbacks)."""

    def __init__(self):
        self.total = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


def _median_ms(fn, runs: int) -> tuple[float, float]:
    """Median wall ms of `fn`, and the median ms of collection inside it."""
    times, collecting = [], []
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        for _ in range(runs):
            gc.collect()
            clock.total = 0.0
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            collecting.append(clock.total)
    finally:
        gc.callbacks.remove(clock)
    return statistics.median(times) * 1e3, statistics.median(collecting) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--budget", type=float, default=16000, help="MB")
    ap.add_argument("--eviction", default="belady")
    args = ap.parse_args()

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+model=ltx", "workload=infer", f"weights={args.eviction}",
                                           f"budget={args.budget}"])
    trace = synthesize(build_spec(cfg.model, cfg.workload), cfg.workload, cfg.hardware)
    budget = budget_bytes(cfg.budget)

    def one_step():
        return simulate(trace, cfg.weights, cfg.activations, cfg.hardware, budget, 1, False)

    def cli_run():
        simulate(trace, cfg.weights, cfg.activations, cfg.hardware, budget, cfg.workload.steps, False)

    def policy_only() -> list[list[Decision]]:
        policy = WeightResidency(trace.access_order(), budget, cfg.weights.eviction, cfg.weights.lookahead)
        return [policy.issue(pos) for pos in range(len(trace.records))]

    answers = policy_only()

    def driver_only():
        drive(trace, ReplayedWeights(answers), None, cfg.hardware, cfg.activations,
              source_gbps(cfg.hardware, cfg.weights.source), budget, 1)

    result = one_step()  # warm imports and caches
    total, total_gc = _median_ms(one_step, args.runs)
    policy, _ = _median_ms(policy_only, args.runs)
    driver, _ = _median_ms(driver_only, args.runs)
    steps = cfg.workload.steps
    run, run_gc = _median_ms(cli_run, args.runs)
    p = result.prediction
    print(f"LTX-2 inference, {len(trace.records)} kernels, {len(trace.weight_sizes)} weights, "
          f"budget {args.budget:.0f} MB, {args.eviction}, lookahead {cfg.weights.lookahead}")
    print(f"simulated step: {p['step_ms']:.1f} ms, {p['h2d_bytes'] / 1e9:.2f} GB H2D, "
          f"{len(result.events)} events, {len(result.decisions)} decisions")
    print(f"wall per simulated step (median of {args.runs}): {total:.1f} ms "
          f"(garbage collection {total_gc:.1f} ms); weight policy alone {policy:.1f} ms; "
          f"simulator alone (decisions replayed) {driver:.1f} ms")
    print(f"the CLI's {steps}-step run: {run:.1f} ms, {run / steps:.1f} ms a step "
          f"(garbage collection {run_gc:.1f} ms)")


if __name__ == "__main__":
    main()
