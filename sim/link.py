"""The PCIe link between host and GPU: two copy queues sharing one duplex cap.

Each direction (H2D, D2H) runs one copy at a time, as the GPU's copy engine
does, from FIFO queues, one per stream the executor issues on: the weights'
copy stream, the activations' spill and restore streams. A copy whose gate has
not fired (an event its stream waits on) holds back its own stream only; the
engine takes the oldest ready head of the others. An urgent copy (an on-demand
restore, which the executor issues on a stream of its own) goes first: behind
the copy in progress, ahead of every waiting one. The two directions run at the same time, but their sum is capped
(hardware.duplex_gbps, below h2d_gbps + d2h_gbps), so a copy is re-rated
whenever the other direction starts or stops: a fluid model, one timer per
rate change, never one event per chunk.
"""
from __future__ import annotations

from bisect import bisect_left
from math import ceil
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import simpy
from engine.units import MIB

H2D = "h2d"
D2H = "d2h"
WEIGHTS = "weights"  # the executor's weight copy stream
ACTIVATIONS = "activations"  # its spill (D2H) and restore (H2D) streams
URGENT = "urgent"  # an on-demand restore's own stream


def source_gbps(hardware: Any, source: str) -> float:
    """Large-copy H2D bandwidth from where the bytes live on the host."""
    rates = {
        "pinned": hardware.h2d_gbps,
        "mmap_registered": hardware.mmap_registered_gbps,
        "mmap": hardware.mmap_gbps,
        "pageable": hardware.pageable_gbps,
    }
    return float(rates[source])


class SmallCopyEfficiency:
    """Fraction of the large-copy rate a copy of a given size reaches.

    Interpolates the measured (small_copy_mib, small_copy_gbps) points
    relative to pinned H2D; below the smallest point its rate holds, above
    the largest the large-copy rate does.
    """

    def __init__(self, hardware: Any):
        self.sizes = [float(m) * MIB for m in hardware.small_copy_mib]
        self.fractions = [min(1.0, float(g) / float(hardware.h2d_gbps)) for g in hardware.small_copy_gbps]
        if len(self.sizes) != len(self.fractions) or self.sizes != sorted(self.sizes):
            raise ValueError("hardware.small_copy_mib must be ascending and as long as small_copy_gbps")

    def __call__(self, nbytes: int) -> float:
        if not self.sizes:
            return 1.0
        if nbytes <= self.sizes[0]:
            return self.fractions[0]
        if nbytes >= self.sizes[-1]:
            return 1.0
        i = bisect_left(self.sizes, nbytes)
        s0, s1 = self.sizes[i - 1], self.sizes[i]
        f0, f1 = self.fractions[i - 1], self.fractions[i]
        return f0 + (f1 - f0) * (nbytes - s0) / (s1 - s0)


@dataclass(eq=False)
class Copy:
    """One copy: `nbytes` at `gbps` when it has its direction to itself.

    `gate`, if given, must fire before the copy may start (e.g. the kernel that
    produced a spilled tensor); the copies behind it on its stream wait, as a
    CUDA stream waiting on an event does. `on_start` runs when the first byte moves (a
    restore allocates its device bytes then); `done` fires when the last byte
    has landed.
    """

    label: str
    nbytes: int
    gbps: float
    done: simpy.Event
    gate: simpy.Event | None = None
    on_start: Callable[[], None] | None = None
    urgent: bool = False  # queued ahead of the non-urgent copies (PcieLink.copy)
    stream: str = WEIGHTS
    order: int = 0  # submission order within the direction: the engine serves the oldest ready head
    start_ns: int = -1
    end_ns: int = -1
    remaining: float = field(default=0.0, repr=False)


class _Direction:
    def __init__(self, name: str):
        self.name = name
        self.queues: dict[str, deque[Copy]] = {}  # per stream, FIFO
        self.active: Copy | None = None
        self.rate = 0.0  # bytes per ns (= GB/s) of the active copy
        self.since = 0  # when `active.remaining` was last brought up to date
        self.version = 0  # bumps on every re-rate; stale completion timers ignore themselves
        self.gated: set[str] = set()  # streams whose head waits on its gate
        self.submitted = 0


