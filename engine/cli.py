"""The Hydra app behind `python -m engine` and the `offload-engine` script.

The task function lives here, not in __main__, so launchers that pickle it
(joblib, Ray, submitit) find it by reference.

    python -m engine model=ltx budget=16000                 # predict one config
    python -m engine model=ltx budget=16000 mode=check      # simulate-before-deploy gate
    python -m engine -m model=ltx budget=8000,16000 weights.eviction=lru,belady

Bad input never shows a traceback: configuration errors, whether Hydra finds
them while composing or the engine finds them later, end as one line on stderr
and exit code 2.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import conf
from engine.cli_errors import condense_hydra_error
from engine.config import register
from engine.errors import ConfigError, EngineError
from engine.job import objective, prepare
from engine.modes import runner
from engine.report import title_md, write_report
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
        with claimed(out_dir):
            job = prepare(cfg, out_dir)
            outcome = runner(cfg.mode)(job)
            return _publish(cfg, hc, out_dir, outcome, multirun)
    except (EngineError, SpecError) as err:
        if multirun:
            # The sweep goes on; its line for this point and the summary show the error.
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "error.json").write_text(json.dumps({
                "overrides": list(hc.overrides.task), "error": str(err)}) + "\n")
            return math.nan
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))


def _publish(cfg: DictConfig, hc: Any, out_dir: Path, outcome: Any, multirun: bool) -> float:
    """Write the report, print it (one line per point in a sweep) and exit with the mode's code."""
    model_option = hc.runtime.choices.get("model") or cfg.model.name
    if "config" in outcome.report:
        outcome.report["config"]["model_option"] = model_option
    markdown = title_md(model_option, cfg) + "\n\n" + outcome.markdown
    try:
        write_report(out_dir, outcome.report, markdown)
    except OSError as e:
        raise ConfigError(f"cannot write the report in {out_dir}: {e.strerror or e}; "
                          "free space or pick a writable hydra.run.dir") from None
    if multirun:  # one line per point, from the sweep's callback (engine/sweep.py)
        return objective(outcome.report)
    print(markdown)
    print(f"\nreport: {out_dir / 'report.json'}")
    for line in outcome.notes:
        print(line, file=sys.stderr)
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
    return objective(outcome.report)


@contextmanager
def claimed(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir` for this run: a second run writing there at the same time is refused."""
    lock = out_dir / ".engine.lock"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        replicas = " (under torchrun, end it with ${replica:}: one directory a replica)" if "RANK" in os.environ else ""
        raise ConfigError(f"another run is writing to {out_dir} ({lock.name} is there); pick another "
                          f"hydra.run.dir{replicas}, or delete the lock if no run is") from None
    except OSError as e:
        raise ConfigError(f"cannot write to {out_dir}: {e.strerror or e}; pick a writable hydra.run.dir") from None
    os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


_app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(task)


HELP_FLAGS = ("--help", "-h")
# Hydra's options that take the next argument as their value (`--config-dir DIR`), and
# --info's optional one.
VALUED_OPTIONS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--package", "-p",
                  "--cfg", "-c", "--experimental-rerun", "--shell-completion", "-sc")
INFO_OPTIONS, INFO_VALUES = ("--info", "-i"), ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def hydra_args(argv: list[str]) -> list[str]:
    """The command line as Hydra needs it. Hydra's parser takes its options (`-m`,
    `--config-dir DIR`) only before the overrides: they move there, in their order. The
    defaults name `model: ???`, so Hydra refuses `+model=NAME` (append a group that is
    already there): it means `model=NAME`. Hydra composes the config to print --help,
    which a missing model would stop: help composes with the first model (the help text
    shows no config values)."""
    options: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if not a.startswith("-"):
            overrides.append(a[1:] if a.startswith("+model=") else a)
            continue
        options.append(a)
        if i < len(argv) and (a in VALUED_OPTIONS or (a in INFO_OPTIONS and argv[i] in INFO_VALUES)):
            options.append(argv[i])
            i += 1
    args = options + overrides
    if any(a in HELP_FLAGS for a in args) and not any(a.startswith("model=") for a in args):
        from engine.config import available_models

        args.append(f"model={available_models()[0]}")
    return args


def main() -> None:
    global _stderr
    sys.argv[1:] = hydra_args(sys.argv[1:])
    _stderr = _HeldStderr(sys.stderr)
    sys.stderr = _stderr
    try:
        _app()
    except KeyboardInterrupt:
        from engine import sweep

        if sweep.RUNNING is None:
            raise
        _stderr.release()
        print("interrupted: summarizing the points that finished", file=_stderr.real)
        sweep.summarize(sweep.RUNNING, interrupted=True)
        raise SystemExit(130) from None
    except SystemExit as stop:
        held = _stderr.held.getvalue()
        # A crash inside a job keeps its traceback: that is a bug to report,
        # not bad input to condense.
        yaml_error = re.search(r"yaml\.\w+\.\w+Error: (.*?)\n.*?in \"([^\"]+)\", line (\d+)", held, re.S)
        os_error = re.search(r"^(\w+Error): \[Errno \d+\] ([^:\n]+): '([^'\n]+)'\s*$", held, re.M)
        if not _stderr.released and stop.code not in (0, None) and os_error:
            _, why, path = os_error.groups()
            _stderr.held = io.StringIO()
            print(f"error: cannot create or write {path} ({why}); pick a writable hydra.run.dir "
                  "(or hydra.sweep.dir)", file=_stderr.real)
            raise SystemExit(2) from None
        if not _stderr.released and stop.code not in (0, None) and yaml_error:
            what, path, line = yaml_error.groups()
            _stderr.held = io.StringIO()
            print(f"error: {path}, line {line}: not valid YAML ({what.strip()}); fix the file", file=_stderr.real)
            raise SystemExit(2) from None
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
