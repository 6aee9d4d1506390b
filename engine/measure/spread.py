"""How well timed steps know their median, and which statistic a run's steps stand for.

A step the GPU bounds repeats within a percent; one the host bounds, on a shared host,
moves by tens of percent from one step to the next. The recorder times steps until
their median is known (`settled`), and the reports show the spread they measured
(`spread_text`), so a prediction is read against it.

The median's standard error is taken from the interquartile range (IQR): a normal
spread's sigma is IQR / 1.349, and the median of n draws has a standard error of
1.2533 sigma / sqrt(n). The IQR, unlike the standard deviation, is not moved by the odd
step a page fault or another tenant stretches.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

MEDIAN_REL_SE = 0.01  # a step's median known within 1% of itself
_SE_PER_IQR = 1.2533 / 1.349


def median_rel_se(times: Sequence[float]) -> float:
    """The standard error of the median of `times` over that median (inf under three)."""
    if len(times) < 3:
        return math.inf
    mid = statistics.median(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return _SE_PER_IQR * (q3 - q1) / math.sqrt(len(times)) / mid if mid > 0 else math.inf


def settled(times: Sequence[float], rel_se: float = MEDIAN_REL_SE) -> bool:
    """Whether the median of `times` is known within `rel_se` of itself."""
    return median_rel_se(times) <= rel_se


def spread_text(times_ms: Sequence[float]) -> str:
    """`times_ms` for a report: how many, fastest to slowest, and the median's standard error."""
    if not times_ms:
        return "no steps"
    se = median_rel_se(times_ms)
    known = f", median +-{100 * se:.1f}%" if math.isfinite(se) else ""
    if len(times_ms) == 1:
        return f"1 step, {times_ms[0]:.1f} ms"
    return f"{len(times_ms)} steps, {min(times_ms):.1f}-{max(times_ms):.1f} ms{known}"


def enough(times: Sequence[float], *, min_steps: int, max_steps: int, max_total: float,
           min_total: float = 0.0) -> bool:
    """Whether steps timed back to back (`times`, one unit throughout) are enough to stop:
    at least `min_steps` adding up to `min_total`, then once their median is known
    (`settled`) or their sum reaches `max_total`; at `max_steps` in any case."""
    total = sum(times)
    if len(times) >= max_steps:
        return True
    if len(times) < min_steps or total < min_total:
        return False
    return settled(times) or total >= max_total


def warm_steps(steps: int) -> int:
    """How many of `steps` are warm, the last ones: all but the cold first and the one after
    the warm-up barrier, or the last alone when fewer than three ran (the simulator's mean_*)."""
    return steps - 2 if steps >= 3 else 1


def warm_mean(values: Sequence[float], steps: int) -> float:
    """The mean of the warm ones among the last `values` of `steps` (a run's telemetry may
    keep fewer than it ran: those kept are its last)."""
    warm = list(values)[-warm_steps(steps):]
    return sum(warm) / len(warm)


def typical_step_ms(times: Sequence[float], steps: int, varies: bool) -> float:
    """The step a run's measured `times` (ms, the last of `steps`) stand for: the median of
    those after the first, which the odd slow step does not move; or, where the policy's
    steps differ by design (belady's copies cycle: the prediction's steps vary), the warm
    steps' mean, as the prediction's mean_step_ms: a cycle's median is its commonest step,
    not its long run."""
    if varies:
        return warm_mean(times, steps)
    return statistics.median(list(times)[1:] or times)


def typical_step_rel_se(times: Sequence[float], steps: int, varies: bool) -> float:
    """The standard error of `typical_step_ms(times, steps, varies)` over it: the median's
    (`median_rel_se` of the steps after the first), or the warm steps' mean's (their standard
    deviation over the root of their count); inf where too few steps ran to say."""
    if not varies:
        return median_rel_se(list(times)[1:])
    warm = list(times)[-warm_steps(steps):]
    if len(warm) < 3:
        return math.inf
    mean = statistics.fmean(warm)
    return statistics.stdev(warm) / math.sqrt(len(warm)) / mean if mean > 0 else math.inf
