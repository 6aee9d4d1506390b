"""simulate(): a trace and a config in, a prediction out, on the SimPy clock.

Wires the hardware models (link, pool, compute stream) to the launcher (the
simulated host thread) that drives the policies, runs `steps` steps, and
derives the prediction. Times are integer nanoseconds throughout.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import simpy

from engine.gc_pause import paused_gc
from engine.policy import LOOPS, ActivationPolicy, Decision, WeightPolicy
from engine.policy.activations import build_activation_policy
from engine.policy.placement import Placement, all_resident, place, residency
from engine.trace import Trace, recorded_host_bound
from sim.activations import SavedActivations
from sim.compute import ComputeStream, trace_sustained_slowdown
from sim.launcher import Launcher
from sim.link import PcieLink, source_gbps
from sim.prediction import predict, step_ends
from sim.pool import DevicePool

Event = tuple[int, str, str]  # (time ns, track, what): track is host | compute | h2d | d2h
# host_fitted: the steps each trial runs (the warm ones after the first two are timed), and
# how close to the measured step, and in how many trials, the fit stops.
HOST_FIT_STEPS = 4
HOST_FIT_TOLERANCE = 1e-3
HOST_FIT_ITERATIONS = 30


@dataclass
class SimResult:
    """What a run predicts (fields of `prediction`: sim/prediction.py) and how it got there.

    Events: each track holds one span at a time, as "start X" then "end X" (X a
    kernel on host and compute; a weight, "spill T" or "restore T" on h2d/d2h);
    the host track is the launcher's, with instants "wait-alloc W" (a fetch
    waiting for a free) and "finalize C" (an in-flight cap reached: the
    launcher waits for copy C).
    """

    prediction: dict
    decisions: list[Decision]  # every policy answer, all steps, in the order asked
    events: list[Event]  # spans as "start X" / "end X" per track, plus host instants
    device_bytes: list[tuple[int, int]]  # (time ns, weights + activations on the device)
    step_ends_ns: list[int]

    def settled(self) -> bool:
        """Whether the last two steps' decisions are the same: the policies have settled,
        and later steps repeat them (priority and lru do from the second step; belady's
        band of streamed weights may move a little every step)."""
        last = len(self.step_ends_ns) - 1
        if last < 1:
            return False
        by_step: dict[int, list[tuple]] = {last - 1: [], last: []}
        for d in self.decisions:
            if d.step in by_step:
                by_step[d.step].append((d.position, d.action, d.target, d.detail))
        return by_step[last - 1] == by_step[last]


def simulate(trace: Trace, weights_cfg: Any, activations_cfg: Any, hardware: Any,
             budget_bytes: int | None, steps: int, allow_below_floor: bool, loop: str = "free") -> SimResult:
    """Predict `steps` steps of `trace` under the configured policies, run as `loop`
    (engine.policy.LOOPS) runs them.

    Below the floor the weight policy raises BelowFloorError unless
    `allow_below_floor`; then the hazards are in the prediction.
    """
    placement = place(trace.access_order(), budget_bytes, backend_granule(weights_cfg, hardware))
    trace = as_run(host_fitted(trace, hardware), placement)
    weights = residency(placement, weights_cfg.eviction, weights_cfg.lookahead, allow_below_floor)
    activations = None
    if activations_cfg is not None and any(r.saved for r in trace.records):
        activations = build_activation_policy(activations_cfg, trace.num_layers)
    return drive(trace, weights, activations, hardware, activations_cfg,
                 source_gbps(hardware, weights_cfg.source), budget_bytes, steps, placement, loop)


def as_run(trace: Trace, placement: Placement) -> Trace:
    """`trace` as the executor runs it: a recorded module whose weights all fit the budget
    is bound once and runs without hooks (engine/policy/placement.py `all_resident`), at its
    plain step's host times (header "plain_host_factor"), an inference's or a training step's."""
    factor = trace.header.get("plain_host_factor")
    if factor is None or not all_resident(placement):
        return trace
    return Trace(trace.header, trace.weight_sizes,
                 tuple(replace(r, host_ns=round(r.host_ns * factor)) for r in trace.records))


def host_fitted(trace: Trace, hardware: Any) -> Trace:
    """A recording whose all-resident step was the host's (engine.trace.recorded_host_bound),
    its host times scaled so this simulator runs that step, as the recorder ran it (back to
    back, through the hooks, every weight resident), in the pipelined time it measured
    (header "host_fit": the factor). The recorders scale such host times to sum to that step;
    where a run of records takes the GPU longer than the host, the host waits there on CUDA's
    launch queue, and host times that sum to the step overshoot it by those waits. A
    recording the GPU bounds, or whose kernels alone outlast that step, is returned as it is.
    Fitted once per trace and hardware object: every prediction from a trace asks again."""
    if "host_fit" in trace.header or not recorded_host_bound(trace.header):
        return trace
    key = (id(trace), id(hardware))
    known = _FITTED.get(key)
    if known is not None and known[0]() is trace and known[1] is hardware:
        return known[2] or trace
    fitted = _fit_host(trace, hardware)
    _FITTED[key] = (weakref.ref(trace), hardware, None if fitted is trace else fitted)
    weakref.finalize(trace, _FITTED.pop, key, None)
    return fitted


