"""Device memory: a capped pool for streamed weights, plus saved activations.

The cap is the weight budget, as the executor's capped cudaMemPool enforces
it: an allocation that does not fit waits (FIFO, no overtaking) until frees
make room. Frees are stream-ordered; the caller frees only once the kernels
reading the evicted weight have completed. Activations are not capped here
(the activation policy bounds them) but count toward device bytes, whose
every change is recorded so the timeline is exact. The peak is each arena's
own high-water mark, summed: the executor's weight pool and torch's allocator
(the saved activations) each keep the memory they reached, and `execute`
measures each peak on its own.
"""
from __future__ import annotations

from collections import deque

import simpy

from engine.errors import ConfigError


class DevicePool:
    def __init__(self, env: simpy.Environment, cap_bytes: int | None):
        self.env = env
        self.cap = cap_bytes
        self.weight_bytes = 0
        self.activation_bytes = 0
        self.waiting: deque[tuple[int, simpy.Event]] = deque()
        self.series: list[tuple[int, int]] = [(0, 0)]  # (time ns, device bytes) after each change
        self.weight_peak = 0
        self.activation_peak = 0

    def allocate(self, nbytes: int, what: str) -> simpy.Event | None:
        """Reserve `nbytes` for weight `what`: None if granted now, else an event
        that fires when it is granted."""
        if self.cap is not None and nbytes > self.cap:
            raise ConfigError(
                f"weight {what} ({nbytes / 1e6:.3f} MB) is larger than the whole budget "
                f"({self.cap / 1e6:.3f} MB); raise the budget above the floor")
        if not self.waiting and self._fits(nbytes):
            self._take(nbytes)
            return None
        granted = self.env.event()
        self.waiting.append((nbytes, granted))
        return granted

    def free(self, nbytes: int) -> None:
        self.weight_bytes -= nbytes
        self._record()
        while self.waiting and self._fits(self.waiting[0][0]):
            nbytes, granted = self.waiting.popleft()
            self._take(nbytes)
            granted.succeed()

    def add_activation(self, nbytes: int) -> None:
        self.activation_bytes += nbytes
        self.activation_peak = max(self.activation_peak, self.activation_bytes)
        self._record()

    def drop_activation(self, nbytes: int) -> None:
        self.activation_bytes -= nbytes
        self._record()

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes

    @property
    def peak(self) -> int:
        """The weights' peak plus the saved activations' peak, each reached at its own instant."""
        return self.weight_peak + self.activation_peak

    def _fits(self, nbytes: int) -> bool:
        return self.cap is None or self.weight_bytes + nbytes <= self.cap

    def _take(self, nbytes: int) -> None:
        self.weight_bytes += nbytes
        self.weight_peak = max(self.weight_peak, self.weight_bytes)
        self._record()

    def _record(self) -> None:
        total = self.weight_bytes + self.activation_bytes
        now = self.env.now
        if self.series[-1][0] == now:
            self.series[-1] = (now, total)  # one sample per instant; the peak still sees each change
        else:
            self.series.append((now, total))
