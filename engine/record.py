"""mode=record: one step of a spec-built model, timed kernel by kernel, written as a trace.

What is measured, and how (CUDA events on the GPU; `HostClock` gives the same
path host timestamps for the host backend and CPU tests):

- **Kernels.** `KernelStamps` wraps the weight source that `engine.models.forward`
  fetches from once per spec kernel, before its math: it stamps the compute
  stream before and after each fetch. Kernel i ran from the stamp after fetch
  i to the stamp before fetch i+1; the time between the two stamps of one
  fetch is the compute stream waiting for that fetch's copies (the stall).
  Before each timed step the stream is held by a spin kernel while the host
  queues the step, so stamps measure the GPU, not gaps where the host was late.
  Per-kernel times are medians over `TIMED_STEPS` steps after `WARMUP_STEPS`.
- **Backward (LoRA training step).** Saved-tensor hooks log what each forward
  kernel saves (bytes of each distinct storage; frozen weights and adapters
  are weights, not activations) and stamp the stream when the backward first
  unpacks a kernel's tensors. The time from one such stamp to the next is
  split over the backward records it covers in proportion to their predicted
  times (ExecutionTimePredictor): autograd runs nodes, not spec kernels.
- **Host costs.** perf_counter around each kernel's host work (the forward's
  Python and launches) and around each fetch of a streamed forward.
- **Copies** (CUDA only). A streamed forward through the WeightExecutor at the
  configured budget: each weight copy is timed on the copy stream and kept in
  its kernel's record (`copies`). Probes: pinned H2D and D2H copies by size,
  both directions at once, pool allocation latency, and the recorded step's
  time while a stream of H2D copies runs beside it.

The trace header carries the probes and host figures under "probes" (see
PROBES_DOC); `engine.calibrate` fits a hardware profile from them.
"""
from __future__ import annotations

import logging
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from engine.errors import ExecutorError
from engine.models.spec import ModelSpec, SavedTensor
from engine.trace import (BACKWARD_FLOPS_FACTOR, BACKWARD_SUFFIX, FORMAT, VERSION, ExecutionTimePredictor,
                          KernelRecord, Trace, check_trace, write_trace)
from engine.units import MIB

log = logging.getLogger(__name__)