# host_fitted's fits: (id(trace), id(hardware)) -> (the trace, weakly; the hardware, held so its
# id is not reused while the entry lives; the fitted trace, None where it is the trace itself).
# An entry goes with its trace.
_FITTED: dict[tuple[int, int], tuple[weakref.ref, Any, Trace | None]] = {}


def _fit_host(trace: Trace, hardware: Any) -> Trace:
    target = trace.header["pipelined_step_ns"] / 1e6
    order = trace.access_order()
    placement = place(order, None, 1)
    weights_gbps = source_gbps(hardware, "pinned")

    def step(factor: float) -> float:
        result = drive(_host_scaled(trace, factor), residency(placement, "priority", 1), None, hardware, None,
                       weights_gbps, None, HOST_FIT_STEPS, placement)
        return result.prediction["mean_step_ms"]

    lo, hi = 0.0, 1.0
    below, above = step(lo) - target, step(hi) - target
    if above <= HOST_FIT_TOLERANCE * target or below >= 0:
        return trace
    factor, kept = hi, 0
    for _ in range(HOST_FIT_ITERATIONS):  # the step grows with the host's times: regula falsi, Illinois' way
        factor = (lo * above - hi * below) / (above - below)
        off = step(factor) - target
        if abs(off) <= HOST_FIT_TOLERANCE * target:
            break
        if off > 0:
            hi, above = factor, off
            below, kept = (below / 2 if kept == -1 else below), -1
        else:
            lo, below = factor, off
            above, kept = (above / 2 if kept == 1 else above), 1
    fitted = _host_scaled(trace, factor)
    return Trace({**trace.header, "host_fit": factor}, fitted.weight_sizes, fitted.records)


def _host_scaled(trace: Trace, factor: float) -> Trace:
    return Trace(trace.header, trace.weight_sizes,
                 tuple(replace(r, host_ns=round(r.host_ns * factor)) for r in trace.records))


def backend_granule(weights_cfg: Any, hardware: Any) -> int:
    """The granule the configured backend places weights in (engine/policy/placement.py)."""
    return int(hardware.vmm_granule_bytes) if weights_cfg.backend == "vmm" else 1


def drive(trace: Trace, weights: WeightPolicy, activations: ActivationPolicy | None, hardware: Any,
          activations_cfg: Any, weight_gbps: float, budget_bytes: int | None, steps: int,
          placement: Placement | None = None, loop: str = "free") -> SimResult:
    """Run the given policy objects on the simulated hardware (simulate() builds them).
    `placement`: where the backend places the weights (None: each at its own size)."""
    if steps < 1:
        raise ValueError(f"steps={steps}; simulate at least one step")
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} is not one of {', '.join(LOOPS)}")
    if activations is not None and activations_cfg is None:
        raise ValueError("an activation policy needs its activations config (the in-flight caps); "
                         "pass activations_cfg")
    env = simpy.Environment()
    events: list[Event] = []

    def log(t: int, track: str, what: str) -> None:
        events.append((t, track, what))

    link = PcieLink(env, hardware, log)
    pool = DevicePool(env, budget_bytes)
    if placement is not None and placement.resident:
        pool.allocate(placement.resident_bytes, "the weights resident for the run")
    # A recording that measured its own slowdown under copies carries it (engine/modules/record.py).
    slowdown = trace.header.get("compute_slowdown_under_copy", hardware.compute_slowdown_under_copy)
    compute = ComputeStream(env, link, float(slowdown), log, trace_sustained_slowdown(trace.header, hardware),
                            float(hardware.sustained_window_ms) * 1e6)
    launcher = Launcher(env, trace, weights, activations, link, pool, compute, hardware, weight_gbps, steps, log,
                        placement=placement, loop=loop)
    if any(r.saved for r in trace.records):
        launcher.saved = SavedActivations(env, link, pool, compute, hardware,
                                          activations_cfg if activations is not None else None,
                                          issued=launcher.issued, log=log)
    process = env.process(launcher.run())
    with paused_gc():  # engine/gc_pause.py
        env.run()
    n = len(trace.records)
    if process.is_alive or compute.completed < steps * n:
        raise RuntimeError(
            f"simulation stalled at {env.now} ns after {compute.completed} of {steps * n} kernels: "
            f"{len(pool.waiting)} weight allocation(s) waiting with {pool.weight_bytes} of "
            f"{pool.cap} budget bytes in use and nothing left to free them")
    return SimResult(
        prediction=predict(launcher, compute, pool, n, steps),
        decisions=launcher.decisions,
        events=events,
        device_bytes=pool.series,
        step_ends_ns=step_ends(compute, n, steps),
    )
