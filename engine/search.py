"""Searches over the simulator, each fit to its problem.

- `+search=min_budget`: the smallest budget whose prediction meets the SLO. Pass/fail
  is monotone in the budget (a larger pool never streams more), so a bisection over
  multiples of `resolution_mb` between the floor and the model's size is exact to that
  resolution and reproducible, in 1 + log2(model / resolution) simulations.
- `+search=fastest_policy`: the fastest policy settings that meet the SLO, over the
  eviction x lookahead grid (when a budget streams weights) and, for training, the
  activation set-ups (watermarks, sync layers, pinned pools). The grid runs whole when it
  has at most `max_grid` points; a larger one is sampled by Optuna's TPE (`n_trials`
  points, the `optuna` extra).

Every point is an ordinary sweep job with its own directory, report.md and report.json,
and one line while it runs (engine/sweep.py); a search chooses which points run and
writes search.json, from which the summary states the answer. Hydra loads sweepers only
from the `hydra_plugins` package: hydra_plugins/engine_search holds the two thin classes
that call these functions.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher

from engine.sweep import set_progress
from engine.sweep_summary import SEARCH, point_row

Batch = list[list[str]]


class SearchError(CompactHydraException):
    """A search that cannot start as asked: one line, exit code 2 (engine/cli.py)."""


class Points:
    """Runs points through Hydra's launcher, numbered in order, and reads their rows."""

    def __init__(self, launcher: Launcher, base: list[str], sweep_dir: Path,
                 validate: Callable[[Batch], None]):
        self.launcher, self.base, self.sweep_dir, self.validate = launcher, base, sweep_dir, validate
        self.count = 0
        self.rows: list[dict[str, Any]] = []

    def check(self, batch: Batch) -> None:
        """Compose these points' configs now: a bad override stops the search before any point runs."""
        self.validate([self.base + point for point in batch])

    def run(self, batch: Batch) -> list[dict[str, Any]]:
        jobs = [self.base + point for point in batch]
        results = self.launcher.launch(jobs, initial_job_idx=self.count)
        self.count += len(jobs)
        rows = []
        for r in results:
            r.return_value  # noqa: B018  (raises a crashed job's exception, as Hydra's own sweeper does)
            row = point_row(Path(r.hydra_cfg.hydra.runtime.output_dir))
            if row is None:
                raise RuntimeError(f"sweep job {r.hydra_cfg.hydra.runtime.output_dir} left no report.json "
                                   "nor error.json")
            rows.append(row)
        self.rows += rows
        return rows


def user_overrides(arguments: Sequence[str], search: str, owned: Sequence[str]) -> list[str]:
    """The command line's overrides, which every point shares; a search sweeps its own
    space, so a swept value or a key the search sets is refused."""
    for o in OverridesParser.create().parse_overrides(list(arguments)):
        key = o.get_key_element().lstrip("+~")
        if o.is_sweep_override():
            raise SearchError(f"{o.input_line} sweeps values, but +search={search} "
                              f"chooses the points itself; give one value (run one search per value)")
        if key in owned:
            raise SearchError(f"+search={search} chooses {key} itself; drop {o.input_line}")
    return list(arguments)


