"""Recording a real module: each kernel's compute and host time -> a trace.

Each timed forward fetches every kernel's weights itself, synchronously (the
host waits for the copy, so no copy overlaps a kernel); where an inference's
weights fit on the device, they are copied in once, by the first forward, and
every later one reads them there. Forwards with the stream
running free time the host's launch work per kernel (the record's host_ns, which
the simulator's launcher spends); then forwards that hold the compute stream
behind a spin kernel while the host launches each kernel's work time the GPU
alone (`time_kernels`). No weight needs to be resident beforehand, so a model
larger than the device records the same way.

Kernels timed one at a time run a few percent faster than in a pipelined step
(the GPU's clocks sag under sustained load). When the module fits on the device,
its all-resident steps are timed whole too (engine/modules/resident_steps.py). Where
the kernels' times, sagged by up to HOST_BOUND_STEP (engine/trace.py
host_bound), reach that step, the GPU bounds it: every kernel's compute is scaled so
the kernels sum to it (header "compute_scale"), and host times that sum past it are
scaled down to it (header "host_scale"), as a host cannot take longer than the step it
ran in. Otherwise the host bounds it (a decode step of small kernels): the host times
are scaled so they sum to it. Those steps also give the header "host_syncs" (the
kernels before which an inference's host synchronized with the device; the
simulator's host waits there for every kernel launched before, each step) and
"compute_slowdown_under_copy" (the module's own, which the simulator takes over the
profile's); where the host bounds the step, the plain module's steps timed in turns
with them give "plain_step_ns", and "plain_host_factor" takes the host times to that
step, for the simulator where every weight is resident (where the GPU bounds the step,
the hooks' host work hides behind it). The plain step bounds the GPU's work too: where
it is shorter than the pipelined step, the kernels are scaled to it, not to a step the
hooks' host work lengthened. A record's host time is spread over
its block's launches (header "block_records"): the simulator starts its GPU work
with the first launch.

A training step (`loss_fn` given: the module made streamable with training=True,
its adapters trainable) is recorded the same way over the training order (the
forward's kernels, then their mirror): the backward reaches each kernel's mirror
where autograd first unpacks one of its weights or recomputes it (activation
checkpointing), and the recording fetches and holds there as in the forward. Each
forward record also lists what autograd saved while it ran (the tensors the
activation offloader would see: weights and adapters are not among them), and each
backward record the saved tensors it unpacks first. Each forward record carries its op
census from the order forward (engine/modules/census.py), which mode=calibrate --modules
fits a real module's memory-bound work and host time to.

    record_module      timed steps of a StreamedModule -> Trace (source "recorded")
    time_kernels       each kernel's host and GPU time
"""
from __future__ import annotations

import logging
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, NamedTuple

import torch

from engine.executor.runtime import WeightExecutor
from engine.executor.setup import device_memory_mb, device_name, fits_resident
from engine.executor.training import RECOMPUTE, StreamedWeights, train_order, weight_handles
from engine.compute import BACKWARD_FLOPS_FACTOR
from engine.gc_pause import paused_gc
from engine.measure.clocks import Clock, clock_for
from engine.measure.launches import Census
from engine.measure.timing import HOLD_FACTOR, KernelStamps, NotedTensors, SavedTensorLog, pipelined_scale
from engine.modules.resident_steps import (LossFn, Pipelined, clear_grads, pipelined_step_ns, resident_executor,
                                           trainable_params)
from engine.modules.streamed import StreamedModule, stage
from engine.modules.synthesize import seen_forward
from engine.policy import AccessOrder
from engine.trace import (BACKWARD_SUFFIX, FORMAT, VERSION, KernelRecord, Trace, check_trace, saved_tensors,
                          host_bound)

log = logging.getLogger(__name__)

class TimedSteps(NamedTuple):
    """How many steps `time_kernels` runs: untimed, then with the stream free (each position's
    host time their median), then held (its compute time their median)."""

    warmup: int
    host: int
    held: int


# A warm-up step first: the host's launch work per kernel falls over the first steps, the order
# forward's included, so an inference's first timed forward would read it high. One held step for
# an inference: a kernel's GPU time varies little from step to step, and where the GPU bounds the
# all-resident steps the kernels are scaled to them.
INFERENCE_STEPS = TimedSteps(warmup=1, host=2, held=1)
TRAINING_STEPS = TimedSteps(warmup=1, host=2, held=2)
HOLD_MARGIN_NS = 50_000


