"""The clocks a recording times with: CUDA events, or perf_counter on the CPU."""
from __future__ import annotations

import time
from typing import Any

import torch

# A held stream spins at an assumed 2 GHz (a slower clock only holds longer).
CYCLES_PER_NS = 2


class CpuClock:
    """perf_counter timestamps: the timing path of the cpu backend (and CPU tests)."""

    device = torch.device("cpu")

    def stamp(self, stream: Any = None) -> int:
        return time.perf_counter_ns()

    def ns(self, start: int, end: int) -> int:
        return end - start

    def hold(self, ns: int) -> None:
        pass  # nothing queues on the CPU: there is no stream to hold

    def synchronize(self) -> None:
        pass


class CudaClock:
    """Timing events on a CUDA stream (the current one unless given)."""

    def __init__(self, device: torch.device):
        self.device = device

    def stamp(self, stream: Any = None) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def ns(self, start: torch.cuda.Event, end: torch.cuda.Event) -> int:
        return round(start.elapsed_time(end) * 1e6)

    def hold(self, ns: int) -> None:
        # The host queues the step behind a spin kernel, so the stamps time the GPU alone.
        torch.cuda._sleep(int(ns * CYCLES_PER_NS))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


Clock = CpuClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """CUDA events on a CUDA device, perf_counter on the CPU."""
    return CudaClock(device) if device.type == "cuda" else CpuClock()
