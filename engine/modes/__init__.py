"""The modes of `python -m engine`, by name: the one list of them.

Each entry names the function that runs the mode ("module:function", a
function of an `engine.job.Job` returning an `engine.job.Outcome`); it is
imported only when the mode runs, so the config's checks read the list
without loading any mode (nor torch). `one_policy`: the mode runs a single
eviction policy, so weights=auto picks one for it first.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable


@dataclass(frozen=True)
class Mode:
    runner: str  # "module:function"
    one_policy: bool = False


MODES: dict[str, Mode] = {
    "plan": Mode("engine.modes.plan:plan_mode"),
    "simulate": Mode("engine.modes.simulate:simulate_mode", one_policy=True),
    "check": Mode("engine.modes.simulate:check_mode", one_policy=True),
    "execute": Mode("engine.modes.execute:execute_mode", one_policy=True),
    "materialize": Mode("engine.modes.execute:materialize_mode"),
    "record": Mode("engine.modes.record:record_mode", one_policy=True),
    "calibrate": Mode("engine.modes.calibrate:calibrate_mode"),
    "validate": Mode("engine.modes.validate:validate_mode"),
}


def runner(name: str) -> Callable[[Any], Any]:
    """The function that runs mode `name` (Job -> Outcome), imported now."""
    module, _, function = MODES[name].runner.partition(":")
    return getattr(import_module(module), function)
