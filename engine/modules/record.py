"""Recording a real module: each kernel's compute and host time -> a trace.

Each timed forward fetches every kernel's weights itself, synchronously (the
host waits for the copy, so no copy overlaps a kernel), then holds the compute
stream behind a spin kernel while the host launches the kernel's work: the
stamps around the kernel then time the GPU alone, and the host's launch time
is measured apart (it becomes the record's host_ns, which the simulator's
launcher spends per kernel). No weight needs to be resident beforehand, so a
model larger than the device records the same way.

Kernels timed one at a time run a few percent faster than in a pipelined step
(the GPU's clocks sag under sustained load). When the module fits on the device,
a pipelined all-resident step is timed too and, unless the host bounds it, every
kernel's compute is scaled so the kernels sum to it (header "compute_scale").

    record_module      timed forwards of a StreamedModule -> Trace (source "recorded")
    pipelined_step_ns  an all-resident step, timed whole
"""
from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone
from typing import Any, Mapping

import torch

from engine.executor.runtime import WeightExecutor
from engine.executor.setup import fits_resident
from engine.modules.streamed import StreamedModule
from engine.policy import AccessOrder
from engine.measure.clocks import Clock, clock_for
from engine.measure.timing import HOLD_FACTOR, KernelStamps
from engine.trace import FORMAT, VERSION, KernelRecord, Trace, check_trace

WARMUP_FORWARDS = 1
TIMED_FORWARDS = 2  # each copies every weight in synchronously: set-up time, medians of a quiet GPU
FIRST_HOLD_NS = 1_000_000  # the warm-up forward's hold per kernel, before any host time is known
HOLD_MARGIN_NS = 50_000
HOST_BOUND = 0.9  # host time over the pipelined step above which the host, not the kernels, sets it


class _Bring:
    """fetch(position): the kernel's weights copied to the device now (the host waits),
    then the compute stream held while the host launches the kernel."""

    def __init__(self, order: AccessOrder, host: Mapping[str, torch.Tensor], device: torch.device, clock: Clock,
                 hold_ns: list[int]):
        self.order = order
        self.host = host
        self.device = device
        self.clock = clock
        self.hold_ns = hold_ns

    def fetch(self, position: int) -> dict[str, torch.Tensor]:
        out = {w: self.host[w].to(self.device, copy=True) for w in self.order.reads[position]}
        self.clock.synchronize()
        self.clock.hold(self.hold_ns[position])
        return out


def _median(rows: list[list[int]]) -> list[int]:
    return [round(statistics.median(col)) for col in zip(*rows)]


def time_kernels(streamed: StreamedModule, clock: Clock, warmup: int = WARMUP_FORWARDS,
                 forwards: int = TIMED_FORWARDS) -> tuple[list[int], list[int]]:
    """Per kernel position, the median compute ns and host launch ns over `forwards` timed forwards."""
    order = streamed.order
    hold = [FIRST_HOLD_NS] * len(order)
    compute_rows, host_rows = [], []
    for f in range(warmup + forwards):
        stamps = KernelStamps(_Bring(order, streamed.host, streamed.device, clock, hold), clock)
        clock.synchronize()
        start = clock.stamp()
        with torch.no_grad(), streamed.hooks.forward(stamps):
            streamed.run()
        stamps.close()
        clock.synchronize()
        compute = stamps.compute_ns()
        compute[0] += clock.ns(start, stamps.before[0])  # the parent's work before the first kernel
        host = [max(0, h - fetch) for h, fetch in zip(stamps.host_ns(), stamps.host_fetch)]
        hold = [round(HOLD_FACTOR * h) + HOLD_MARGIN_NS for h in host]
        if f >= warmup:
            compute_rows.append(compute)
            host_rows.append(host)
    return _median(compute_rows), _median(host_rows)


def pipelined_step_ns(streamed: StreamedModule, clock: Clock, backend: str, warmup: int = 1,
                      steps: int = TIMED_FORWARDS) -> tuple[int, tuple[int, int] | None]:
    """The median step of the module with every weight resident (an executor with no
    budget), and on CUDA (the peak of torch's allocations in it: activations, inputs,
    resident parameters and buffers, as the streamed weights live in the executor's pool;
    the device bytes the process holds outside both)."""
    executor = WeightExecutor(streamed.order, streamed.host, budget_bytes=None, eviction="priority",
                              backend=backend)
    cuda = streamed.device.type == "cuda"
    try:
        times = []
        for s in range(warmup + steps):
            clock.synchronize()
            if cuda and s == warmup:
                torch.cuda.reset_peak_memory_stats(streamed.device)
            start = clock.stamp()
            with torch.no_grad(), executor.step(), streamed.hooks.forward(executor):
                streamed.run()
            end = clock.stamp()
            clock.synchronize()
            if s >= warmup:
                times.append(clock.ns(start, end))
        peak = None
        if cuda:
            free, total = torch.cuda.mem_get_info(streamed.device)
            # What this process holds outside torch's allocator and the pool: the context, library
            # workspaces, the registration's bookkeeping (hardware.context_mb's measured stand-in).
            outside = total - free - torch.cuda.memory_reserved(streamed.device) - executor.backend.reserved_peak_bytes()
            peak = (torch.cuda.max_memory_allocated(streamed.device), max(0, outside))
        return round(statistics.median(times)), peak
    finally:
        executor.close()


def record_module(streamed: StreamedModule, *, name: str, backend: str, workload: Mapping[str, Any] | None = None,
                  extra_header: Mapping[str, Any] | None = None) -> Trace:
    """The trace of one forward of `streamed` (inference), timed kernel by kernel."""
    device = streamed.device
    clock = clock_for(device)
    t0 = time.perf_counter()
    compute_ns, host_ns = time_kernels(streamed, clock)
    scale, pipelined, memory = 1.0, None, None
    if fits_resident(sum(streamed.order.sizes.values()), device):
        pipelined, memory = pipelined_step_ns(streamed, clock, backend)
        if sum(host_ns) < HOST_BOUND * pipelined:
            scale = pipelined / max(1, sum(compute_ns))
            compute_ns = [round(c * scale) for c in compute_ns]
    rec = streamed.recording
    order = streamed.order
    records = tuple(
        KernelRecord(name=order.kernels[i], layer=rec.layers[i], phase="fwd", weights=order.reads[i],
                     compute_ns=compute_ns[i], flops=rec.flops[i],
                     io_bytes=sum(order.sizes[w] for w in order.reads[i]), host_ns=host_ns[i])
        for i in range(len(order)))
    module = type(streamed.module)
    header = {
        "format": FORMAT, "version": VERSION, "records": len(records), "source": "recorded",
        "model": name, "num_layers": max(rec.layers, default=-1) + 1,
        "params": sum(p.numel() for p in streamed.module.parameters()), "workload": dict(workload or {}),
        "module": f"{module.__module__}.{module.__qualname__}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (cpu backend)",
        "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "clock": "cuda events" if device.type == "cuda" else "perf_counter (cpu backend)",
        "timed_steps": TIMED_FORWARDS, "step_ns": sum(compute_ns),
        "pipelined_step_ns": pipelined, "compute_scale": round(scale, 6),
        **({"activation_peak_bytes": memory[0], "context_bytes": memory[1]} if memory is not None else {}),
        "resident_bytes": streamed.resident_bytes, "record_s": round(time.perf_counter() - t0, 3),
        **(extra_header or {}),
    }
    trace = Trace(header=header, weight_sizes=dict(order.sizes), records=records)
    check_trace(trace)
    return trace