WARMUP_STEPS = 2
TIMED_STEPS = 5
# The compute stream is held while the host queues a step: for this many times
# the previous step's host time (the first step: FIRST_HOLD_NS), at an assumed
# 2 GHz (a slower clock only holds longer).
HOLD_FACTOR = 1.5
FIRST_HOLD_NS = 50_000_000
CYCLES_PER_NS = 2
PROBE_SIZES = (4096, 65536, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
PROBE_BYTES = 1 << 30  # per size and direction: enough repeats to average out event resolution
PROBE_REPEATS = 5

PROBES_DOC = """header["probes"] (recorded traces; all times in ns):
    copies      [{dir: "h2d"|"d2h", nbytes, ns}]  pinned copies of one size back to back, ns per copy
    duplex      [{h2d_bytes, d2h_bytes, ns}]     one copy each way started together, ns until both landed
    alloc_ns    [int]                            host time of one pool allocation
    compute_under_copy  {alone_ns, with_copy_ns} the recorded step alone and beside a stream of H2D copies
    host        {kernel_ns: [host ns per forward record, resident], resident_fetch_ns: median host ns
                 of one resident fetch, fetch: [[copies issued, host ns] per fetch of a streamed forward]}
    weight_source, weight_gbps                   where the streamed forward's weights came from, and
                                                 its copies' bytes over their copy-engine time"""


# ----------------------------------------------------------------- clocks

class HostClock:
    """Host timestamps: the timing path of the host backend (and CPU tests)."""

    device = torch.device("cpu")

    def stamp(self, stream: Any = None) -> int:
        return time.perf_counter_ns()

    def ns(self, start: int, end: int) -> int:
        return end - start

    def hold(self, ns: int) -> None:
        pass  # nothing queues on the host: there is no stream to hold

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


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


# ------------------------------------------------------- kernel stamps


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

    def fetch(self, i: int) -> Mapping[str, torch.Tensor]:
        t0 = time.perf_counter_ns()
        self.before.append(self.clock.stamp())
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

    def host_ns(self) -> list[int]:
        """Host time per kernel: its fetch, its math's Python and launches."""
        return [b - a for a, b in zip(self.host_start, self.host_start[1:] + [self.host_end])]


@dataclass
class SavedTensorLog:
    """Saved-tensor hooks: what each forward kernel saves, when the backward reaches it."""

    stamps: KernelStamps
    weight_ptrs: set[int]  # storages of frozen weights and adapters: weights, not activations
    saved: dict[int, list[int]] = field(default_factory=dict)  # kernel -> bytes of each new storage
    # (kernel, index in its saved list) -> the last kernel that saved that storage again (the
    # text context: block 0 saves it, every later block again); backward unpacks it first there.
    last_saver: dict[tuple[int, int], int] = field(default_factory=dict)
    first_unpack: dict[int, Any] = field(default_factory=dict)  # kernel -> stamp
    _seen: dict[int, tuple[int, int]] = field(default_factory=dict)

    def pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        i = self.stamps.current
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.weight_ptrs:
            return i, t
        first = self._seen.get(ptr)
        if first is None:  # views and duplicates once, under the kernel that saved them first
            saved = self.saved.setdefault(i, [])
            self._seen[ptr] = (i, len(saved))
            saved.append(storage.nbytes())
        elif i != first[0]:
            self.last_saver[first] = i
        return i, t

    def unpack(self, packed: tuple[int, torch.Tensor]) -> torch.Tensor:
        i, t = packed
        if i not in self.first_unpack:
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


# ---------------------------------------------------------------- steps


def _median(rows: Sequence[Sequence[int]]) -> list[int]:
    return [round(statistics.median(col)) for col in zip(*rows)]


@dataclass
class StepTiming:
    """One recorded step (medians over the timed steps)."""

    forward_ns: list[int]
    backward_ns: list[int] | None
    host_ns: list[int]
    saved: dict[int, list[int]]
    last_saver: dict[tuple[int, int], int]  # SavedTensorLog.last_saver
    step_ns: int
    fetch_ns: int  # median host time of one fetch from the (resident) source


def time_steps(spec: ModelSpec, source: Any, inputs: Mapping[str, torch.Tensor], clock: Clock, *,
               lora: Mapping[str, torch.Tensor] | None = None, warmup: int = WARMUP_STEPS,
               steps: int = TIMED_STEPS, beside: Callable[[], None] | None = None,
               hold_ns: int = FIRST_HOLD_NS) -> StepTiming:
    """Time `steps` forwards (training: forward + backward when `lora` is given) of `spec`.

    `beside`, if given, runs as each step starts (after the hold): work to run
    beside the step, e.g. copies on a side stream."""
    from engine.models import forward

    training = lora is not None
    predictor_weights = _backward_weights(spec) if training else None
    weight_ptrs = set()
    if training:
        weight_ptrs = {t.untyped_storage().data_ptr() for t in lora.values()}
        weight_ptrs |= {t.untyped_storage().data_ptr() for t in getattr(source, "weights", {}).values()}
    fwd_rows, bwd_rows, host_rows, step_rows, fetch_rows = [], [], [], [], []
    saved: dict[int, list[int]] = {}
    last_saver: dict[tuple[int, int], int] = {}
    for s in range(warmup + steps):
        clock.synchronize()
        clock.hold(hold_ns)
        host0 = time.perf_counter_ns()
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
                loss = sum(o.float().pow(2).mean() for o in out.values())
                bwd_start = clock.stamp()
                loss.backward()
            end = clock.stamp()
        else:
            with torch.no_grad():
                forward(spec, stamps, inputs)
            stamps.close()
            end = stamps.end
        hold_ns = round(HOLD_FACTOR * (time.perf_counter_ns() - host0))
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
            saved, last_saver = hooks.saved, hooks.last_saver
    return StepTiming(forward_ns=_median(fwd_rows), backward_ns=_median(bwd_rows) if training else None,
                      host_ns=_median(host_rows), saved=saved, last_saver=last_saver,
                      step_ns=_median(step_rows)[0],
                      fetch_ns=round(statistics.median(fetch_rows)))


def _backward_weights(spec: ModelSpec) -> list[float]:
    """Relative backward time of each kernel, from the spec's FLOPs and bytes on a nominal GPU."""
    from types import SimpleNamespace

    p = ExecutionTimePredictor(SimpleNamespace(matmul_tflops=700.0, hbm_gbps=3000.0))
    return [float(p.kernel_ns(k.op, BACKWARD_FLOPS_FACTOR * k.flops, BACKWARD_FLOPS_FACTOR * k.io_bytes))
            for k in spec.kernels]


def build_trace(spec: ModelSpec, timing: StepTiming, header: dict,
                copies: Mapping[int, list[dict]] | None = None) -> Trace:
    """The trace of a recorded step: forward records, then (training) the backward mirror."""
    copies = copies or {}
    training = timing.backward_ns is not None
    forward, backward = [], []
    for i, k in enumerate(spec.kernels):
        saved = tuple(SavedTensor(f"{k.name}/t{n}", nbytes, k.layer)
                      for n, nbytes in enumerate(timing.saved.get(i, ()))) if training else ()
        forward.append(KernelRecord(name=k.name, layer=k.layer, phase="fwd", weights=tuple(k.weights),
                                    compute_ns=timing.forward_ns[i], flops=k.flops, io_bytes=k.io_bytes,
                                    saved=saved, copies=tuple(copies.get(i, ()))))
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
                io_bytes=BACKWARD_FLOPS_FACTOR * k.io_bytes, needs=tuple(needs.get(i, ()))))
    records = tuple(forward + backward)
    trace = Trace(header={**header, "format": FORMAT, "version": VERSION, "records": len(records),
                          "source": "recorded"},
                  weight_sizes={n: w.nbytes for n, w in spec.weights.items()}, records=records)
    check_trace(trace)
    return trace


