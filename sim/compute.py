"""The compute stream: kernels run one at a time, in launch order.

A kernel starts when the host has launched it, the previous kernel is done,
and its dependencies (weight copies, activation restores, offloads it must
wait for) have landed. A block of a recorded module is launched with its first
kernel and ends no sooner than its host has issued the rest (`not_before`).
Start and end times are kept per kernel so every metric (compute, stall,
overlap) is derived after the run, off the hot path.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import simpy

from engine.trace import KernelRecord
from sim.link import PcieLink


class ComputeStream:
    def __init__(self, env: simpy.Environment, link: PcieLink, slowdown_under_copy: float,
                 log: Callable[[int, str, str], None]):
        self.env = env
        self.link = link
        self.slowdown = slowdown_under_copy
        self.log = log
        self.queue: deque[tuple[int, KernelRecord, list[simpy.Event], int]] = deque()
        self.completed = 0  # kernels done; kernel `seq` is done iff seq < completed
        self.launched_ns: list[int] = []  # per kernel seq: when the host launched it
        self.start_ns: list[int] = []
        self.end_ns: list[int] = []
        self.run_ns: list[int] = []  # per kernel seq: its own run time (end - start less any wait for its host)
        self._after: dict[int, list[Callable[[], None]]] = {}
        self._wake: simpy.Event | None = None
        self._slot: simpy.Event | None = None
        self._slot_limit = 0
        env.process(self._run())

    def launch(self, seq: int, record: KernelRecord, deps: list[simpy.Event], not_before: int = 0) -> None:
        """Queue kernel `seq`; it ends no sooner than `not_before` (ns: its host's last launch)."""
        self.launched_ns.append(self.env.now)
        self.queue.append((seq, record, deps, not_before))
        if self._wake is not None:
            self._wake.succeed()
            self._wake = None

    def after(self, seq: int, fn: Callable[[], None]) -> None:
        """Run `fn` when kernel `seq` has completed (now, if it has): stream-ordered work."""
        if seq < self.completed:
            fn()
        else:
            self._after.setdefault(seq, []).append(fn)

    def done_event(self, seq: int) -> simpy.Event | None:
        """An event for kernel `seq`'s completion, or None if it already completed."""
        if seq < self.completed:
            return None
        ev = self.env.event()
        self.after(seq, ev.succeed)
        return ev

    def slot(self, in_flight: int) -> simpy.Event:
        """Fires when fewer than `in_flight` launched kernels are still unfinished."""
        self._slot = self.env.event()
        self._slot_limit = in_flight
        return self._slot

    def _run(self):
        env = self.env
        while True:
            if not self.queue:
                self._wake = env.event()
                yield self._wake
            seq, record, deps, not_before = self.queue.popleft()
            for ev in deps:
                if ev.callbacks is not None:  # not yet processed: wait for it
                    yield ev
            now = env.now
            self.start_ns.append(now)
            self.log(now, "compute", "start " + record.name)
            duration = record.compute_ns
            if self.slowdown and self.link.busy:
                # Kept simple: the slowdown is fixed by whether a copy runs at the start.
                duration = round(duration * (1.0 + self.slowdown))
            self.run_ns.append(duration)
            yield env.timeout(max(duration, not_before - now))
            now = env.now
            self.end_ns.append(now)
            self.log(now, "compute", "end " + record.name)
            self.completed = seq + 1
            for fn in self._after.pop(seq, ()):
                fn()
            if self._slot is not None and len(self.launched_ns) - self.completed < self._slot_limit:
                self._slot.succeed()
                self._slot = None
