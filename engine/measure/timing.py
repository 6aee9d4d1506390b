"""Timing one step kernel by kernel (forward, and the LoRA backward), and the trace it makes."""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import torch

from engine.executor.offloader import held_as_is
from engine.models.lora import lora_loss
from engine.models import forward
from engine.measure.clocks import Clock
from engine.measure.launches import Census
from engine.models.spec import ModelSpec, SavedTensor
from engine.compute import BACKWARD_FLOPS_FACTOR, unblocked_sum
from engine.kernel_time import ExecutionTimePredictor, medians_by_op
from engine.trace import (BACKWARD_SUFFIX, FORMAT, VERSION, host_bound,
                          KernelRecord, Trace, check_trace)

WARMUP_STEPS = 2
TIMED_STEPS = 5
# The compute stream is held while the host queues a step: for this many times
# the previous step's host time (the first step: FIRST_HOLD_NS).
HOLD_FACTOR = 1.5
FIRST_HOLD_NS = 50_000_000


class KernelStamps:
    """A WeightSource wrapper: stamps around each fetch, host time of each kernel.

    One instance times one forward (plus, in training, its backward through
    `SavedTensorLog`). `close()` stamps the end of the last kernel."""

    def __init__(self, source: Any, clock: Clock):
        self.source = source
        self.clock = clock
        self.current = -1  # the kernel whose math runs now
        self.before: list[Any] = []  # stamp before fetch i: kernel i-1 ended
        self.after: list[Any] = []  # stamp after fetch i: kernel i starts
        self.host_start: list[int] = []  # perf_counter_ns at fetch i
        self.host_fetch: list[int] = []  # ns the host spent inside fetch i
        self.end: Any = None
        self.host_end = 0
        self.census: Census | None = None  # marks each kernel's start where launches are counted

    def fetch(self, i: int) -> Mapping[str, torch.Tensor]:
        t0 = time.perf_counter_ns()
        if self.census is not None:
            self.census.mark(i)
        self.before.append(self.clock.stamp())
        with self.census.fetch() if self.census is not None else nullcontext():
            out = self.source.fetch(i)
        self.after.append(self.clock.stamp())
        self.host_start.append(t0)
        self.host_fetch.append(time.perf_counter_ns() - t0)
        self.current = i
        return out

    def close(self) -> None:
        self.end = self.clock.stamp()
        self.host_end = time.perf_counter_ns()

    def compute_ns(self) -> list[int]:
        ends = self.before[1:] + [self.end]
        return [self.clock.ns(a, b) for a, b in zip(self.after, ends)]

    def stall_ns(self) -> list[int]:
        return [self.clock.ns(a, b) for a, b in zip(self.before, self.after)]

    def stall_ms(self) -> float:
        """The compute stream's waits on the fetched weights, all fetches together (read once
        the step ended)."""
        return sum(self.stall_ns()) / 1e6

    def host_ns(self) -> list[int]:
        """Host time per kernel: its fetch, its math's Python and launches."""
        return [b - a for a, b in zip(self.host_start, self.host_start[1:] + [self.host_end])]