# ------------------------------------------------------------ copies


class TimedCopies:
    """A backend wrapper that times every weight copy on the copy stream and
    every pool allocation on the host; everything else goes to the backend."""

    def __init__(self, backend: Any, clock: Clock, position: Callable[[], int]):
        self.backend = backend
        self.clock = clock
        self.position = position
        self.stream = getattr(backend, "copy", None)
        self.copies: list[tuple[int, int, Any, Any]] = []  # (kernel, nbytes, start, end)
        self.alloc_ns: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def alloc(self, nbytes: int) -> Any:
        t0 = time.perf_counter_ns()
        block = self.backend.alloc(nbytes)
        self.alloc_ns.append(time.perf_counter_ns() - t0)
        return block

    def copy_in(self, block: Any, src: torch.Tensor) -> Any:
        start = self.clock.stamp(self.stream)
        ready = self.backend.copy_in(block, src)
        self.copies.append((self.position() + 1, block.nbytes, start, self.clock.stamp(self.stream)))
        return ready

    def by_kernel(self) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for k, nbytes, a, b in self.copies:
            out.setdefault(k, []).append({"dir": "h2d", "nbytes": nbytes, "ns": self.clock.ns(a, b)})
        return out


def streamed_forward(spec: ModelSpec, wf: Any, inputs: Mapping[str, torch.Tensor], cfg: Any, clock: Clock,
                     budget_bytes: int | None) -> tuple[dict[int, list[dict]], list[list[int]], list[int]]:
    """One cold forward through the executor (every weight copied at least once):
    the copies by kernel, [copies issued, host ns] per fetch, and allocation times."""
    from engine.executor.runtime import WeightExecutor, make_backend
    from engine.executor.sources import host_weights
    from engine.models import forward
    from engine.policy import AccessOrder

    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    w = cfg.weights
    capacity = budget_bytes if budget_bytes is not None else spec.model_bytes
    with ExitStack() as stack:
        backend = make_backend(w.backend, capacity, max(order.sizes.values(), default=0))
        stack.callback(backend.close)
        host = host_weights(wf, w.source, backend)
        stack.callback(host.close)
        stamps_box: list[KernelStamps] = []
        timed = TimedCopies(backend, clock, lambda: stamps_box[0].current)
        executor = WeightExecutor(order, host.tensors, budget_bytes=budget_bytes, eviction=w.eviction,
                                  lookahead=w.lookahead, backend=timed, keep_steps=None)
        stack.callback(executor.close)
        stamps = KernelStamps(executor, clock)
        stamps_box.append(stamps)
        with torch.no_grad(), executor.step():
            forward(spec, stamps, inputs)
        stamps.close()
        clock.synchronize()
        issued = [0] * len(spec.kernels)
        for d in executor.log:
            if d.action in ("fetch", "prefetch"):
                issued[d.position] += 1
        fetch = [[issued[i], ns] for i, ns in enumerate(stamps.host_fetch)]
        return timed.by_kernel(), fetch, timed.alloc_ns


# ------------------------------------------------------------- probes (CUDA)


def _events_ns(fn: Callable[[], None], stream: torch.cuda.Stream) -> int:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return round(a.elapsed_time(b) * 1e6)


