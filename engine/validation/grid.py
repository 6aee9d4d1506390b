"""What mode=validate runs: the grid of configurations for a trace (inference: budgets x
evictions x lookaheads and every weight resident; training: the LoRA step under each activation
policy with every frozen weight resident, and its frozen weights streamed at budgets x evictions),
which are held out, the device bytes each holds, and how many steps each times."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

from engine.config import ActivationsConfig, PoolConfig, WeightsConfig
from engine.errors import ConfigError
from engine.policy.pool_sizing import exact_pool
from engine.policy.eviction import EVICTIONS
from engine.policy.floor import floor
from engine.policy.schedule import step_questions
from engine.trace import Trace
from engine.units import MB

BUDGET_FRACTIONS = (0.35, 0.6, 0.85)
LOOKAHEADS = (1, 4)
ALL_RESIDENT = "all resident"
TIMED_STEPS = 5  # a row times its steps in batches of this many, each after a warm-up step
# Steps after the timed ones, their kernels stamped for the stall: the stamps (two CUDA events
# a kernel) cost host time, which a host-bound step's time would show.
STALL_STEPS = 3
MAX_TIMED_STEPS = 64
SETTLE_MS = 10_000.0
# The first warms the pool; the warm ones after it show a policy whose copies cycle (belady's).
SIM_STEPS = 1 + TIMED_STEPS
# Training: (name, activations settings); watermarks are fractions of the step's saved bytes.
TRAIN_POLICIES = (
    ("off", {"mode": "off"}),
    ("watermark-0.8", {"mode": "watermark", "high": 0.8, "low": 0.7}),
    ("watermark-0.6", {"mode": "watermark", "high": 0.6, "low": 0.5}),
    ("sync-2", {"mode": "sync", "layers": 2}),
    ("sync-3", {"mode": "sync", "layers": 3}),
)
# A streamed training row's lookahead: the weights config's default, as a training run takes it.
TRAIN_LOOKAHEAD = WeightsConfig.lookahead


def training(trace: Trace) -> bool:
    return any(r.phase == "bwd" for r in trace.records)


def saved_bytes(trace: Trace) -> int:
    return sum(s.nbytes for r in trace.records for s in r.saved)


def grid(trace: Trace, min_tensor_bytes: int | None = None) -> list[dict]:
    """The configurations validated for this trace, each marked held out or not; a training
    trace's spill the saved tensors of `min_tensor_bytes` or more (None: the default's)."""
    rows = []
    if training(trace):
        smallest = {} if min_tensor_bytes is None else {"min_tensor_bytes": min_tensor_bytes}
        for i, (name, act) in enumerate(TRAIN_POLICIES):
            rows.append({"id": f"train {name}", "kind": "train_lora", "budget_mb": None, "eviction": "belady",
                         "lookahead": 1, "activations": {**act, **({} if act["mode"] == "off" else smallest)},
                         "held_out": i % 2 == 1})
        for (ib, budget), (ie, ev) in itertools.product(enumerate(budgets(trace, (TRAIN_LOOKAHEAD,))),
                                                         enumerate(EVICTIONS)):
            rows.append({"id": f"train {ev} budget={budget} lookahead={TRAIN_LOOKAHEAD}", "kind": "train_lora",
                         "budget_mb": budget, "eviction": ev, "lookahead": TRAIN_LOOKAHEAD,
                         "activations": {"mode": "off"}, "held_out": (ib + ie) % 2 == 1})
        return rows
    for (ib, budget), (ie, ev), (il, la) in itertools.product(
            enumerate(budgets(trace, LOOKAHEADS)), enumerate(EVICTIONS), enumerate(LOOKAHEADS)):
        rows.append({"id": f"{ev} budget={budget} lookahead={la}", "kind": "infer", "budget_mb": budget,
                     "eviction": ev, "lookahead": la, "activations": {"mode": "off"},
                     "held_out": (ib + ie + il) % 2 == 1})
    rows.append({"id": ALL_RESIDENT, "kind": "infer", "budget_mb": None, "eviction": "priority", "lookahead": 1,
                 "activations": {"mode": "off"}, "held_out": True})
    return rows


def budgets(trace: Trace, lookaheads: Sequence[int]) -> list[float]:
    """The streamed rows' budgets (MB): BUDGET_FRACTIONS of the weights' bytes, each above the
    floor of the trace's order (a training trace's: its forward and backward) at every one of
    `lookaheads`, and each at least a quarter of the model above the one before."""
    model_mb = sum(trace.weight_sizes.values()) / MB
    order = trace.access_order()
    floor_mb = max(floor(order, la).bytes for la in lookaheads) / MB
    unit = _unit(model_mb)
    out = []
    for ib, frac in enumerate(BUDGET_FRACTIONS):
        # A fraction of the model, but never under the floor (a decode step's lm_head + embedding).
        above_floor = floor_mb - floor_mb % unit + unit + ib * _in(unit, 0.25 * model_mb)
        out.append(_in(unit, max(frac * model_mb, above_floor)))
    return out


def _unit(total_mb: float) -> float:
    """The grid's MB are whole MB, a small model's kB (a test's model is under a MB)."""
    return 1.0 if total_mb >= 100 else 0.001


def _in(unit: float, mb: float) -> float:
    return round(mb) if unit == 1.0 else round(round(mb / unit) * unit, 3)


def activations_config(act: dict, trace: Trace) -> ActivationsConfig | None:
    """The activation policy's config for a grid row (None: no offload)."""
    if act["mode"] == "off":
        return None
    smallest = {"min_tensor_bytes": act["min_tensor_bytes"]} if "min_tensor_bytes" in act else {}
    if act["mode"] == "watermark":
        total = saved_bytes(trace) / MB
        unit = _unit(total)
        cfg = ActivationsConfig(mode="watermark", high_watermark_mb=_in(unit, act["high"] * total),
                                low_watermark_mb=_in(unit, act["low"] * total), **smallest)
    elif act["mode"] == "sync":
        cfg = ActivationsConfig(mode="sync", num_offload_layers=act["layers"], **smallest)
    else:
        raise ConfigError(f"validation row with activations mode {act['mode']!r}; use off, watermark or sync")
    # The pool the CLI's default (activations/pool=exact) gives: every spill pinned.
    questions = step_questions(trace.records, cfg.min_tensor_bytes)
    return replace(cfg, pool=PoolConfig(**exact_pool(cfg, questions, trace.num_layers)))


def row_bytes(row: dict, model_bytes: int, saved: int) -> int:
    """The device bytes a grid row holds before its step's own: its budget (streamed) or the
    model (every weight resident), and a training step's saved activations."""
    weights = model_bytes if row["budget_mb"] is None else int(row["budget_mb"] * MB)
    return weights + (saved if row["kind"] == "train_lora" else 0)