class SavedStorages:
    """What each forward kernel saves for backward: each storage once, under the kernel that
    saved it first, unless the offloader would hold it as it is (a weight, an adapter, a
    tensor off `device`). `by_address` keys storages by their device address; off it (the
    meta device, where storages have none) by the storage itself."""

    def __init__(self, weights: set[int], device: torch.device, by_address: bool = True):
        self.weights = weights  # keys of the storages of frozen weights and adapters: not activations
        self.device = device
        self.by_address = by_address
        self.saved: dict[int, list[int]] = {}  # kernel -> bytes of each new storage
        # (kernel, index in its saved list) -> the last kernel that saved that storage again (the
        # text context: block 0 saves it, every later block again); backward unpacks it first there.
        self.last_saver: dict[tuple[int, int], int] = {}
        self.packs: dict[int, int] = {}  # kernel -> tensors autograd saved (hook calls)
        self._seen: dict[int, tuple[int, int]] = {}

    def key(self, storage: torch.UntypedStorage) -> int:
        return storage.data_ptr() if self.by_address else storage._cdata

    def note(self, i: int, t: torch.Tensor) -> None:
        """Log a tensor autograd saved while kernel `i` ran."""
        self.packs[i] = self.packs.get(i, 0) + 1
        storage = t.untyped_storage()
        key = self.key(storage)
        if key in self.weights or held_as_is(t, t._base if t._base is not None else t, self.device):
            return
        first = self._seen.get(key)
        if first is None:  # views and duplicates once, under the kernel that saved them first
            saved = self.saved.setdefault(i, [])
            self._seen[key] = (i, len(saved))
            saved.append(storage.nbytes())
        elif i != first[0]:
            self.last_saver[first] = i


