"""One job of `python -m engine`: the checked config, its spec, trace and plan.

`prepare` builds a `Job` for any mode; a mode (engine/modes/) turns it into an
`Outcome`; `objective` is the float a sweeper minimizes over outcomes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from engine.choice import AUTO, Choice, choose, unsimulated_lookahead
from engine.config import check_config
from engine.modes import MODES
from engine.plan import Plan, make_plan
from engine.models import build_spec
from engine.models.spec import ModelSpec
from engine.models.synthesize import synthesize
from engine.trace import Trace, check_matches, read_trace
from engine.units import budget_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """A spec model's job has all of spec, trace and plan. A real module's
    (`model.module`, engine/modules) has no spec; its trace is the recorded one
    (trace=PATH), absent until mode=record or mode=execute records it."""

    cfg: DictConfig
    out_dir: Path
    spec: ModelSpec | None
    trace: Trace | None
    plan: Plan | None
    # weights.eviction=auto or weights.lookahead=auto: what the simulator chose and every
    # candidate's step; and the chosen one's simulation as (allow_below_floor, SimResult)
    # where it ran the mode's steps, which the mode then reuses.
    choice: Choice | None = None
    simulated: tuple | None = None

    @property
    def model_arg(self) -> str:
        """What names this job's model on a command line (`model=...`): the model group's
        option Hydra composed, else (a job composed outside the command line) model.name."""
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return HydraConfig.get().runtime.choices.get("model") or self.cfg.model.name
        return self.cfg.model.name


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


def config_summary(job: Job) -> dict:
    """The settings a report opens with."""
    cfg = job.cfg
    return {
        "model": cfg.model.name,
        "workload": cfg.workload.name,
        "hardware": cfg.hardware.name,
        "budget_mb": cfg.budget,
        "mode": cfg.mode,
        "eviction": cfg.weights.eviction,
        # weights.eviction/lookahead=auto: every candidate's long-run mean step (ms), keyed "eviction/lookahead"
        "weights_predicted_ms": None if job.choice is None else job.choice.candidates_ms,
        "lookahead": cfg.weights.lookahead,
        "activations": cfg.activations.mode,
        "trace": cfg.trace,
        "seed": cfg.seed,
    }


def plan_keys(plan: dict) -> dict:
    """Stable top-level keys that scripts and the sweep summary read."""
    return {k: plan[k] for k in ("model_bytes", "floor_bytes", "floor_kernels", "policies")}


def plan_report(job: Job) -> dict:
    """The report's head: the settings, the plan and the plan's stable keys."""
    plan = job.plan.as_dict()
    return {"config": config_summary(job), "plan": plan, **plan_keys(plan)}


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


def is_module_model(model_cfg: DictConfig) -> bool:
    """A model config naming a real module (`module._target_`), not a spec family."""
    return "module" in model_cfg


def _prepare_module(cfg: DictConfig, out_dir: Path) -> Job:
    """A real module's job: the trace trace= names, else (plan, simulate, check) one
    synthesized from the module built on the meta device (engine/modules/synthesize.py)."""
    if cfg.mode == "calibrate":  # reads the directory trace= names itself
        return Job(cfg, out_dir, None, None, None)
    if cfg.trace is None:
        if cfg.mode in ("record", "execute", "materialize"):
            return Job(cfg, out_dir, None, None, None)
        from engine.modules.synthesize import synthesize_module

        source: tuple = ("synthesized", *(OmegaConf.to_yaml(cfg[k]) for k in ("model", "workload", "hardware")))
        trace = _memo(("trace", *source), lambda: synthesize_module(cfg.model, cfg.workload, cfg.hardware))
    else:
        stat = Path(cfg.trace).stat()
        source = ("file", str(Path(cfg.trace).resolve()), stat.st_mtime_ns, stat.st_size)
        trace = _memo(("trace", *source), lambda: _read(cfg.trace))
        check_matches(trace, cfg.model.name, trace.header.get("num_layers"), cfg.workload)
    if cfg.activations.mode != "off" and cfg.activations.pool.exact:
        _size_pool_exactly(cfg, trace, source)
    params = trace.header.get("params") or sum(trace.weight_sizes.values()) // 2
    choice, simulated = _choose_weights(cfg, trace, source)
    plan = _memo(("plan", *source, cfg.budget, cfg.weights.lookahead, _granule(cfg)), lambda: make_plan(
        model=cfg.model.name, workload=cfg.workload.name, param_count=params,
        order=trace.access_order(), budget_mb=cfg.budget, lookahead=cfg.weights.lookahead,
        granule=_granule(cfg)))
    return Job(cfg, out_dir, None, trace, plan, choice, simulated)


def _granule(cfg: DictConfig) -> int:
    """The granule the configured backend places weights in, as the simulator sees it."""
    from sim.simulator import backend_granule

    return backend_granule(cfg.weights, cfg.hardware)


def _read(path: str) -> Trace:
    """The trace at `path`; a recording without launch counts (on the cpu backend, or made
    before the recorders counted them) says what the simulator takes instead."""
    trace = read_trace(path)
    if trace.header.get("source") == "recorded" and not any(r.launches for r in trace.records):
        log.warning("%s counts no CUDA launches (recorded on the cpu backend, or before the recorders counted "
                    "them): the simulator takes one launch a record, so its host may run further ahead than "
                    "on a GPU; record it on the GPU again, or count them there with "
                    "benchmarks/restamp_launches.py", path)
    return trace


def prepare(cfg: DictConfig, out_dir: Path) -> Job:
    """Check the config and build the job's spec, trace and plan."""
    check_config(cfg)
    if is_module_model(cfg.model):
        return _prepare_module(cfg, out_dir)
    shape = tuple(OmegaConf.to_yaml(cfg[k]) for k in ("model", "workload", "hardware"))
    spec = _memo(("spec", *shape[:2]), lambda: build_spec(cfg.model, cfg.workload))
    if cfg.trace and not Path(cfg.trace).is_dir():  # a directory: mode=calibrate reads it itself
        stat = Path(cfg.trace).stat()
        source: tuple = ("file", str(Path(cfg.trace).resolve()), stat.st_mtime_ns, stat.st_size)
        trace = _memo(("trace", *source), lambda: _read(cfg.trace))
        check_matches(trace, spec.name, spec.num_layers, cfg.workload)
    else:
        source = ("synthesized", *shape)
        trace = _memo(("trace", *source), lambda: synthesize(spec, cfg.workload, cfg.hardware))
    if cfg.activations.mode != "off" and cfg.activations.pool.exact:
        _size_pool_exactly(cfg, trace, source)
    choice, simulated = _choose_weights(cfg, trace, source)
    plan = _memo(("plan", *source, cfg.budget, cfg.weights.lookahead, _granule(cfg)), lambda: make_plan(
        model=spec.name, workload=cfg.workload.name, param_count=spec.param_count,
        order=trace.access_order(), budget_mb=cfg.budget, lookahead=cfg.weights.lookahead,
        granule=_granule(cfg)))
    return Job(cfg, out_dir, spec, trace, plan, choice, simulated)


