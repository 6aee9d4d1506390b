"""How well timed steps know their median (engine/measure/spread.py), the reports' cell of
them (engine/report.py steps_cell), and the recorder's all-resident steps timed until it is
known, in turns with the plain module's where the host bounds them (engine/modules/resident_steps.py
until_settled, in_turns)."""
from __future__ import annotations

import itertools
import math
import statistics

import pytest

from engine.measure.spread import (median_rel_se, settled, spread_text, typical_step_ms, typical_step_rel_se, warm_mean,
                                   warm_steps)
from engine.modules.resident_steps import (MAX_PIPELINED_STEPS, PIPELINED_NS, PIPELINED_STEPS, SETTLE_NS, TURN_STEPS,
                                           in_turns, until_settled)
from engine.report import steps_cell


def test_the_medians_standard_error_comes_from_the_interquartile_range() -> None:
    # median 100, quartiles 95 and 105
    assert median_rel_se([90, 100, 120, 105, 95]) == pytest.approx(1.2533 / 1.349 * 10 / math.sqrt(5) / 100)
    assert median_rel_se([100.0, 100.0, 100.0]) == 0.0
    assert median_rel_se([100.0, 101.0]) == math.inf  # under three steps nothing is known
    # One step a tenant stretched tenfold moves neither the median nor the quartiles.
    assert median_rel_se([100, 101, 99, 100, 1000]) == median_rel_se([100, 101, 99, 100, 102])


def test_settled_is_the_standard_error_within_the_bound() -> None:
    steps = [90, 100, 120, 105, 95]  # +-4.2%
    assert settled(steps, 0.05) and not settled(steps, 0.04) and not settled(steps)


def test_the_spread_reads_count_range_and_error() -> None:
    assert spread_text([90, 100, 120, 105, 95]) == "5 steps, 90.0-120.0 ms, median +-4.2%"
    assert spread_text([100.0, 102.0]) == "2 steps, 100.0-102.0 ms"
    assert spread_text([100.0]) == "1 step, 100.0 ms"
    assert spread_text([]) == "no steps"


def test_a_report_asks_for_more_steps_where_the_median_is_uncertain() -> None:
    assert steps_cell([100.0, 100.2, 99.9, 100.1]) == "4 steps, 99.9-100.2 ms, median +-0.1%"
    # +-4.16% over five steps: 5 x 4.16^2 = 86.4 steps after the first for 1%
    assert steps_cell([90, 100, 120, 105, 95]) == ("5 steps, 90.0-120.0 ms, median +-4.2% (about "
                                                   "workload.steps=88 would pin the median within 1%)")
    assert steps_cell([100.0, 100.0]) == ("2 steps, 100.0-100.0 ms (its spread needs three steps after the "
                                          "first: workload.steps=4 or more)")


def _steps(times_ns: list[int]) -> tuple[list[int], list[int]]:
    """A step function returning `times_ns` in turn, and the list of those it returned."""
    returned: list[int] = []
    source = itertools.cycle(times_ns)

    def step() -> int:
        returned.append(next(source))
        return returned[-1]
    return step, returned


def test_steps_that_repeat_stop_at_the_minimum_window() -> None:
    step, returned = _steps([100_000_000])  # 100 ms each: 500 ms is five steps, settled at once
    assert until_settled(step) == [100_000_000] * 5 == returned
    step, _ = _steps([400_000_000])  # past 500 ms within the three steps the median needs
    assert len(until_settled(step)) == PIPELINED_STEPS


def test_steps_that_spread_run_on_to_the_cap() -> None:
    step, _ = _steps([100_000_000, 130_000_000])  # +-15%: never settles
    assert len(until_settled(step)) == MAX_PIPELINED_STEPS
    step, _ = _steps([700_000_000, 900_000_000])  # a LoRA step on a noisy host: SETTLE_NS first
    times = until_settled(step)
    assert sum(times[:-1]) < SETTLE_NS <= sum(times) and len(times) < MAX_PIPELINED_STEPS


def test_a_spread_that_settles_stops_there() -> None:
    step, _ = _steps([100_000_000, 103_000_000])  # 3% apart: the median's error falls under 1% at eight
    times = until_settled(step)
    assert len(times) == 8 and sum(times) >= PIPELINED_NS
    assert settled(times) and not settled(times[:-1])


def test_host_bound_steps_and_the_plain_modules_run_in_turns_until_both_are_known() -> None:
    order: list[str] = []

    def step() -> int:
        order.append("hooked")
        return 100_000_000

    def plain_turn(n: int) -> list[int]:
        order.append(f"bound {n}")
        return [125_000_000] * n
    times, plain = in_turns(step, plain_turn)
    # 100 ms and 125 ms steps settle at once: six of each (500 ms of steps), in two turns of three.
    assert times == [100_000_000] * 6 and plain == [125_000_000] * 6
    assert order == ["hooked"] * TURN_STEPS + ["bound 3"] + ["hooked"] * TURN_STEPS + ["bound 3"]
    # Turns go on while either spreads: here the plain steps, to the cap.
    noisy = itertools.cycle([60_000_000, 100_000_000])
    times, plain = in_turns(step, lambda n: [next(noisy) for _ in range(n)])
    assert len(times) == len(plain) == MAX_PIPELINED_STEPS


def test_warm_steps_are_the_simulators() -> None:
    """The warm steps: all but the first two, the last alone under three; a telemetry that kept
    fewer steps than ran keeps the last, all warm."""
    assert [warm_steps(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 14]
    assert warm_mean([9.0, 1.0, 2.0, 4.0], 4) == 3.0
    assert warm_mean([5.0, 7.0], 2) == 7.0 and warm_mean([5.0], 1) == 5.0
    assert warm_mean([1.0, 2.0, 3.0], 20) == 2.0


def test_a_cycling_policys_step_is_its_mean_not_its_commonest() -> None:
    """belady's copies cycle (here ten short steps and four long ones): the median is the short
    step, the long run is the mean, as the prediction's."""
    times = [292.4, 97.3] + [84.8] * 6 + [103.3] * 4 + [84.8] * 4
    assert typical_step_ms(times, len(times), varies=False) == 84.8
    assert typical_step_ms(times, len(times), varies=True) == pytest.approx((84.8 * 10 + 103.3 * 4) / 14)
    # A step the odd slow one does not move, where the policy repeats.
    assert typical_step_ms([300.0, 10.0, 10.0, 50.0, 10.0], 5, varies=False) == 10.0


def test_a_typical_steps_standard_error_is_its_medians_or_its_warm_means() -> None:
    steps = [500.0, 100.0, 104.0, 96.0, 100.0, 102.0, 98.0]  # the cold first, then the timed
    assert typical_step_rel_se(steps, len(steps), varies=False) == median_rel_se(steps[1:])
    warm = steps[2:]  # a cycling policy's mean: all but the first two
    expected = statistics.stdev(warm) / math.sqrt(len(warm)) / statistics.fmean(warm)
    assert typical_step_rel_se(steps, len(steps), varies=True) == pytest.approx(expected)
    assert math.isinf(typical_step_rel_se(steps[:4], 4, varies=True))  # two warm steps say nothing