def probe_copies(device: torch.device) -> tuple[list[dict], list[dict]]:
    """Pinned copies by size each way (ns per copy, back to back), and both ways at once."""
    big = PROBE_SIZES[-1]
    host = torch.empty(big, dtype=torch.uint8, pin_memory=True).fill_(1)
    host2 = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(big, dtype=torch.uint8, device=device)
    dev2 = torch.empty(big, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    copies = []
    for size in PROBE_SIZES:
        reps = max(4, min(256, PROBE_BYTES // size))
        for direction, dst, src in (("h2d", dev2, host), ("d2h", host2, dev)):
            def run() -> None:
                with torch.cuda.stream(s1):
                    for _ in range(reps):
                        dst[:size].copy_(src[:size], non_blocking=True)
            run()
            ns = statistics.median(_events_ns(run, s1) for _ in range(PROBE_REPEATS))
            copies.append({"dir": direction, "nbytes": size, "ns": round(ns / reps)})
    duplex = []
    for _ in range(PROBE_REPEATS):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(s1)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            dev2.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev, non_blocking=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ends[0].record(s1)
        ends[1].record(s2)
        torch.cuda.synchronize(device)
        duplex.append({"h2d_bytes": big, "d2h_bytes": big,
                       "ns": round(max(start.elapsed_time(e) for e in ends) * 1e6)})
    return copies, duplex


def copy_stream_beside(alone_ns: int, device: torch.device) -> Callable[[], None]:
    """For time_steps(beside=...): H2D copies on a side stream from the step's start,
    enough to outlast it at ~60 GB/s with margin."""
    chunk = 256 * MIB
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    n = max(4, int(alone_ns * 60 * 1.5 / chunk) + 1)

    def start() -> None:
        side.wait_stream(torch.cuda.current_stream(device))  # not during the hold
        with torch.cuda.stream(side):
            for _ in range(n):
                dev.copy_(host, non_blocking=True)
    return start


# ------------------------------------------------------------------ record


def _device(backend: str) -> torch.device:
    if backend == "host":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ExecutorError("mode=record needs a CUDA GPU and none is visible; predict without one with "
                            "mode=simulate (or weights.backend=host to exercise the recorder on the CPU)")
    return torch.device("cuda", torch.cuda.current_device())


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def record(cfg: Any, spec: ModelSpec, out_dir: str | Path) -> tuple[Path, Trace]:
    """Record one step of `spec` under cfg.workload; writes out_dir/trace.jsonl."""
    from engine.executor.execute import _weight_file
    from engine.units import budget_bytes
    from engine.models import make_inputs
    from engine.models.lora import init_lora
    from engine.models.run import DictSource
    from engine.weightfile import WeightFile

    device = _device(cfg.weights.backend)
    clock = clock_for(device)
    training = cfg.workload.kind == "train_lora"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        wf = WeightFile(_weight_file(cfg, spec, stack), spec)
        stack.callback(wf.close)
        weights = {n: t.to(device, copy=True) for n, t in wf.tensors().items()}
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1) if training else None
        source = DictSource(spec, weights)
        timing = time_steps(spec, source, inputs, clock, lora=lora)
        log.info("recorded %s: step %.3f ms", spec.name, timing.step_ns / 1e6)
        probes: dict[str, Any] = {"host": {"kernel_ns": timing.host_ns,
                                           "resident_fetch_ns": timing.fetch_ns}}
        if device.type == "cuda":
            beside = time_steps(spec, source, inputs, clock, lora=lora, warmup=1, steps=3,
                                beside=copy_stream_beside(timing.step_ns, device))
            probes["compute_under_copy"] = {"alone_ns": timing.step_ns, "with_copy_ns": beside.step_ns}
        del weights, source
        if device.type == "cuda":
            torch.cuda.empty_cache()
        budget = budget_bytes(cfg.budget)
        copies, fetch, alloc_ns = streamed_forward(spec, wf, inputs, cfg, clock, budget)
        probes["host"]["fetch"] = fetch
        probes["alloc_ns"] = alloc_ns
        probes["weight_source"] = cfg.weights.source
        copied = [c for cs in copies.values() for c in cs]
        probes["weight_gbps"] = (sum(c["nbytes"] for c in copied) / max(1, sum(c["ns"] for c in copied))
                                 if copied else None)
        if device.type == "cuda":
            probes["copies"], probes["duplex"] = probe_copies(device)
        header = {
            "model": spec.name, "num_layers": spec.num_layers, "workload": _plain(cfg.workload),
            "hardware": cfg.hardware.name, "device": _device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "clock": "cuda events" if device.type == "cuda" else "host perf_counter (host backend)",
            "timed_steps": TIMED_STEPS, "step_ns": timing.step_ns,
            "streamed": {"budget_bytes": budget, "eviction": cfg.weights.eviction,
                         "lookahead": cfg.weights.lookahead, "source": cfg.weights.source},
            "probes": probes,
        }
    trace = build_trace(spec, timing, header, copies)
    path = out_dir / "trace.jsonl"
    write_trace(path, trace)
    return path, trace


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (host backend)"