def _choose_weights(cfg: DictConfig, trace: Trace, source: tuple) -> tuple[Choice | None, tuple | None]:
    """weights.eviction=auto and weights.lookahead=auto: what engine.choice.choose picks
    for this budget, trace and hardware (as engine.offload does), written into the config
    so the simulator, the executor and the report agree; returns the choice and the
    chosen one's simulation where it ran the mode's steps (None on a sweep's memo hit).
    Everything resident, or in a mode that runs no policy, nothing is simulated: an auto
    eviction is priority and an auto lookahead engine.choice.unsimulated_lookahead's."""
    w = cfg.weights
    if AUTO not in (w.eviction, w.lookahead):
        return None, None
    budget = budget_bytes(cfg.budget)
    if budget is None or not MODES[cfg.mode].one_policy:
        if w.eviction == AUTO:
            w.eviction = "priority"
        if w.lookahead == AUTO:
            w.lookahead = unsimulated_lookahead(trace.access_order(), budget, _granule(cfg))
        return None, None
    from engine.node import replica_hardware

    allow = cfg.mode == "check" or cfg.sim.allow_below_floor  # as the modes simulate
    hardware = replica_hardware(cfg)
    made: list[Choice] = []

    def run() -> Choice:
        made.append(choose(trace, w, cfg.activations, hardware, budget, allow_below_floor=allow,
                           loop=cfg.workload.loop))
        return made[0].without_result()  # the memo keeps the figures, not the simulation

    key = ("weights", *source, cfg.budget, OmegaConf.to_yaml(w), OmegaConf.to_yaml(cfg.activations),
           OmegaConf.to_yaml(hardware), allow, cfg.workload.loop)
    choice = _memo(key, run)
    w.eviction, w.lookahead = choice.eviction, choice.lookahead
    result = made[0].result if made else None
    ran = result is not None and len(result.step_ends_ns) == cfg.workload.steps
    return choice, (allow, result) if ran else None


def _size_pool_exactly(cfg: DictConfig, trace: Trace, source: tuple) -> None:
    """activations/pool=exact: the classes this step's spills need, written into the
    config so the simulator, the executor and the report all see the same pool."""
    from engine.node import pool_share_mb
    from engine.policy.pool_sizing import exact_pool
    from engine.policy.schedule import step_questions

    act = cfg.activations
    share = pool_share_mb(cfg, sum(trace.weight_sizes.values()))
    if share is not None and (act.pool.max_mb is None or share < act.pool.max_mb):
        act.pool.max_mb = share
    sized = _memo(("pool", *source, OmegaConf.to_yaml(act)),
                  lambda: exact_pool(act, step_questions(trace.records, act.min_tensor_bytes), trace.num_layers))
    act.pool.class_sizes_mb = sized["class_sizes_mb"]
    act.pool.slabs_per_class = sized["slabs_per_class"]
    act.pool.exact = False  # sized: from here on an ordinary pool