class _Bring:
    """fetch(position): the position's weights on the device now (the host waits): copied
    in from `host`, or from `resident`, an executor with no budget that keeps them there
    once copied; then, for a hold above 0, the compute stream held while the host
    launches the kernel."""

    def __init__(self, order: AccessOrder, host: Mapping[str, torch.Tensor], device: torch.device, clock: Clock,
                 hold_ns: list[int], resident: WeightExecutor | None = None):
        self.order = order
        self.host = host
        self.device = device
        self.clock = clock
        self.hold_ns = hold_ns
        self.resident = resident

    def close(self) -> None:
        """Drop the host weights: a graph autograd keeps alive (a branch backward never
        reached) may hold this object, and the host weights may be views of a checkpoint."""
        self.host = {}

    def fetch(self, position: int) -> dict[str, torch.Tensor]:
        if self.resident is not None:
            out = self.resident.fetch(position)
        else:
            out = {w: self.host[w].to(self.device, copy=True) for w in self.order.reads[position]}
        self.clock.synchronize()
        if self.hold_ns[position]:
            self.clock.hold(self.hold_ns[position])
        return out


class _Stamped(KernelStamps):
    """KernelStamps as the executor of StreamedWeights (a training step's fetches)."""

    def hand_over(self) -> None:
        """The backward's thread fetches now; nothing here is owned by a thread."""


def _median(rows: list[list[int]]) -> list[int]:
    return [round(statistics.median(col)) for col in zip(*rows)]


@dataclass
class KernelTimes:
    """Per position of the recorded order: median compute ns and host ns; training adds
    the last timed step's saved tensors (SavedTensorLog's `saved` and `last_saver`)."""

    compute_ns: list[int]
    host_ns: list[int]
    launches: list[int] = field(default_factory=list)  # CUDA launches per position (none off CUDA)
    saved: dict[int, list[int]] = field(default_factory=dict)
    last_saver: dict[tuple[int, int], int] = field(default_factory=dict)
    packs: dict[int, int] = field(default_factory=dict)  # SavedTensorLog.packs
    # Training: the most bytes of weight copies recompute held at a timed step's end (every
    # checkpointed block's, kept until then: KernelHooks.release_recomputed).
    recompute_bytes: int = 0


def time_kernels(streamed: StreamedModule, clock: Clock, loss_fn: LossFn | None = None,
                 resident: WeightExecutor | None = None) -> KernelTimes:
    """Each position's median compute and host time over the timed steps (INFERENCE_STEPS, or
    TRAINING_STEPS): forwards, or (`loss_fn`) training steps over the training order. An
    inference copies each weight in at its fetch (synchronously), or `resident`, an executor
    with no budget over the module's order, does at the first step and keeps it.

    Host time comes from steps whose stream runs free: the host's own launch time, or the
    GPU's where the GPU is slower (the copies' synchronization bounds what can queue).
    Compute comes from steps whose stream is held at each position for 1.5x that host time,
    so the GPU runs the position's work back to back. A held stream must not time the host:
    a position that queues more launches than the device's queue holds blocks its host
    until the held work drains, and the hold the next step derives from that grows."""
    training = loss_fn is not None
    order = train_order(streamed.order) if training else streamed.order
    forward_kernels = len(streamed.order)
    index = {name: i for i, name in enumerate(streamed.order.kernels)}
    # Storages autograd may save that are not activations: resident parameters and the adapters.
    weight_ptrs = {p.untyped_storage().data_ptr() for p in streamed.module.parameters()
                   if id(p) not in streamed.placeholders}
    trainable = trainable_params(streamed.module) if training else []
    free = [0] * len(order)
    hold = free
    compute_rows, host_rows = [], []
    log = None
    recompute_bytes = 0

    def one_step(hold: list[int], census: Census | None = None) -> tuple[_Stamped, Any, SavedTensorLog | None]:
        nonlocal recompute_bytes
        bring = _Bring(order, streamed.host, streamed.device, clock, hold, resident)
        stamps = _Stamped(bring, clock)
        stamps.census = census
        log = None
        clear_grads(trainable)
        clock.synchronize()
        with paused_gc():  # a collection inside a timed step would land in one kernel's time
            start = clock.stamp()
            if training:
                weights = StreamedWeights(stamps, forward_kernels)
                streamed.hooks.recompute = lambda name: weights.mirror(index[name], f"{RECOMPUTE} {name}")
                log = SavedTensorLog(stamps, weight_ptrs)
                weights.start_step()
                with weight_handles(weights, NotedTensors(log, lambda: log.stamps.current)):
                    with streamed.hooks.forward(weights):
                        out = streamed.run()
                    loss_fn(out).backward()
                weights.finish()
                recompute_bytes = max(recompute_bytes, streamed.hooks.release_recomputed())
            else:
                with torch.no_grad(), resident.step() if resident else nullcontext(), \
                        streamed.hooks.forward(stamps):
                    streamed.run()
            stamps.close()
        clock.synchronize()
        bring.close()
        return stamps, start, log

    warmup, host_steps, held_steps = TRAINING_STEPS if training else INFERENCE_STEPS
    for f in range(warmup + host_steps + held_steps):
        timing_host = f < warmup + host_steps
        if f == warmup + host_steps:
            hold = [round(HOLD_FACTOR * h) + HOLD_MARGIN_NS for h in _median(host_rows)]
        stamps, start, log = one_step(hold)
        if f < warmup:
            continue
        if timing_host:
            host_rows.append([max(0, h - fetch) for h, fetch in zip(stamps.host_ns(), stamps.host_fetch)])
        else:
            compute = stamps.compute_ns()
            compute[0] += clock.ns(start, stamps.before[0])  # the parent's work before the first kernel
            compute_rows.append(compute)
    # One more step, the stream free, counts each position's CUDA launches (engine/measure/launches.py).
    with Census(streamed.device.type == "cuda") as census:
        if census.on:
            one_step(free, census)
    streamed.hooks.recompute = None
    times = KernelTimes(_median(compute_rows), _median(host_rows),
                        launches=[census.counts.get(i, 0) for i in range(len(order))] if census.counts else [],
                        recompute_bytes=recompute_bytes)
    if log is not None:
        times.saved, times.last_saver, times.packs = log.saved, log.last_saver, log.packs
    return times