class PcieLink:
    """Full-duplex link: one copy at a time per direction from FIFO streams, shared aggregate bandwidth."""

    def __init__(self, env: simpy.Environment, hardware: Any,
                 log: Callable[[int, str, str], None]):
        self.env = env
        self.duplex = float(hardware.duplex_gbps)
        self.efficiency = SmallCopyEfficiency(hardware)
        self.dirs = {H2D: _Direction(H2D), D2H: _Direction(D2H)}
        self.log = log
        self.watchers: list[Callable[[], None]] = []  # called when `busy` turns on or off
        self._was_busy = False

    def copy(self, direction: str, label: str, nbytes: int, gbps: float,
             gate: simpy.Event | None = None, on_start: Callable[[], None] | None = None,
             urgent: bool = False, stream: str = WEIGHTS) -> Copy:
        """Queue a copy on `stream`; `gbps` is its large-copy rate from its source.
        `urgent`: a stream of its own, served before every other waiting copy."""
        d = self.dirs[direction]
        c = Copy(label=label, nbytes=nbytes, gbps=gbps * self.efficiency(nbytes),
                 done=self.env.event(), gate=gate, on_start=on_start, urgent=urgent,
                 stream=URGENT if urgent else stream, order=d.submitted)
        d.submitted += 1
        d.queues.setdefault(c.stream, deque()).append(c)
        if d.active is None:
            self._start_next(d)
        return c

    @property
    def busy(self) -> bool:
        return self.dirs[H2D].active is not None or self.dirs[D2H].active is not None

    def _busy_changed(self) -> None:
        if self.busy != self._was_busy:
            self._was_busy = not self._was_busy
            for fn in self.watchers:
                fn()

    def _other(self, d: _Direction) -> _Direction:
        return self.dirs[D2H] if d.name == H2D else self.dirs[H2D]

    def _fair_rate(self, d: _Direction) -> float:
        # Max-min share of the duplex cap: with both directions busy each gets at
        # least half, and more when the other cannot use its half (a pageable copy).
        own = d.active.gbps
        other = self._other(d).active
        if other is None:
            return own
        return min(own, max(self.duplex / 2, self.duplex - other.gbps))

    def _start_next(self, d: _Direction) -> None:
        ready = []
        for stream, queue in d.queues.items():
            if not queue or stream in d.gated:
                continue
            head = queue[0]
            if head.gate is not None and head.gate.callbacks is not None:
                d.gated.add(stream)  # FIFO: nothing behind the head on its stream may overtake it
                head.gate.callbacks.append(lambda _ev, d=d, stream=stream: self._ungate(d, stream))
                continue
            ready.append(head)
        if not ready:
            return
        head = min(ready, key=lambda c: (not c.urgent, c.order))
        d.queues[head.stream].popleft()
        now = self.env.now
        head.start_ns = now
        head.remaining = float(head.nbytes)
        d.active = head
        d.rate = 0.0
        d.since = now
        self.log(now, d.name, "start " + head.label)
        if head.on_start is not None:
            head.on_start()
        self._rerate(d, force=True)
        self._rerate(self._other(d), force=False)
        self._busy_changed()

    def _ungate(self, d: _Direction, stream: str) -> None:
        d.gated.discard(stream)
        if d.active is None:
            self._start_next(d)

    def _rerate(self, d: _Direction, force: bool) -> None:
        """Bring the active copy's bytes up to date and time its end at the new rate."""
        if d.active is None:
            return
        rate = self._fair_rate(d)
        if rate == d.rate and not force:
            return  # unchanged: the scheduled completion still holds
        now = self.env.now
        d.active.remaining -= d.rate * (now - d.since)
        d.rate = rate
        d.since = now
        d.version += 1
        # Integer ns, rounded up so a copy never lands before its last byte.
        delay = max(0, ceil(d.active.remaining / rate - 1e-6))
        timer = self.env.timeout(delay)
        timer.callbacks.append(lambda _ev, d=d, v=d.version: self._finish(d, v))

    def _finish(self, d: _Direction, version: int) -> None:
        if version != d.version:
            return  # re-rated since this timer was set
        c = d.active
        now = self.env.now
        c.end_ns = now
        c.remaining = 0.0
        d.active = None
        d.rate = 0.0
        self.log(now, d.name, "end " + c.label)
        c.done.succeed()
        self._rerate(self._other(d), force=False)
        self._start_next(d)
        self._busy_changed()
