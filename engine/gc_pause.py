"""No cyclic garbage collection inside a hot loop.

A step of the executor, the activation offloader or the simulator creates
many short-lived objects (decisions, events, hook bookkeeping) that reference
counting frees. Their sheer number sets off cyclic collections, and a full one
walks every live object of the process: in a CLI run that also holds Hydra's
configs and the simulator's result, that cost tens of milliseconds a step
(benchmarks/sim_speed.py, benchmarks/train_bench.py). Cycles made during the
loop are collected after it, at the next threshold.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic GC off inside, restored to its previous state after (nests)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