class NotedTensors:
    """Saved-tensor hooks that log what is saved (SavedStorages.note, under the kernel
    `current()` names) and keep the tensor itself: a wrapper would make a cycle through
    the graph of any output the loss does not reach, keeping that graph (and the
    recording's host weights) alive."""

    def __init__(self, storages: SavedStorages, current: Callable[[], int]):
        self.storages = storages
        self.current = current

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages.note(self.current(), t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


class SavedTensorLog(SavedStorages):
    """Saved-tensor hooks: what each forward kernel saves, when the backward reaches it."""

    def __init__(self, stamps: KernelStamps, weight_ptrs: set[int]):
        super().__init__(weight_ptrs, stamps.clock.device)
        self.stamps = stamps
        self.first_unpack: dict[int, Any] = {}  # kernel -> stamp
        self.first_unpack_host: dict[int, int] = {}  # kernel -> perf_counter_ns

    def pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        """`note`, keeping the kernel for `unpack`'s marks. The pair holds the tensor: an
        output never unpacked (a branch the loss does not reach) keeps its graph alive."""
        self.note(self.stamps.current, t)
        return self.stamps.current, t

    def unpack(self, packed: tuple[int, torch.Tensor]) -> torch.Tensor:
        i, t = packed
        if i not in self.first_unpack:
            if self.stamps.census is not None:
                self.stamps.census.mark((BACKWARD_SUFFIX, i))
            self.first_unpack_host[i] = time.perf_counter_ns()
            self.first_unpack[i] = self.stamps.clock.stamp()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def split_backward(marks: Mapping[int, int], end_ns: int, n: int, weights: Sequence[float]) -> list[int]:
    """Backward time per forward kernel 0..n-1 from first-unpack times.

    `marks` maps a kernel to when the backward first unpacked its tensors (ns
    from the backward's start, which counts as kernel n-1's); the time from one
    mark to the next lower kernel's mark (or `end_ns`) is split over the
    kernels it covers in proportion to `weights` (predicted times; equal
    shares where those are all 0)."""
    starts = {**marks, n - 1: 0}
    cuts = sorted(starts, reverse=True)
    times, latest = [], 0
    for k in cuts:  # the backward runs in reverse order: keep the marks monotone
        latest = max(latest, starts[k])
        times.append(latest)
    out = [0] * n
    for j, k in enumerate(cuts):
        lower, t_next = (cuts[j + 1], times[j + 1]) if j + 1 < len(cuts) else (-1, max(end_ns, times[j]))
        span = t_next - times[j]
        covered = range(k, lower, -1)
        share = [weights[c] for c in covered]
        total = sum(share)
        if total <= 0:
            share, total = [1.0] * len(share), float(len(share))
        given = 0
        for c, w in zip(covered, share):
            out[c] = round(span * w / total)
            given += out[c]
        out[lower + 1] += span - given  # rounding: the covered kernels sum to the span exactly
    return out


def _median(rows: Sequence[Sequence[int]]) -> list[int]:
    return [round(statistics.median(col)) for col in zip(*rows)]


@dataclass
class StepTiming:
    """One recorded step (medians over the timed steps)."""

    forward_ns: list[int]
    backward_ns: list[int] | None
    host_ns: list[int]
    backward_host_ns: list[int] | None  # host time of each forward kernel's backward (training)
    saved: dict[int, list[int]]
    last_saver: dict[tuple[int, int], int]  # SavedTensorLog.last_saver
    step_ns: int
    fetch_ns: int  # median host time of one fetch from the (resident) source
    packs: dict[int, int] = field(default_factory=dict)  # SavedTensorLog.packs (training)
    # CUDA launches of each forward kernel, and of each kernel's backward (count_launches)
    launches: list[int] | None = None
    backward_launches: list[int] | None = None


def time_steps(spec: ModelSpec, source: Any, inputs: Mapping[str, torch.Tensor], clock: Clock, *,
               lora: Mapping[str, torch.Tensor] | None = None, warmup: int = WARMUP_STEPS,
               steps: int = TIMED_STEPS, beside: Callable[[], None] | None = None,
               hold_ns: int = FIRST_HOLD_NS) -> StepTiming:
    """Time `steps` forwards (training: forward + backward when `lora` is given) of `spec`.

    `beside`, if given, runs as each step starts (after the hold): work to run
    beside the step, e.g. copies on a side stream."""
    training = lora is not None
    predictor_weights = _backward_weights(spec) if training else None
    weight_ptrs = set()
    if training:
        weight_ptrs = {t.untyped_storage().data_ptr() for t in lora.values()}
        weight_ptrs |= {t.untyped_storage().data_ptr() for t in getattr(source, "weights", {}).values()}
    fwd_rows, bwd_rows, host_rows, bwd_host_rows, step_rows, fetch_rows = [], [], [], [], [], []
    saved: dict[int, list[int]] = {}
    last_saver: dict[tuple[int, int], int] = {}
    packs: dict[int, int] = {}
    for s in range(warmup + steps):
        clock.synchronize()
        clock.hold(hold_ns)
        stamps = KernelStamps(source, clock)
        start = clock.stamp()
        if beside is not None:
            beside()
        if training:
            for t in lora.values():
                t.grad = None
            hooks = SavedTensorLog(stamps, weight_ptrs)
            with hooks.hooks():
                out = forward(spec, stamps, inputs, lora)
                stamps.close()
                loss = lora_loss(out)
                bwd_start = clock.stamp()
                bwd_host0 = time.perf_counter_ns()
                loss.backward()
                bwd_host = time.perf_counter_ns() - bwd_host0
            end = clock.stamp()
            # The host's backward, split as the GPU's is below but at the host times of the
            # first unpacks: the launches autograd queues behind the held stream, kernel by kernel.
            host_marks = {k: t - bwd_host0 for k, t in hooks.first_unpack_host.items()}
            bwd_host_split = split_backward(host_marks, bwd_host, len(spec.kernels), predictor_weights)
        else:
            with torch.no_grad():
                forward(spec, stamps, inputs)
            stamps.close()
            end = stamps.end
        # The next hold covers this step's host work, not the time it sat blocked on a full
        # launch queue behind this hold (counting that would grow the hold every step).
        host_work = unblocked_sum(stamps.host_ns()) + (unblocked_sum(bwd_host_split) if training else 0)
        hold_ns = round(HOLD_FACTOR * host_work)
        clock.synchronize()
        if s < warmup:
            continue
        fwd_rows.append(stamps.compute_ns())
        host_rows.append(stamps.host_ns())
        fetch_rows.extend(stamps.host_fetch)
        step_rows.append([clock.ns(start, end)])
        if training:
            marks = {k: clock.ns(bwd_start, e) for k, e in hooks.first_unpack.items()}
            # The loss and its gradient sit between the forward's end and the backward's start.
            loss_ns = clock.ns(stamps.end, bwd_start)
            bwd = split_backward(marks, clock.ns(bwd_start, end), len(spec.kernels), predictor_weights)
            bwd[-1] += loss_ns
            bwd_rows.append(bwd)
            bwd_host_rows.append(bwd_host_split)
            saved, last_saver, packs = hooks.saved, hooks.last_saver, hooks.packs
    return StepTiming(forward_ns=_median(fwd_rows), backward_ns=_median(bwd_rows) if training else None,
                      host_ns=_median(host_rows), backward_host_ns=_median(bwd_host_rows) if training else None,
                      saved=saved, last_saver=last_saver,
                      step_ns=_median(step_rows)[0],
                      fetch_ns=round(statistics.median(fetch_rows)), packs=packs)


@dataclass(frozen=True)
class Launches:
    """count_launches: CUDA launches per forward kernel and (training) per kernel's backward;
    the tensors each forward kernel handed the saved-tensor hooks (SavedTensorLog.packs)."""

    forward: list[int]
    backward: list[int] | None
    packs: dict[int, int]


def count_launches(spec: ModelSpec, source: Any, inputs: Mapping[str, torch.Tensor], clock: Clock, *,
                   lora: Mapping[str, torch.Tensor] | None = None) -> Launches | None:
    """The CUDA launches of each forward kernel of one more step, and (training) of each
    kernel's backward: counted between the marks of engine/measure/launches.py, the
    backward's at each kernel's first unpack, split over the kernels between two marks
    in proportion to their forward launches. None off CUDA."""
    n = len(spec.kernels)
    with Census(clock.device.type == "cuda") as census:
        if not census.on:
            return None
        stamps = KernelStamps(source, clock)
        stamps.census = census
        hooks = SavedTensorLog(stamps, set())
        if lora is None:
            with torch.no_grad():
                forward(spec, stamps, inputs)
        else:
            for t in lora.values():  # lora_backward's step, with a mark between forward and loss
                t.grad = None
            with hooks.hooks():
                out = forward(spec, stamps, inputs, lora)
                census.mark((BACKWARD_SUFFIX, n - 1))  # the loss and the backward's start: the last kernel's
                lora_loss(out).backward()
        stamps.close()
    fwd = [census.counts.get(i, 0) for i in range(n)]
    if lora is None:
        return Launches(fwd, None, {})
    marks, total = {}, 0
    for key, count in census.counts.items():  # in the order the marks came
        if isinstance(key, tuple):
            marks[key[1]] = total
            total += count
    return Launches(fwd, split_backward(marks, total, n, [float(c) for c in fwd]), hooks.packs)


def _backward_weights(spec: ModelSpec) -> list[float]:
    """Relative backward time of each kernel, from the spec's FLOPs and bytes on a nominal GPU."""
    p = ExecutionTimePredictor(SimpleNamespace(matmul_tflops=700.0, hbm_gbps=3000.0))
    return [float(p.kernel_ns(k.op, BACKWARD_FLOPS_FACTOR * k.flops, BACKWARD_FLOPS_FACTOR * k.io_bytes))
            for k in spec.kernels]


def op_host_ns(spec: ModelSpec, kernel_host_ns: Sequence[int]) -> dict[str, int]:
    """The median host time of each op's kernels in the resident step (forward, or given
    the backward's host times, backward): what a record of that op costs the host.
    Medians, because the recorder's host sat blocked behind its held stream at some
    kernels (times far over the rest)."""
    return medians_by_op((k.op, ns) for k, ns in zip(spec.kernels, kernel_host_ns))


def host_scale(spec: ModelSpec, timing: StepTiming, pipelined_ns: int | None) -> float:
    """The factor on the recorded host times (their ops' medians, forward and backward)
    that fits them to the pipelined step (`probes.resident_steps`): `pipelined_scale`; 1
    where nothing was pipelined."""
    if pipelined_ns is None:
        return 1.0
    total = sum(_op_host_sum(spec, t) for t in (timing.host_ns, timing.backward_host_ns) if t is not None)
    return pipelined_scale(total, pipelined_ns, gpu_bound=not host_bound(timing.step_ns, pipelined_ns))


def pipelined_scale(host_ns: int, pipelined_ns: int, gpu_bound: bool) -> float:
    """The factor on `host_ns`, a recorded step's host times summed, from its pipelined step:
    where the host bounds that step, the factor that makes them its length (the executor's work
    per kernel and a host running unhindered by a held stream are in it, not in the times taken
    kernel by kernel); where the GPU does, at most the factor that makes them fit in it (back to
    back, a step's host work never outlasts the step; CUDA events stamped around a training
    step's kernels cost its host time, and a position that queues more launches than the device
    holds waits on the GPU). 1 without host times."""
    if not host_ns:
        return 1.0
    scale = pipelined_ns / host_ns
    return min(1.0, scale) if gpu_bound else scale


def _op_host_sum(spec: ModelSpec, kernel_host_ns: Sequence[int]) -> int:
    host = op_host_ns(spec, kernel_host_ns)
    return sum(host[k.op] for k in spec.kernels)


def build_trace(spec: ModelSpec, timing: StepTiming, header: dict,
                copies: Mapping[int, list[dict]] | None = None, scale: float = 1.0) -> Trace:
    """The trace of a recorded step: forward records, then (training) the backward mirror;
    each record's host time its op's median in its phase, times `scale` (host_scale)."""
    copies = copies or {}
    training = timing.backward_ns is not None
    forward, backward = [], []
    host = {op: round(ns * scale) for op, ns in op_host_ns(spec, timing.host_ns).items()}
    backward_host = ({op: round(ns * scale) for op, ns in op_host_ns(spec, timing.backward_host_ns).items()}
                     if training else {})
    for i, k in enumerate(spec.kernels):
        saved = tuple(SavedTensor(f"{k.name}/t{n}", nbytes, k.layer)
                      for n, nbytes in enumerate(timing.saved.get(i, ()))) if training else ()
        forward.append(KernelRecord(name=k.name, layer=k.layer, phase="fwd", weights=tuple(k.weights),
                                    compute_ns=timing.forward_ns[i], flops=k.flops, io_bytes=k.io_bytes,
                                    saved=saved, copies=tuple(copies.get(i, ())), host_ns=host.get(k.op, 0),
                                    op=k.op, shape=k.shape, passes=k.passes,
                                    launches=timing.launches[i] if timing.launches else 0,
                                    packs=timing.packs.get(i, 0)))
    if training:
        # A tensor is needed where backward first unpacks it: the mirror of its last saver.
        needs: dict[int, list[str]] = {}
        for i, f in enumerate(forward):
            for n, s in enumerate(f.saved):
                needs.setdefault(timing.last_saver.get((i, n), i), []).append(s.name)
        for i in reversed(range(len(spec.kernels))):
            k = spec.kernels[i]
            backward.append(KernelRecord(
                name=k.name + BACKWARD_SUFFIX, layer=k.layer, phase="bwd", weights=tuple(k.weights),
                compute_ns=timing.backward_ns[i], flops=BACKWARD_FLOPS_FACTOR * k.flops,
                io_bytes=BACKWARD_FLOPS_FACTOR * k.io_bytes, needs=tuple(needs.get(i, ())),
                host_ns=backward_host.get(k.op, 0), op=k.op, shape=k.shape,
                launches=timing.backward_launches[i] if timing.backward_launches else 0))
    records = tuple(forward + backward)
    trace = Trace(header={**header, "format": FORMAT, "version": VERSION, "records": len(records),
                          "source": "recorded"},
                  weight_sizes={n: w.nbytes for n, w in spec.weights.items()}, records=records)
    check_trace(trace)
    return trace
