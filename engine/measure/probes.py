"""What the copies cost: weight copies timed inside a streamed forward, and the
copy engine's own figures (mode=record's header "probes", PROBES_DOC)."""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from engine.executor.setup import forward_order, streamed_executor
from engine.executor.training import StreamedWeights, train_order, train_step
from engine.executor.vmm import CudaVmm
from engine.gc_pause import paused_gc
from engine.policy.chunks import CLASSES
from engine.models import forward
from engine.measure.clocks import CYCLES_PER_NS, Clock
from engine.measure.timing import KernelStamps
from engine.models.spec import ModelSpec
from engine.units import MIB

PROBE_SIZES = (4096, 65536, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
PROBE_BYTES = 1 << 30  # per size and direction: enough repeats to average out event resolution
PROBE_REPEATS = 5
COPY_HOLD_NS, COPY_HOLD_NS_PER_COPY = 1_000_000, 50_000  # the spin the host queues a size's copies behind
PIPELINED_WARMUP, PIPELINED_STEPS, PIPELINED_NS, PIPELINED_MAX = 5, 5, 3_000_000_000, 200
# The pipelined step: this quantile of the timed steps. A lent host's pace alternates between a
# fast and a slow phase lasting seconds, from outside the process (docs/DESIGN.md), and
# interference only slows it: the fast phase is the host's own.
PIPELINED_QUANTILE = 0.2
HOST_STEPS = 5  # forwards timing each kernel's host work on a held stream (HeldStreamHost)
# HeldStreamHost: kernels launched behind one hold; the hold, as a multiple of the host work
# of the group before it (the first group's: FIRST_HOLD_NS).
GROUP, HOLD_FACTOR, FIRST_HOLD_NS = 16, 2, 4_000_000
# The slowdown beside copies at the pipelined pace: BESIDE_ROUNDS rounds of BESIDE_STEPS steps
# alone, then as many beside H2D copies, so both see the same clocks (which sag under load).
BESIDE_ROUNDS, BESIDE_STEPS = 3, 3
BESIDE_GBPS = 50.0  # copies for this long a window at about the link's rate: it ends under them

PROBES_DOC = """header["probes"] (recorded traces; all times in ns):
    copies      [{dir: "h2d"|"d2h", nbytes, ns}]  pinned copies of one size back to back, queued behind a
                                                 held stream, ns per copy (recordings made before the hold:
                                                 their small sizes time the host issuing them)
    duplex      [{h2d_bytes, d2h_bytes, ns}]     one copy each way started together, ns until both landed
    alloc_ns    [int]                            host time of one pool allocation
    compute_under_copy  {alone_ns, with_copy_ns} the step alone and beside a stream of H2D copies: the
                 pipelined step, windows of each in turn (resident_steps), where every weight fits;
                 else the held step, first alone, then beside
    host        {kernel_ns: [host ns per forward record, resident: an inference's through the executor,
                 each kernel launched onto a held stream (resident_steps; kernel_stream "held"; without
                 it, recorded before that: onto an idle one); a training step's, or a
                 model that does not fit resident, between the stamped fetches], backward_kernel_ns:
                 [host ns of each forward record's backward] (training), resident_fetch_ns: median host ns of one
                 resident fetch, fetch: [[copies issued, host ns] per fetch of a streamed forward]}
    weight_source, weight_gbps                   where the streamed forward's weights came from, and
                                                 its copies' bytes over their copy-engine time
    vmm         {granule, map_ns, unmap_ns, create_ns, release_ns, by_class}  the vmm backend's
                                                 granule, and the host time of one map call (a
                                                 chunk, with its access call), unmap, create and
                                                 release, the means over the chunk sizes and per
                                                 size in granules: [map, unmap, create, release] ns
    compute     {linear: [[m, n, k, ns]], attention: [[bh, lq, lk, d, ns]], attention_masked: the same,
                 attention_train, attention_masked_train: [[bh, lq, lk, d, forward ns, backward ns]],
                 memory: [[bytes, ns]], passes}  each op alone over a grid of shapes
                                                 (engine/measure/compute.py)"""


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
    order = forward_order(spec)
    w = cfg.weights
    with ExitStack() as stack:
        stamps_box: list[KernelStamps] = []
        timed: list[TimedCopies] = []

        def wrap(backend: Any) -> TimedCopies:
            timed.append(TimedCopies(backend, clock, lambda: stamps_box[0].current))
            return timed[0]

        executor = streamed_executor(stack, wf, order, backend=w.backend, source=w.source,
                                     budget_bytes=budget_bytes, eviction=w.eviction, lookahead=w.lookahead,
                                     keep_steps=None, wrap=wrap)
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
        return timed[0].by_kernel(), fetch, timed[0].alloc_ns


class HeldStreamHost:
    """A WeightSource wrapper that times each kernel's host work (its fetch and its launches,
    perf_counter only) while its launches queue on a busy stream, as a pipelined step's do:
    every GROUP kernels it drains the device and holds the stream with a spin kernel as long
    as HOLD_FACTOR x the last group's host work, outside the timing. A free-running stream
    cannot time the host of a GPU-bound step (its host blocks on a full launch queue); CUDA
    events stamped around each kernel add their own host cost (about as much as a decode
    kernel's launches); and launches that each meet a drained, idle device read a GPU-bound
    model's host slow, which a table then prices a host-bound model at (docs/DESIGN.md). A
    group's launches (at most a few hundred) never fill the launch queue."""

    def __init__(self, source: Any, clock: Clock, group: int = GROUP):
        self.source = source
        self.clock = clock
        self.group = group
        self.work: list[int] = []
        self._started: int | None = None  # perf_counter_ns when the current kernel's fetch began
        self._hold_ns = FIRST_HOLD_NS

    def _close_kernel(self, now: int) -> None:
        if self._started is not None:
            self.work.append(now - self._started)

    def fetch(self, i: int) -> Mapping[str, torch.Tensor]:
        self._close_kernel(time.perf_counter_ns())
        if len(self.work) % self.group == 0:
            if self.work:
                self._hold_ns = HOLD_FACTOR * sum(self.work[-self.group:])
            self.clock.synchronize()
            self.clock.hold(self._hold_ns)
        self._started = time.perf_counter_ns()
        return self.source.fetch(i)

    def host_ns(self) -> list[int]:
        """Host ns per kernel of the step; call after the forward returned."""
        self._close_kernel(time.perf_counter_ns())
        self._started = None
        return self.work


@dataclass
class ResidentSteps:
    """What `resident_steps` measured."""

    step_ns: int  # the pipelined step (PIPELINED_QUANTILE of the timed steps)
    host_ns: list[int] | None  # inference: each kernel's host ns on a held stream (HeldStreamHost), medians
    # inference on CUDA: the pipelined step's median alone and beside H2D copies (alone_ns, with_copy_ns)
    under_copy: tuple[int, int] | None = None


def resident_steps(spec: ModelSpec, wf: Any, inputs: Mapping[str, torch.Tensor], cfg: Any, clock: Clock,
                   lora: Mapping[str, torch.Tensor] | None = None) -> ResidentSteps:
    """Steps through the executor with every weight resident (no budget, every fetch a hit).

    First the pipelined step: steps back to back with the stream running free, as
    mode=execute runs and times them (`lora`: a training step, its adapters updated as
    there); where the host bounds it, its length is the host's work, the executor's
    included. PIPELINED_WARMUP steps (the first copies the weights in, and the host's lead
    banked there carries a few steps), then at least PIPELINED_STEPS and until PIPELINED_NS
    of host time have passed (a decode step is a few ms; at most PIPELINED_MAX);
    PIPELINED_QUANTILE of them. Then, for an inference: on CUDA, the pipelined step
    alone and beside a stream of H2D copies (BESIDE_ROUNDS rounds of a window of each);
    and HOST_STEPS forwards whose kernels launch onto a held stream (HeldStreamHost):
    each kernel's median host time."""
    training = lora is not None
    order = forward_order(spec)
    w = cfg.weights
    with ExitStack() as stack:
        executor = streamed_executor(stack, wf, train_order(order) if training else order, backend=w.backend,
                                     source=w.source, budget_bytes=None, eviction="priority",
                                     lookahead=w.lookahead)
        streamed = StreamedWeights(executor, len(spec.kernels)) if training else None
        stamps = []
        timed_from = time.perf_counter_ns()
        while len(stamps) < PIPELINED_WARMUP + PIPELINED_STEPS or (
                time.perf_counter_ns() - timed_from < PIPELINED_NS and len(stamps) < PIPELINED_MAX):
            if len(stamps) == PIPELINED_WARMUP:
                timed_from = time.perf_counter_ns()
            start = clock.stamp()
            if training:
                train_step(spec, executor, streamed, None, inputs, lora, clock.device)
            else:
                with torch.no_grad(), executor.step():
                    forward(spec, executor, inputs)
            stamps.append((start, clock.stamp()))
        clock.synchronize()
        timed = sorted(clock.ns(a, b) for a, b in stamps[PIPELINED_WARMUP:])
        step_ns = timed[int(PIPELINED_QUANTILE * len(timed))]
        if training:
            return ResidentSteps(step_ns, None)

        def window() -> list[int]:
            marks = []
            for _ in range(BESIDE_STEPS):
                start = clock.stamp()
                with torch.no_grad(), executor.step():
                    forward(spec, executor, inputs)
                marks.append((start, clock.stamp()))
            clock.synchronize()  # the copies too
            return [clock.ns(a, b) for a, b in marks]

        under_copy = None
        if clock.device.type == "cuda":
            copies = copy_stream_beside(BESIDE_STEPS * step_ns, clock.device, BESIDE_GBPS)
            alone, beside = [], []
            for _ in range(BESIDE_ROUNDS):
                alone += window()
                copies()
                beside += window()
            under_copy = (round(statistics.median(alone)), round(statistics.median(beside)))
        rows = []
        for _ in range(HOST_STEPS):
            held = HeldStreamHost(executor, clock)
            with torch.no_grad(), executor.step(), paused_gc():
                forward(spec, held, inputs)
                rows.append(held.host_ns())
            clock.synchronize()
        return ResidentSteps(step_ns, [round(statistics.median(col)) for col in zip(*rows)], under_copy)


def _held_copies_ns(copy: Callable[[], None], reps: int, stream: torch.cuda.Stream) -> int:
    """ns of `reps` copies queued behind a spin kernel: the copy engine's own time, the host
    ahead of it as the executor's is of its prefetches (small copies issued one by one time
    the host's issue instead)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int((COPY_HOLD_NS + reps * COPY_HOLD_NS_PER_COPY) * CYCLES_PER_NS))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(reps):
            copy()
        b.record(stream)
    b.synchronize()
    return round(a.elapsed_time(b) * 1e6)


def probe_copies(device: torch.device) -> tuple[list[dict], list[dict]]:
    """Pinned copies by size each way (ns per copy, back to back, queued behind a held
    stream), and both ways at once."""
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
            def copy() -> None:
                dst[:size].copy_(src[:size], non_blocking=True)
            _held_copies_ns(copy, reps, s1)
            ns = statistics.median(_held_copies_ns(copy, reps, s1) for _ in range(PROBE_REPEATS))
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


VMM_REPEATS = 40


def probe_vmm(device: torch.device) -> dict:
    """The vmm backend's driver calls: host ns to map one chunk (cuMemMap, then
    cuMemSetAccess over it), to unmap it, to create it and to release it, for
    each chunk size of the chunk books, and their means over the sizes."""
    driver = CudaVmm(device)
    g = driver.granule
    address = driver.reserve(max(CLASSES) * g)
    by_class = {}
    try:
        for c in CLASSES:
            made = []
            for _ in range(VMM_REPEATS // 4):
                t0 = time.perf_counter_ns()
                made.append(driver.create(c * g))
                t1 = time.perf_counter_ns()
                made[-1] = (made[-1], t1 - t0)
            creates, releases = [t for _, t in made], []
            for chunk, _ in made[1:]:
                t0 = time.perf_counter_ns()
                driver.release(chunk)
                releases.append(time.perf_counter_ns() - t0)
            chunk = made[0][0]
            maps, unmaps = [], []
            for _ in range(VMM_REPEATS):
                t0 = time.perf_counter_ns()
                driver.map(address, chunk, c * g)
                driver.set_access(address, c * g)
                t1 = time.perf_counter_ns()
                driver.unmap(address, c * g)
                maps.append(t1 - t0)
                unmaps.append(time.perf_counter_ns() - t1)
            driver.release(chunk)
            by_class[c] = [round(statistics.median(v)) for v in (maps, unmaps, creates, releases)]
    finally:
        driver.free_range(address, max(CLASSES) * g)
    mean = [round(statistics.mean(v[i] for v in by_class.values())) for i in range(4)]
    return {"granule": g, "map_ns": mean[0], "unmap_ns": mean[1], "create_ns": mean[2], "release_ns": mean[3],
            "by_class": by_class}


def copy_stream_beside(alone_ns: int, device: torch.device, gbps: float = 90.0) -> Callable[[], None]:
    """H2D copies on a side stream from when the work queued so far has run (time_steps'
    beside=..., after the hold): `alone_ns` of them at `gbps` (the default outlasts a
    step at the link's rate)."""
    chunk = 256 * MIB
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    n = max(4, int(alone_ns * gbps / chunk) + 1)

    def start() -> None:
        side.wait_stream(torch.cuda.current_stream(device))  # not during the hold
        with torch.cuda.stream(side):
            for _ in range(n):
                dev.copy_(host, non_blocking=True)
    return start
