"""The Hydra app behind `python -m engine` and the `offload-engine` script.

The task function lives here, not in __main__, so launchers that pickle it
(joblib, Ray, submitit) find it by reference.

    python -m engine +model=ltx budget=16000                 # predict one config
    python -m engine +model=ltx budget=16000 mode=check      # simulate-before-deploy gate
    python -m engine -m +model=ltx budget=8000,16000 weights.eviction=lru,belady

Bad input never shows a traceback: configuration errors, whether Hydra finds
them while composing or the engine finds them later, end as one line on stderr
and exit code 2.
"""
from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import conf
from engine.cli_errors import condense_hydra_error
from engine.config import register
from engine.errors import EngineError
from engine.job import objective, prepare
from engine.modes import runner
from engine.report import write_report
from engine.models.spec import SpecError

# The configs ship as the package `conf`. Hydra reads a directory faster than a
# pkg:// source (a 100-point sweep composes the config twice per point), and a
# directory exists both in a checkout and in an installed wheel.
CONFIG_DIR = str(Path(conf.__file__).resolve().parent)

register()


class _HeldStderr(io.TextIOBase):
    """Holds what Hydra writes to stderr until the job starts.

    Hydra reports composition errors as several lines plus a hint about
    HYDRA_FULL_ERROR; we want one line, so we hold stderr while Hydra
    composes and either release it (the job started) or condense it (Hydra
    exited on a composition error).
    """

    def __init__(self, real: io.TextIOBase):
        self.real = real
        self.held = io.StringIO()
        self.released = False

    def write(self, s: str) -> int:
        return (self.real if self.released else self.held).write(s)

    def flush(self) -> None:
        self.real.flush()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.real.write(self.held.getvalue())


_stderr: _HeldStderr | None = None


def task(cfg: DictConfig) -> float | None:
    """One job. Module-level and undecorated, so pickling launchers send it
    by reference rather than by value (with this module's stderr holder)."""
    if _stderr is not None and not _stderr.released:
        _stderr.release()
        sys.stderr = _stderr.real
    return run_job(cfg)


def run_job(cfg: DictConfig) -> float | None:
    """Prepare the job, run its mode, write and print the report; returns the objective's value."""
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        job = prepare(cfg, out_dir)
        outcome = runner(cfg.mode)(job)
    except (EngineError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        if multirun:
            # The sweep goes on; the summary lists this point as failed.
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "error.json").write_text(json.dumps({
                "overrides": list(hc.overrides.task), "error": str(err)}) + "\n")
            return math.nan
        sys.exit(getattr(err, "exit_code", 2))
    value = objective(cfg, outcome.report)
    outcome.report["objective_value"] = value
    write_report(out_dir, outcome.report, outcome.markdown)
    print(outcome.markdown)
    print(f"\nreport: {out_dir / 'report.json'}")
    if outcome.exit_code and not multirun:
        sys.exit(outcome.exit_code)
    return value


_app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(task)


def main() -> None:
    global _stderr
    _stderr = _HeldStderr(sys.stderr)
    sys.stderr = _stderr
    try:
        _app()
    except SystemExit as stop:
        held = _stderr.held.getvalue()
        # A crash inside a job keeps its traceback: that is a bug to report,
        # not bad input to condense.
        if not _stderr.released and stop.code not in (0, None) and "Traceback" not in held:
            message = condense_hydra_error(held)
            _stderr.held = io.StringIO()
            print(f"error: {message}", file=_stderr.real)
            raise SystemExit(2) from None
        raise
    finally:
        # --help and --cfg print and return before any job starts.
        _stderr.release()
        sys.stderr = _stderr.real
