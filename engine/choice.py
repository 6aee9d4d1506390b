"""The simulator's choice of eviction policy and lookahead: one rule for the CLI's
`weights.eviction=auto` / `weights.lookahead=auto` and `engine.offload(eviction="auto")`.

`choose` simulates each candidate over enough steps for its long-run mean and keeps
the fastest. An "auto" lookahead starts at DEFAULT_LOOKAHEAD (or the largest of
LOOKAHEADS whose floor the budget clears, if smaller) and walks down and up through
LOOKAHEADS while the step falls: more lookahead hides more copy time but leaves less
of the budget pinned, so a policy's step falls, then rises. Only the policies within
WALK_WITHIN of the fastest at the start walk: the best lookahead differs by policy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from engine.config import WeightsConfig
from engine.policy import AccessOrder
from engine.policy.placement import place
from engine.policy.eviction import EVICTIONS
from engine.policy.floor import floor
from engine.trace import Trace

if TYPE_CHECKING:
    from sim import SimResult

AUTO = "auto"
LOOKAHEADS = (1, 2, 3, 4)  # an "auto" lookahead is one of these
DEFAULT_LOOKAHEAD = WeightsConfig.lookahead  # where nothing is simulated, and where the walk starts
# The policies within this factor of the fastest at the start walk their lookahead: one further
# behind is not expected to overtake by its lookahead alone
# (benchmarks/results/choice-speed-cpu-2026-11-26.md).
WALK_WITHIN = 1.25
# Steps simulated for a candidate, whose step is the mean of all but the first two (the
# prediction's mean_step_ms): SHORT_RUN_STEPS, and LONG_RUN_STEPS when the short run's last two
# steps decided differently (belady's decisions need not repeat from step to step).
SHORT_RUN_STEPS = 4
LONG_RUN_STEPS = 16


@dataclass(frozen=True)
class Choice:
    """The chosen eviction and lookahead, what was "auto" (`chose`: "eviction",
    "lookahead" or both), every simulated candidate's long-run mean step (ms, keyed
    "eviction/lookahead"), and the chosen one's simulation (None once forgotten)."""

    eviction: str
    lookahead: int
    chose: tuple[str, ...]
    candidates_ms: dict[str, float]
    result: SimResult | None

    def without_result(self) -> Choice:
        """The same choice without its simulation, to keep (a sweep's memo)."""
        return replace(self, result=None)


def fitting_lookaheads(order: AccessOrder, budget: int | None, granule: int = 1) -> list[int]:
    """The LOOKAHEADS whose floor `budget` clears on a backend placing weights in
    `granule`s (all of them when everything is resident); the floor grows with the
    lookahead, so this is 1..k."""
    placed = place(order, None, granule)
    return [la for la in LOOKAHEADS
            if budget is None or placed.resident_bytes + floor(placed.order, la).bytes <= budget]


def start_lookahead(fits: list[int]) -> int:
    """Where an "auto" lookahead starts, and what it is where nothing is simulated:
    DEFAULT_LOOKAHEAD, else the largest that fits, else the smallest (its floor is the
    lowest: the budget to raise to)."""
    return min(DEFAULT_LOOKAHEAD, fits[-1]) if fits else LOOKAHEADS[0]


def unsimulated_lookahead(order: AccessOrder, budget: int | None, granule: int = 1) -> int:
    """What an "auto" lookahead is where nothing is simulated (a mode that runs no policy,
    or everything resident): start_lookahead's; everything resident, where the lookahead
    moves nothing, the smallest, whose floor is the least budget an auto lookahead runs at."""
    return LOOKAHEADS[0] if budget is None else start_lookahead(fitting_lookaheads(order, budget, granule))


def choose(trace: Trace, weights: Any, activations: Any, hardware: Any, budget: int | None,
           allow_below_floor: bool = False, loop: str = "free") -> Choice:
    """The eviction and lookahead the simulator predicts fastest for `trace` run as `loop`
    (engine.policy.LOOPS): each of `weights.eviction` and `weights.lookahead` is "auto"
    (chosen) or a value (kept).
    Everything resident, an "auto" eviction is priority. Below the floor (with
    `allow_below_floor`) fewer use-after-evict hazards win whatever the speed."""
    from sim.simulator import backend_granule

    policies = ((weights.eviction,) if weights.eviction != AUTO
                else EVICTIONS if budget is not None else ("priority",))
    fits = fitting_lookaheads(trace.access_order(), budget, backend_granule(weights, hardware))
    walk = weights.lookahead == AUTO and budget is not None
    start = start_lookahead(fits) if weights.lookahead == AUTO else weights.lookahead
    results: dict[tuple[str, int], Any] = {}

    def rank(name: str, la: int) -> tuple[int, float]:
        if (name, la) not in results:
            cfg = OmegaConf.merge(weights, {"eviction": name, "lookahead": la})
            results[name, la] = _long_run(trace, cfg, activations, hardware, budget, allow_below_floor, loop)
        p = results[name, la].prediction
        return len(p["hazards"]), p["mean_step_ms"]

    fastest = min(rank(name, start) for name in policies)
    for name in policies:
        if walk and rank(name, start)[1] <= WALK_WITHIN * fastest[1]:
            for way in (-1, 1):
                la = start
                while la + way in fits and rank(name, la + way) < rank(name, la):
                    la += way
    eviction, lookahead = min(results, key=lambda c: rank(*c))
    return Choice(eviction, lookahead,
                  tuple(k for k in ("eviction", "lookahead") if weights[k] == AUTO),
                  {f"{n}/{la}": round(r.prediction["mean_step_ms"], 3) for (n, la), r in results.items()},
                  results[eviction, lookahead])


def _long_run(trace: Trace, weights: Any, activations: Any, hardware: Any, budget: int | None,
             allow_below_floor: bool, loop: str) -> SimResult:
    """The simulation of `weights` on `trace` over enough steps for its long-run mean."""
    from sim import simulate

    result = simulate(trace, weights, activations, hardware, budget_bytes=budget, steps=SHORT_RUN_STEPS,
                      allow_below_floor=allow_below_floor, loop=loop)
    if result.settled():  # later steps repeat the last: the short run's mean is the long run's
        return result
    return simulate(trace, weights, activations, hardware, budget_bytes=budget, steps=LONG_RUN_STEPS,
                    allow_below_floor=allow_below_floor, loop=loop)
