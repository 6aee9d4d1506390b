"""engine/validation.py on the CPU: the grid, when a row has timed enough steps, and which
measured step a row's prediction is held against (the shipped measurements)."""
from __future__ import annotations

import statistics
from pathlib import Path

from engine.calibrate import base_profile
from engine.measure.spread import warm_mean
from engine.trace import read_trace
from engine.policy.eviction import EVICTIONS
from engine.validation import (ALL_RESIDENT, BUDGET_FRACTIONS, LOOKAHEADS, MAX_TIMED_STEPS, TIMED_STEPS,
                               grid, measurements_path, read_measurements, report, report_md, row_bytes, timed_enough)
from engine.units import MB

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"


def test_the_inference_grid_runs_up_to_every_weight_resident() -> None:
    trace = read_trace(DATA / "ltx2_infer.jsonl.gz")
    rows = grid(trace)
    assert len(rows) == len(BUDGET_FRACTIONS) * len(EVICTIONS) * len(LOOKAHEADS) + 1
    assert rows[-1]["id"] == ALL_RESIDENT and rows[-1]["budget_mb"] is None and rows[-1]["held_out"]
    streamed = rows[:-1]
    model_mb = sum(trace.weight_sizes.values()) / MB
    budgets = sorted({r["budget_mb"] for r in streamed})
    assert len(budgets) == len(BUDGET_FRACTIONS) and budgets[-1] < model_mb
    # a checkerboard: half held out, and neighbours along any axis on opposite sides
    assert sum(r["held_out"] for r in streamed) == len(streamed) // 2
    first = {(r["budget_mb"], r["eviction"], r["lookahead"]): r["held_out"] for r in streamed}
    assert first[(budgets[0], "lru", 1)] != first[(budgets[0], "lru", 4)] != first[(budgets[1], "lru", 4)]


def test_a_row_times_steps_until_their_median_is_known_or_a_cap() -> None:
    assert not timed_enough([100.0] * (TIMED_STEPS - 1))
    assert timed_enough([100.0] * TIMED_STEPS)
    noisy = [10.0, 16.0, 12.0, 20.0, 9.0, 14.0]  # a host-bound step's spread
    assert not timed_enough(noisy)
    assert timed_enough((noisy * MAX_TIMED_STEPS)[:MAX_TIMED_STEPS])
    assert timed_enough([2_000.0, 3_000.0, 2_500.0, 4_000.0, 2_200.0])  # SETTLE_MS of steps


def test_the_report_holds_a_cycling_policy_to_its_warm_mean_and_the_rest_to_their_median() -> None:
    """Belady's copies cycle on the 8-layer Llama decode at 4203 MB with lookahead 4 (the
    simulator's warm steps differ by more than VARY): its prediction is their mean, and so is
    the measured step; priority's steps repeat, and a measured median stands for them."""
    path = DATA / "llama_decode.jsonl.gz"
    measured = {m["id"]: m["measured"] for m in read_measurements(measurements_path(path))["rows"]}
    rep = report(read_trace(path), read_measurements(measurements_path(path)), base_profile("h100_pcie5"))
    rows = {r["id"]: r for r in rep["rows"]}
    belady, priority = rows["belady budget=4203 lookahead=4"], rows["priority budget=4203 lookahead=4"]
    assert belady["predicted"]["steps_vary"] and not priority["predicted"]["steps_vary"]
    steps = measured[belady["id"]]["steps_ms"]
    assert belady["measured"]["step_ms"] == warm_mean(steps, len(steps))
    assert priority["measured"]["step_ms"] == statistics.median(measured[priority["id"]]["steps_ms"][1:])
    assert abs(belady["error"]["step_ms"]) < 0.01


def test_the_whole_ltx2_validation_on_the_h200_rebuilds_on_the_cpu() -> None:
    """LTX-2's 48 blocks recorded and validated on the lent H200 (data/traces/h200/validate/):
    from its own recording, every configuration up to all resident within 2.5%, bytes held as
    measured, and the policies ranked as measured at every budget."""
    path = DATA / "h200" / "validate" / "ltx2-full.jsonl.gz"
    rep = report(read_trace(path), read_measurements(measurements_path(path)), base_profile("h200"))
    assert len(rep["rows"]) == 19 and rep["held_out"]["configs"] == 10
    assert rep["rows"][-1]["id"] == ALL_RESIDENT
    for part in ("fit", "held_out"):
        assert rep[part]["step_ms"]["mean"] < 0.01 and rep[part]["step_ms"]["max"] < 0.025
        assert rep[part]["peak_device_bytes"]["max"] < 0.001
    assert rep["ranking_preserved"] and len(rep["ranking"]) == 6


def test_a_row_holds_its_budget_the_model_or_the_model_and_its_saved_activations() -> None:
    gb = 10**9
    streamed = {"kind": "infer", "budget_mb": 2403}
    assert row_bytes(streamed, 6 * gb, gb) == 2403 * MB
    assert row_bytes({"kind": "infer", "budget_mb": None}, 6 * gb, gb) == 6 * gb
    assert row_bytes({"kind": "train_lora", "budget_mb": None}, 6 * gb, gb) == 7 * gb


def test_the_report_names_the_rows_that_did_not_fit_the_device() -> None:
    path = DATA / "ltx2_infer.jsonl.gz"
    measurements = read_measurements(measurements_path(path))
    measurements["skipped"] = ["priority budget=9999 lookahead=1", ALL_RESIDENT]
    rep = report(read_trace(path), measurements, base_profile("h100_pcie5"))
    assert rep["skipped"] == measurements["skipped"]
    assert ("not measured (they would not fit the device beside a run): priority budget=9999 lookahead=1, "
            "all resident") in report_md(rep)
