"""The job behind `python -m engine`: validate, plan, then run the chosen mode.

Modes are a registry keyed by name; a mode joins `config.MODES` when it
exists, so an unknown one is rejected at validation like any bad value.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from engine.config import validate
from engine.errors import EngineError
from engine.plan import Plan, make_plan
from engine.report import plan_md, title_md, write_report
from engine.spec import ModelSpec, SpecError, build_spec
from engine.trace import Trace, read_trace, synthesize


@dataclass(frozen=True)
class Job:
    cfg: DictConfig
    out_dir: Path
    spec: ModelSpec
    trace: Trace
    plan: Plan
    # weights=auto: every candidate's predicted step (ms), and the simulation of the
    # chosen one as (allow_below_floor, SimResult), which the mode reuses.
    eviction_predicted_ms: dict[str, float] | None = None
    simulated: tuple | None = None


@dataclass(frozen=True)
class Outcome:
    """What a mode produced: the report, its markdown, an exit code, and lines for
    stderr (a single run prints them; a sweep shows one line per point instead)."""

    report: dict
    markdown: str
    exit_code: int = 0
    notes: tuple[str, ...] = ()


def objective(report: dict) -> float:
    """What the job returns to a sweeper that minimizes (Optuna's plugin): the predicted
    step time of a point that ran and met its SLO; nan, a failed trial, otherwise."""
    pred, check = report.get("prediction"), report.get("check")
    if pred is None or (check is not None and not check["passed"]):
        return math.nan
    return float(pred["step_ms"])


# A sweep runs many jobs in one process (or in a few reused workers) that
# differ only in budget or policy: the spec, the trace and the plan of a point
# are kept for the points after it. All three are read-only once built.
_MEMO: dict[tuple, object] = {}
_MEMO_MAX = 64


def _memo(key: tuple, build: Callable[[], object]) -> object:
    if key not in _MEMO:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = build()
    return _MEMO[key]


def prepare(cfg: DictConfig, out_dir: Path) -> Job:
    validate(cfg)
    shape = tuple(OmegaConf.to_yaml(cfg[k]) for k in ("model", "workload", "hardware"))
    spec = _memo(("spec", *shape[:2]), lambda: build_spec(cfg.model, cfg.workload))
    if cfg.trace and not Path(cfg.trace).is_dir():  # a directory: mode=calibrate reads it itself
        stat = Path(cfg.trace).stat()
        source: tuple = ("file", str(Path(cfg.trace).resolve()), stat.st_mtime_ns, stat.st_size)
        trace = _memo(("trace", *source), lambda: read_trace(cfg.trace))
    else:
        source = ("synthesized", *shape)
        trace = _memo(("trace", *source), lambda: synthesize(spec, cfg.workload, cfg.hardware))
    if cfg.activations.mode != "off" and cfg.activations.pool.exact:
        _size_pool_exactly(cfg, trace, source)
    plan = _memo(("plan", *source, cfg.budget, cfg.weights.lookahead), lambda: make_plan(
        model=spec.name, workload=cfg.workload.name, param_count=spec.param_count,
        order=trace.access_order(), budget_mb=cfg.budget, lookahead=cfg.weights.lookahead))
    predicted = simulated = None
    if cfg.weights.eviction == "auto":
        predicted, simulated = _choose_eviction(cfg, trace, plan, source)
    return Job(cfg, out_dir, spec, trace, plan, predicted, simulated)


# Modes that run one eviction policy; the others (plan lists all three) need no choice.
_ONE_POLICY_MODES = ("simulate", "check", "execute", "record")


def _choose_eviction(cfg: DictConfig, trace: Trace, plan: Plan,
                     source: tuple) -> tuple[dict[str, float] | None, tuple | None]:
    """weights=auto: the eviction policy the simulator predicts fastest for this
    budget, trace and hardware, written into the config so the simulator, the
    executor and the report agree; returns every candidate's predicted step (ms)
    and the chosen one's simulation (None on a sweep's memo hit). No single
    policy wins everywhere: priority pins budget - floor bytes, which for an LLM
    decode step (whose floor is the 1 GB lm_head plus the lookahead window) leaves
    almost nothing pinned at a tight budget, where belady is 2-3x faster."""
    from engine.policy.weights import EVICTIONS

    w = cfg.weights
    if plan.budget_bytes is None or cfg.mode not in _ONE_POLICY_MODES:
        w.eviction = "priority"  # everything resident, or no policy runs: nothing to choose
        return None, None
    from sim import simulate

    allow = cfg.mode == "check" or cfg.sim.allow_below_floor  # as the modes simulate
    results = {}

    def predict() -> dict[str, tuple[int, float]]:
        for name in EVICTIONS:
            results[name] = simulate(trace, OmegaConf.merge(w, {"eviction": name}), cfg.activations, cfg.hardware,
                                     budget_bytes=plan.budget_bytes, steps=cfg.workload.steps,
                                     allow_below_floor=allow)
        # Below the floor a policy with fewer use-after-evict hazards wins whatever its speed.
        return {name: (len(r.prediction["hazards"]), round(r.prediction["step_ms"], 3)) for name, r in results.items()}

    key = ("eviction", *source, cfg.budget, cfg.workload.steps, OmegaConf.to_yaml(w),
           OmegaConf.to_yaml(cfg.activations), OmegaConf.to_yaml(cfg.hardware), allow)
    predicted = _memo(key, predict)
    w.eviction = min(predicted, key=predicted.get)
    simulated = (allow, results[w.eviction]) if results else None  # a sweep's memo hit simulates again
    return {name: ms for name, (_, ms) in predicted.items()}, simulated


def _size_pool_exactly(cfg: DictConfig, trace: Trace, source: tuple) -> None:
    """activations/pool=exact: the classes this step's spills need, written into the
    config so the simulator, the executor and the report all see the same pool."""
    from engine.policy.pool_sizing import exact_pool, step_questions

    act = cfg.activations
    sized = _memo(("pool", *source, OmegaConf.to_yaml(act)),
                  lambda: exact_pool(act, step_questions(trace.records), trace.num_layers))
    act.pool.class_sizes_mb = sized["class_sizes_mb"]
    act.pool.slabs_per_class = sized["slabs_per_class"]
    act.pool.exact = False  # sized: from here on an ordinary pool


def _plan_mode(job: Job) -> Outcome:
    plan = job.plan.as_dict()
    return Outcome({"config": _config_summary(job), "plan": plan, **_plan_keys(plan)},
                   plan_md(plan))


def _plan_keys(plan: dict) -> dict:
    # Stable top-level keys that scripts and the sweep summary read.
    return {k: plan[k] for k in ("model_bytes", "floor_bytes", "floor_kernels", "policies")}


def _config_summary(job: Job) -> dict:
    cfg = job.cfg
    return {
        "model": cfg.model.name,
        "workload": cfg.workload.name,
        "hardware": cfg.hardware.name,
        "budget_mb": cfg.budget,
        "mode": cfg.mode,
        "eviction": cfg.weights.eviction,
        "eviction_predicted_ms": job.eviction_predicted_ms,  # weights=auto: every candidate's step (ms)
        "lookahead": cfg.weights.lookahead,
        "activations": cfg.activations.mode,
        "trace": cfg.trace,
        "seed": cfg.seed,
    }


MODES: dict[str, Callable[[Job], Outcome]] = {"plan": _plan_mode}


def register_mode(name: str) -> Callable[[Callable[[Job], Outcome]], Callable[[Job], Outcome]]:
    def deco(fn: Callable[[Job], Outcome]) -> Callable[[Job], Outcome]:
        MODES[name] = fn
        return fn
    return deco


def run_job(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    import engine.modes  # noqa: F401  (registers the modes beyond plan)
    import engine.modes_execute  # noqa: F401
    import engine.modes_trace  # noqa: F401
    try:
        job = prepare(cfg, out_dir)
        outcome = MODES[cfg.mode](job)
    except (EngineError, SpecError) as err:
        if multirun:
            # The sweep goes on; its line for this point and the summary show the error.
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "error.json").write_text(json.dumps({
                "overrides": list(hc.overrides.task), "error": str(err)}) + "\n")
            return math.nan
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))
    model_option = hc.runtime.choices.get("model") or cfg.model.name
    if "config" in outcome.report:
        outcome.report["config"]["model_option"] = model_option
    markdown = title_md(model_option, cfg) + "\n\n" + outcome.markdown
    write_report(out_dir, outcome.report, markdown)
    if multirun:  # one line per point, from the sweep's callback (engine/sweep.py)
        return objective(outcome.report)
    print(markdown)
    print(f"\nreport: {out_dir / 'report.json'}")
    for line in outcome.notes:
        print(line, file=sys.stderr)
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
    return objective(outcome.report)