def fit_to_pipelined(compute_ns: int, host_ns: int, pipelined_ns: int,
                     plain_ns: int | None = None) -> tuple[float, float]:
    """The factors (compute, host) on the kernel-by-kernel times that make them agree with
    the pipelined all-resident step (module docstring). The plain module's step (`plain_ns`,
    the hooks off) bounds the GPU's work: where the hooks' host work lengthens the pipelined
    step past it, the kernels are fitted to the plain step, not to the host's."""
    gpu_ns = min(pipelined_ns, plain_ns) if plain_ns else pipelined_ns
    gpu_bound = not host_bound(compute_ns, gpu_ns)
    return (gpu_ns / max(1, compute_ns) if gpu_bound else 1.0,
            pipelined_scale(host_ns, pipelined_ns, gpu_bound))


def _records(streamed: StreamedModule, times: KernelTimes, training: bool) -> tuple[KernelRecord, ...]:
    """Forward records (training: with what each saved), then the backward mirror."""
    rec, order = streamed.recording, streamed.order
    n = len(order)
    saved, needs = saved_tensors(order.kernels, rec.layers, times.saved, times.last_saver)
    forward = [KernelRecord(
        name=order.kernels[i], layer=rec.layers[i], phase="fwd", weights=order.reads[i],
        compute_ns=times.compute_ns[i], flops=rec.flops[i],
        io_bytes=sum(order.sizes[w] for w in order.reads[i]), host_ns=times.host_ns[i], saved=saved[i],
        launches=times.launches[i] if times.launches else 0, packs=times.packs.get(i, 0),
        cores=tuple(rec.census[i].cores), passes=rec.census[i].pass_list(), ops=rec.census[i].ops,
        dispatches=rec.census[i].dispatches)
        for i in range(n)]
    if not training:
        return tuple(forward)
    backward = [KernelRecord(
        name=order.kernels[i] + BACKWARD_SUFFIX, layer=rec.layers[i], phase="bwd", weights=order.reads[i],
        compute_ns=times.compute_ns[2 * n - 1 - i], flops=BACKWARD_FLOPS_FACTOR * rec.flops[i],
        io_bytes=forward[i].io_bytes, host_ns=times.host_ns[2 * n - 1 - i], needs=tuple(needs.get(i, ())),
        launches=times.launches[2 * n - 1 - i] if times.launches else 0)
        for i in reversed(range(n))]
    return tuple(forward + backward)


def _allocated_from(device: torch.device) -> Callable[[], int | None]:
    """From now, a reader of the most bytes torch's allocator held beyond what it holds now (None
    off CUDA)."""
    if device.type != "cuda":
        return lambda: None
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    return lambda: torch.cuda.max_memory_allocated(device) - base


def _memory_note(device: torch.device) -> str:
    """The device memory as the process sees it, for a log line."""
    if device.type != "cuda":
        return "the host's memory"
    free, total = torch.cuda.mem_get_info(device)
    return (f"{free / 1e9:.2f} of {total / 1e9:.2f} GB free; torch holds {torch.cuda.memory_allocated(device) / 1e9:.2f} "
            f"GB allocated, {torch.cuda.memory_reserved(device) / 1e9:.2f} GB reserved")


