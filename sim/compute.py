"""The compute stream: kernels run one at a time, in launch order.

A kernel starts when the host has launched it, the previous kernel is done,
and its dependencies (weight copies, activation restores, offloads it must
wait for) have landed. A block of a recorded module is launched with its first
kernel and ends no sooner than its host has issued the rest (`not_before`).

A kernel's pace. Its recorded time is its pace in a held step, a GPU fresh from
idle. Under sustained load the GPU's clocks drop under its power limit: a kernel
runs `sustained` slower at a duty of 1, scaled by the stream's duty (its busy
share, averaged over the last `window_ns`, exponentially) when the kernel starts.
While a copy is on the link (either direction) it progresses at
1 / (1 + slowdown_under_copy) of that pace: a copy through part of a kernel slows
that part (the slowdown is measured with copies running throughout).
Start and end times are kept per kernel so every metric (compute, stall,
overlap) is derived after the run, off the hot path.
"""
from __future__ import annotations

from collections import deque
from math import ceil, exp
from typing import Any, Callable, Mapping

import simpy

from engine.trace import KernelRecord
from sim.link import PcieLink


def trace_sustained_slowdown(header: Mapping[str, Any], hardware: Any) -> float:
    """How much slower than recorded a trace's kernels run at a sustained duty of 1: the
    recording's own (header "compute_sustained_slowdown"); none where the recorder scaled
    its kernels to its pipelined step already (header "compute_scale", engine/modules/record.py);
    else the profile's."""
    if "compute_sustained_slowdown" in header:
        return float(header["compute_sustained_slowdown"])
    if "compute_scale" in header:
        return 0.0
    return float(hardware.compute_sustained_slowdown)


class ComputeStream:
    def __init__(self, env: simpy.Environment, link: PcieLink, slowdown_under_copy: float,
                 log: Callable[[int, str, str], None], sustained: float = 0.0, window_ns: float = 5e8):
        self.env = env
        self.link = link
        self.slowdown = slowdown_under_copy
        self.sustained = sustained
        self.window_ns = window_ns
        self.duty = 0.0  # the busy share over the last window_ns: a GPU idle before the run
        self._idle_since = 0
        self.log = log
        self.queue: deque[tuple[int, KernelRecord, list[simpy.Event], int]] = deque()
        self.completed = 0  # kernels done; kernel `seq` is done iff seq < completed
        self.launched_ns: list[int] = []  # per kernel seq: when the host launched it
        self.start_ns: list[int] = []
        self.end_ns: list[int] = []
        self.run_ns: list[int] = []  # per kernel seq: its own run time (end - start less any wait for its host)
        self._after: dict[int, list[Callable[[], None]]] = {}
        self._wake: simpy.Event | None = None
        # The running kernel's work left (ns at its own pace), since when, at what rate; its end.
        self._left = 0.0
        self._since = 0
        self._rate = 1.0
        self._version = 0
        self._done: simpy.Event | None = None
        if slowdown_under_copy:
            link.watchers.append(self._link_changed)
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
            start = env.now
            self.start_ns.append(start)
            self.log(start, "compute", "start " + record.name)
            work = record.compute_ns
            if self.sustained:
                self.duty *= exp(-(start - self._idle_since) / self.window_ns)
                work = round(work * (1.0 + self.sustained * self.duty))
            if self.slowdown:
                yield self._work(work)
            else:
                yield env.timeout(work)
            self.run_ns.append(env.now - start)
            if self.sustained:
                self.duty = 1.0 - (1.0 - self.duty) * exp(-(env.now - start) / self.window_ns)
                self._idle_since = env.now
            if env.now < not_before:
                yield env.timeout(not_before - env.now)
            now = env.now
            self.end_ns.append(now)
            self.log(now, "compute", "end " + record.name)
            self.completed = seq + 1
            for fn in self._after.pop(seq, ()):
                fn()

    def _work(self, ns: int) -> simpy.Event:
        """An event for the end of `ns` of the kernel's own work, slowed while the link is busy."""
        self._left = float(ns)
        self._since = self.env.now
        self._rate = self._pace()
        self._done = self.env.event()
        self._schedule()
        return self._done

    def _pace(self) -> float:
        return 1.0 / (1.0 + self.slowdown) if self.link.busy else 1.0

    def _schedule(self) -> None:
        self._version += 1
        # Integer ns, rounded up so a kernel never ends before its last work.
        timer = self.env.timeout(max(0, ceil(self._left / self._rate - 1e-6)))
        timer.callbacks.append(lambda _ev, v=self._version: self._finish(v))

    def _finish(self, version: int) -> None:
        if version != self._version or self._done is None:
            return  # re-paced since this timer was set
        done, self._done = self._done, None
        done.succeed()

    def _link_changed(self) -> None:
        """A copy started or the link went idle: bring the running kernel's work up to date
        and time its end at the new pace."""
        if self._done is None:
            return
        now = self.env.now
        self._left = max(0.0, self._left - self._rate * (now - self._since))
        self._since = now
        self._rate = self._pace()
        self._schedule()