def bisect(passes: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest k in (lo, hi] with passes(k), where passes(lo) is False, passes(hi)
    True and passes is monotone; asks about ceil(log2(hi - lo)) k's, never lo nor hi."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


def budget_range(floor_mb: float, model_mb: float, resolution_mb: float) -> tuple[int, int]:
    """(lo, hi) in units of resolution_mb: lo * resolution is under the floor (fails),
    hi * resolution holds the whole model (passes when everything resident does)."""
    return math.ceil(floor_mb / resolution_mb) - 1, math.ceil(model_mb / resolution_mb)


def auto_resolution(model_mb: float, steps: int = 7) -> float:
    """A round resolution (1, 2.5 or 5 x 10^n MB) that bisects the model's size in about `steps` points."""
    target = model_mb / 2 ** steps
    exp = math.floor(math.log10(target))
    return min((m * 10.0 ** e for e in (exp, exp + 1) for m in (1, 2.5, 5)), key=lambda r: abs(math.log(r / target)))


def min_budget(points: Points, resolution_mb: float | None) -> dict[str, Any]:
    """Bisect the budget (resolution None: auto_resolution); returns search.json's content."""
    set_progress(points.sweep_dir, 0)  # unknown until the first point gives the floor and the model's size
    top = _ran(points.run([["budget=null"]])[0])
    resolution_mb = resolution_mb or auto_resolution(top["model_mb"])
    result = {"search": "min_budget", "resolution_mb": resolution_mb, "answer_mb": None}
    if not top["passed"]:
        return result  # no budget can do better than everything resident
    lo, hi = budget_range(top["floor_mb"], top["model_mb"], resolution_mb)
    set_progress(points.sweep_dir, 1 + math.ceil(math.log2(max(2, hi - lo))), bound=True)
    passed: dict[int, bool] = {}

    def mb(k: int) -> float:
        return round(k * resolution_mb, 6)

    def passes(k: int) -> bool:
        passed[k] = _ran(points.run([[f"budget={mb(k):g}"]])[0])["passed"]
        return passed[k]

    answer = bisect(passes, lo, hi)
    if answer == hi and hi not in passed and not passes(hi):
        return result  # only everything resident passes: not monotone here
    return {**result, "answer_mb": mb(answer)}


def _ran(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("error"):
        raise SearchError(f"the search stopped: a point could not run: {row['error']}")
    return row


Space = list[dict[str, list[str]]]  # sub-spaces: override key -> its values (as override strings)


def policy_space(weights: dict[str, str] | None, activations: list[dict[str, str]] | None) -> Space:
    """The sub-spaces a fastest-policy search covers: the weights grid times each activation
    set-up (either may be absent). Values use Hydra's sweep syntax (a,b,c or range(...))."""
    parser = OverridesParser.create()

    def expand(params: dict[str, str]) -> dict[str, list[str]]:
        out = {}
        for o in parser.parse_overrides([f"{k}={v}" for k, v in params.items()]):
            key = o.get_key_element()
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            out[key] = [f"{key}={v}" for v in values]
        return out

    w = expand(weights) if weights else {}
    return [{**w, **expand(a)} for a in activations] if activations else ([w] if w else [])


def grid(space: Space) -> Batch:
    """Every point of the space, sub-space after sub-space."""
    return [list(p) for sub in space for p in itertools.product(*sub.values())]


def fastest_policy(points: Points, space: Space, max_grid: int, n_trials: int, seed: int) -> dict[str, Any]:
    """Run the grid, or sample it with Optuna's TPE when it is larger than max_grid."""
    if not space:
        raise SearchError("+search=fastest_policy has nothing to choose: weights stream only under a budget "
                          "and activations only in training; give budget=MB or workload=train_lora")
    points_all = grid(space)
    size = len(points_all)
    points.check([list(next(itertools.product(*sub.values()))) for sub in space])
    if size <= max_grid:
        set_progress(points.sweep_dir, size)
        points.run(points_all)
        return {"search": "fastest_policy", "space": size, "sampled": False}
    try:
        import optuna
    except ImportError:
        raise SearchError(f"the policy space has {size} points, more than hydra.sweeper.max_grid={max_grid}: "
                          "install Optuna to sample it (pip install 'offload-engine[optuna]') or narrow "
                          "hydra.sweeper.weights / hydra.sweeper.activations") from None
    set_progress(points.sweep_dir, n_trials)
    _sample(points, space, n_trials, seed, optuna)
    return {"search": "fastest_policy", "space": size, "sampled": True, "n_trials": n_trials}


def _sample(points: Points, space: Space, n_trials: int, seed: int, optuna: Any) -> None:
    """TPE over the sub-spaces (a categorical picks one, then one per key). A point seen
    before is told its old value without running again; one that fails its SLO is told a
    value behind every passing one (TPE ranks values); one that errs is a failed trial."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    seen: dict[tuple[str, ...], float | None] = {}
    wanted, asked = min(n_trials, len(grid(space))), 0
    while len(seen) < wanted and asked < 20 * n_trials:
        asked += 1
        trial = study.ask()
        i = trial.suggest_categorical("space", list(range(len(space))))
        point = tuple(trial.suggest_categorical(f"{i}:{key}", values) for key, values in space[i].items())
        if point not in seen:
            row = points.run([list(point)])[0]
            seen[point] = (None if row.get("error") or row.get("step_ms") is None
                           else row["step_ms"] if row.get("passed") is not False else 1e9 + row["step_ms"])
        value = seen[point]
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)


def write_result(sweep_dir: Path, result: dict[str, Any]) -> None:
    (sweep_dir / SEARCH).write_text(json.dumps(result) + "\n")