def record_module(streamed: StreamedModule, *, name: str, backend: str, workload: Mapping[str, Any] | None = None,
                  loss_fn: LossFn | None = None, extra_header: Mapping[str, Any] | None = None) -> Trace:
    """The trace of one forward of `streamed` (inference), or with `loss_fn` of one
    training step (forward, loss_fn(output).backward()), timed kernel by kernel."""
    device = streamed.device
    clock = clock_for(device)
    training = loss_fn is not None
    steps = TRAINING_STEPS if training else INFERENCE_STEPS
    t0 = time.perf_counter()
    model_bytes = sum(streamed.order.sizes.values())
    # Inference that fits copies the weights in once; training's saved tensors are known
    # only after a step, so it copies them in at every fetch until then.
    resident = resident_executor(streamed, backend) if not training and fits_resident(model_bytes, device) else None
    stages: dict[str, float] = {}
    try:
        allocated = _allocated_from(device)
        with stage(stages, "kernels"):
            times = time_kernels(streamed, clock, loss_fn, resident=resident)
        saved_bytes = sum(sum(v) for v in times.saved.values())
        run = Pipelined(0)
        # Beside the weights: what the timed steps allocated (activations, saved tensors, a block's
        # weights in flight) where measured, else the saved tensors.
        transient = allocated()
        if transient is not None and training:
            # Less the recomputed blocks' weight copies the timed steps kept to their end, which
            # all-resident steps never make; what the activations held before the peak is at
            # most the rest and the saved tensors.
            transient = max(0, transient - times.recompute_bytes) + saved_bytes
        need = model_bytes if transient is not None else model_bytes + saved_bytes
        skipped = None
        if resident is not None or fits_resident(need, device, transient):
            try:
                with stage(stages, "resident_steps"):
                    run = pipelined_step_ns(streamed, clock, backend, loss_fn, executor=resident,
                                            kernels_ns=sum(times.compute_ns))
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                skipped = "they ran out of device memory"
        else:
            skipped = (f"{model_bytes / 1e9:.2f} GB of weights and "
                       + (f"{transient / 1e9:.2f} GB a step allocates" if transient is not None else
                          f"{saved_bytes / 1e9:.2f} GB of saved tensors") + " leave too little room")
        if skipped:
            log.warning("the all-resident steps are skipped: %s on %s (%s); the trace has no pipelined step and no "
                        "measured torch peak", skipped, device, _memory_note(device))
    finally:
        if resident is not None:
            resident.close()
    scale, host_scale, plain_factor = 1.0, 1.0, None
    pipelined = None
    if run.step_ns:
        pipelined = run.step_ns
        scale, host_scale = fit_to_pipelined(sum(times.compute_ns), sum(times.host_ns), pipelined, run.plain_ns)
        if run.plain_ns:
            plain_factor = fit_to_pipelined(sum(times.compute_ns), sum(times.host_ns), run.plain_ns)[1] / host_scale
        times.compute_ns = [round(c * scale) for c in times.compute_ns]
        times.host_ns = [round(h * host_scale) for h in times.host_ns]
    records = _records(streamed, times, training)
    module = type(streamed.module)
    rec = streamed.recording
    header = {
        "format": FORMAT, "version": VERSION, "records": len(records), "source": "recorded",
        "model": name, "num_layers": max(rec.layers, default=-1) + 1,
        "params": sum(p.numel() for p in streamed.module.parameters()), "workload": dict(workload or {}),
        "module": f"{module.__module__}.{module.__qualname__}", "grouping": streamed.grouping,
        "device": device_name(device), "device_memory_mb": device_memory_mb(device),
        "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "clock": "cuda events" if device.type == "cuda" else "perf_counter (cpu backend)",
        "timed_steps": steps.host, "held_steps": steps.held, "step_ns": sum(times.compute_ns),
        "pipelined_step_ns": pipelined, "compute_scale": round(scale, 6), "host_scale": round(host_scale, 6),
        # Every weight resident, offload binds them and drops the hooks: the host times of that forward.
        **({"plain_step_ns": run.plain_ns, "plain_host_factor": round(plain_factor, 6)}
           if plain_factor is not None else {}),
        # The saved tensors are the simulator's to count (kept or spilled): the rest of torch's peak is transient.
        **({"activation_peak_bytes": max(0, run.memory[0] - saved_bytes), "context_bytes": run.memory[1]}
           if run.memory is not None else {}),
        # What the order forward's tensors held at its peak (calibrate --modules: torch's workspace beside them).
        **({"traced_peak_bytes": seen_forward(streamed).traced_peak_bytes} if not training else {}),
        **({"host_syncs": list(run.syncs)} if run.syncs is not None else {}),
        **({"compute_slowdown_under_copy": round(run.slowdown, 4)} if run.slowdown is not None else {}),
        "block_records": True,  # a record is a block of many launches: the simulator starts it with the first
        "resident_bytes": streamed.resident_bytes, "buffer_bytes": streamed.buffer_bytes,
        "record_s": round(time.perf_counter() - t0, 3),
        "record_stages_s": stages,  # timing kernel by kernel, then the all-resident steps
        **(extra_header or {}),
    }
    trace = Trace(header=header, weight_sizes=dict(streamed.order.sizes), records=records)
    check_trace(trace)
    return trace
