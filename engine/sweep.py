"""Multirun that reads well: one line per point while it runs, then a summary that
answers the sweep's question.

Hydra's `on_multirun_end` receives no job results, so the summary scans the sweep
directory for each job's report.json (or error.json) and writes summary.csv,
summary.md and pareto.png beside them (engine/sweep_summary.py); each point keeps its
full report.md and report.json in its own directory. Progress is counted the same way, so it works for
any launcher whose jobs share the filesystem (basic, joblib, Ray on one machine).

The question a summary answers:
- a search (`+search=...`, engine/search.py) names its own in search.json;
- `mode=check`: the smallest budget that passes (the fastest passing point when the
  budget is fixed); exit 1 when no point passes, with the closest point;
- otherwise: the fastest point and the Pareto front of step time against budget.

A `mode=execute` point's step is the one the GPU measured, its prediction beside it
(`predicted_step_ms`); other points' steps are the simulator's.
"""
from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from engine.sweep_summary import SEARCH, answer, budget_text, collect, point_row, policy_text, slo_text, write_summary

PROGRESS = ".progress.json"


def sweep_size(overrides: list[str]) -> int:
    """Points in a grid sweep: the product of each sweep override's choices."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    sizes = [len(list(o.sweep_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


def set_progress(sweep_dir: Path, total: int, bound: bool = False) -> None:
    """How many points the sweep will run (`bound`: at most that many)."""
    path = sweep_dir / PROGRESS
    state = json.loads(path.read_text()) if path.is_file() else {"start": time.time(), "common": []}
    state.update(total=total, bound=bound)
    path.write_text(json.dumps(state))


def point_line(row: dict[str, Any] | None, done: int, state: dict[str, Any], job_overrides: list[str],
               crashed: str | None = None) -> str:
    """One line for a finished point: progress, what ran, the prediction, the verdict."""
    total, bound = state.get("total") or None, state.get("bound", False)  # 0: not known yet
    width = len(str(total or done))
    head = f"[{done:>{width}}/{'<=' if bound else ''}{total}]" if total else f"[{done}]"
    varying = [o for o in job_overrides if o not in state.get("common", [])]
    if crashed is not None or row is None or row.get("error"):
        return f"{head} {' '.join(varying)}: error: {crashed or (row or {}).get('error')}"
    shown = ("budget", "weights", "weights.eviction", "weights.lookahead", "activations")
    extra = [_short(o) for o in varying if o.partition("=")[0].lstrip("+~") not in shown]
    line = f"{head} {budget_text(row):<20} {policy_text(row):<22}"
    if extra:
        line += f" {' '.join(extra):<28}"
    if row.get("step_ms") is not None and row.get("mode") == "execute":
        line += f" {row['step_ms']:9.2f} ms/step measured, {row['predicted_step_ms']:.2f} predicted"
    elif row.get("step_ms") is not None:
        line += f" {row['step_ms']:9.2f} ms/step  stall {row['stall_ms']:8.2f} ms  overlap {row['overlap']:6.1%}"
        if row.get("workload") == "train_lora":
            line += f"  peak {row['peak_device_mb'] / 1e3:.3f} GB"
    if row.get("passed") is not None:
        failures = row["failures"]
        line += "  PASS" if row["passed"] else f"  FAIL: {failures[0]}" + (
            f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
    elapsed = time.time() - state["start"]
    if total and total > done:
        line += f"  ({elapsed:.0f} s, ETA {'<= ' if bound else ''}{elapsed / done * (total - done):.0f} s)"
    return line


def _short(override: str) -> str:
    """`activations.high_watermark_mb=12000` as `high_watermark_mb=12000`: the last part of the key."""
    key, _, value = override.partition("=")
    return f"{key.replace('/', '.').rsplit('.', 1)[-1]}={value}"


# The config of the sweep running in this process, so an interrupted one can still be summarized.
RUNNING: DictConfig | None = None
# Set by the first Ctrl-C of a sweep: the point that runs finishes, then the sweep is summarized.
STOP = threading.Event()


def _stop_after_point(signum: int, frame: object) -> None:
    STOP.set()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
    print("interrupted: finishing the point that runs, then summarizing (Ctrl-C again to stop now)",
          file=sys.__stderr__, flush=True)


def summarize(config: DictConfig, interrupted: bool = False) -> int:
    """Write the sweep's summary from the points that finished, print its answer; the exit code."""
    sweep_dir = Path(config.hydra.sweep.dir)
    rows = collect(sweep_dir)
    search_file = sweep_dir / SEARCH
    search = json.loads(search_file.read_text()) if search_file.is_file() else None
    result = answer(rows, search, slo_text(config.slo))
    write_summary(sweep_dir, rows, result, config.slo.max_step_ms)
    for line in result.lines:
        print(line, flush=True)
    print(f"summary: {sweep_dir / 'summary.md'} ({len(rows)} point{'s' if len(rows) != 1 else ''}"
          f"{', interrupted: the points that finished' if interrupted else ''})", flush=True)
    if interrupted:
        (sweep_dir / PROGRESS).unlink(missing_ok=True)
    return result.exit_code


class SweepSummary(Callback):
    """Hydra callback: one line per finished point, the summary and its answer at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if (sweep_dir / PROGRESS).exists() or any(sweep_dir.glob("*/report.json")):
            # A second sweep here would overwrite the first's points: refuse it.
            print(f"error: {sweep_dir} holds an earlier sweep's results; pick another hydra.sweep.dir "
                  "(the default is unique per run) or move that sweep away", file=sys.__stderr__)
            sys.exit(2)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        global RUNNING
        RUNNING = config
        if threading.current_thread() is threading.main_thread():
            STOP.clear()
            signal.signal(signal.SIGINT, _stop_after_point)
        task = list(config.hydra.overrides.task)
        params = config.hydra.sweeper.get("params") or {}
        total = config.hydra.sweeper.get("n_trials") or sweep_size(task + [f"{k}={v}" for k, v in params.items()])
        (sweep_dir / PROGRESS).write_text(json.dumps({"total": total, "bound": False, "start": time.time(),
                                                      "common": task}))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        progress = sweep_dir / PROGRESS
        if not progress.is_file():
            return
        done = sum(1 for p in sweep_dir.iterdir()
                   if p.is_dir() and ((p / "report.json").is_file() or (p / "error.json").is_file()))
        crashed = None
        if job_return.status == JobStatus.FAILED:
            try:
                job_return.return_value  # raises the job's exception
            except Exception as err:  # noqa: BLE001  (a crash is shown, and Hydra reports it)
                crashed = f"{type(err).__name__}: {err}"
            done += 1
        row = point_row(Path(HydraConfig.get().runtime.output_dir))
        print(point_line(row, done, json.loads(progress.read_text()), list(config.hydra.overrides.task), crashed),
              flush=True)
        if STOP.is_set() and RUNNING is not None:
            summarize(RUNNING, interrupted=True)
            raise SystemExit(130)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global RUNNING
        RUNNING = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        code = summarize(config)
        if code:
            raise SystemExit(code)
