"""The runtime: carries out the weight policy's decisions on a backend.

`WeightExecutor` is a WeightSource: `fetch(i)` asks the policy about kernel i,
carries out its answers in order and returns K_i's weights as device tensors.

    evict w     -> the copy stream waits for the mark of w's last issued reader
                   (an event the compute stream recorded after that kernel),
                   then frees w's block: every allocation after it on the copy
                   stream may reuse the memory, and no reader can still see it
    fetch w     -> allocate |w| on the copy stream, copy host -> device there,
    prefetch w     record w's ready event
    hit w       -> nothing
    then        -> the compute stream waits on the ready events of K_i's
                   weights it has not waited on yet (no host synchronize)

Waiting for the victim's own last reader, not for every kernel issued so far,
lets the copy stream run as far ahead as the policy's decisions allow.

The executor logs every decision it carried out (`log`); for the same access
order and config it equals a bare `WeightResidency`'s log (decision parity).
"""
from __future__ import annotations

import logging
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from engine.errors import ExecutorError, PlacementError
from engine.gc_pause import paused_gc
from engine.executor.backend import Backend, Block
from engine.policy import KEEP_STEPS, AccessOrder, Decision, keep_last, keep_last_steps
from engine.policy.placement import place, residency

log = logging.getLogger(__name__)


@dataclass
class _Resident:
    block: Block
    tensor: torch.Tensor  # the weight's dtype and shape over block.data
    ready: Any  # event the copy recorded
    waited: bool = False  # the compute stream is already ordered after the copy


@dataclass
class StepStats:
    """One step's telemetry; `step_ms` is read from the backend's marks on demand."""

    step: int
    start: Any
    end: Any = None
    h2d_bytes: int = 0
    fetches: int = 0
    prefetches: int = 0
    hits: int = 0
    evictions: int = 0
    peak_device_bytes: int = 0  # pool used high-water during the step
    held_device_bytes: int = 0  # the device bytes the weights held at most (Backend.held_peak_bytes)
    peak_resident_bytes: int = 0  # logical bytes the policy held at most
    reserve_releases: int = 0  # pool refusals under the budget answered by releasing its unused reserve
    relocations: int = 0  # pool refusals under the budget that still refused after that: a relocation each
    relocated_bytes: int = 0  # resident bytes copied in again by those relocations
    kernels: int = 0  # kernels fetched so far in this step
    # With `timed=True`: (track, name, start mark, end mark) per kernel and weight copy.
    marks: list | None = None


def make_backend(name: str, capacity_bytes: int, largest_weight_bytes: int) -> Backend:
    """A backend whose pool holds `capacity_bytes` of weights (the CUDA pool adds
    a fragmentation slack, the vmm backend a conversion slack; the cpu backend's arena is exact).
    On a GPU the capacity must fit its free memory: size it by what the weights can hold
    (engine/policy/placement.py `held_bytes`), not by a budget over them."""
    if name == "cpu":
        from engine.executor.cpu import CpuBackend

        return CpuBackend(capacity_bytes)
    if name in ("cuda", "vmm"):
        from engine.executor.cuda import check_room

        check_room(capacity_bytes)
    if name == "cuda":
        from engine.executor.cuda import CudaBackend
        from engine.policy.placement import pool_slack_bytes

        return CudaBackend(capacity_bytes, pool_slack_bytes(largest_weight_bytes))
    if name == "vmm":
        from engine.executor.vmm import VmmBackend

        return VmmBackend(capacity_bytes, largest_weight_bytes)
    raise ExecutorError(f"weights.backend={name!r} is not one of cuda, vmm, cpu; pick one of those")


def host_registrar(name: str) -> Backend:
    """A backend of `name`'s kind that holds no weights, kept open for the host
    memory it registers (both CUDA backends register alike, through the pool's)."""
    return make_backend("cuda" if name == "vmm" else name, 0, 0)


def backend_granule(name: str) -> int:
    """The granule a backend of this name places blocks in (engine/policy/placement.py)."""
    if name == "vmm":
        from engine.executor.vmm import vmm_granule

        return vmm_granule()
    return 1


class WeightExecutor:
    """Streams weights through a capped pool as the residency policy decides.

    Run each forward inside `with executor.step():`; it holds a non-blocking
    lock, so a second concurrent forward (another thread) fails at once.
    `log`, `policy.log` and `steps` hold the last `keep_steps` steps (None: every
    step, for a bounded run that reads them all).
    """

    def __init__(self, order: AccessOrder, host: Mapping[str, torch.Tensor], *,
                 budget_bytes: int | None, eviction: str = "belady", lookahead: int = 2,
                 backend: str | Backend = "cuda", keep_steps: int | None = KEEP_STEPS):
        if keep_steps is not None and keep_steps < 1:
            raise ExecutorError(f"keep_steps={keep_steps}: keep at least 1 step of decisions (None keeps all)")
        # The policy first: a budget under the floor fails before any device memory is taken.
        granule = backend_granule(backend) if isinstance(backend, str) else backend.granule
        self.placement = place(order, budget_bytes, granule)
        self.policy = residency(self.placement, eviction, lookahead)
        self.order = order
        self.budget_bytes = budget_bytes
        _check_host(order, host)
        self.host = {w: host[w] for w in order.sizes}
        placed = self.placement.order.sizes
        if isinstance(backend, str):
            backend = make_backend(backend, self.placement.pool_bytes, max(order.sizes.values(), default=0))
        self.backend = backend
        self.backend.warm(list(placed.values()) + ([self.placement.resident_bytes] if self.placement.resident else []))
        self._reads = [tuple(dict.fromkeys(r)) for r in order.reads]
        self._resident: dict[str, _Resident] = {}
        self._resident_bytes = 0
        self._fixed, self._fixed_block = self._load_fixed()  # resident for the run (placement)
        self._next = 0
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._broken: str | None = None
        self._stats: StepStats | None = None
        self._marks: list[Any] = [None] * len(order)  # per position: compute passed that kernel
        self._last_reader: dict[str, int] = {}  # resident weight -> position of its last issued reader
        self._issued_any = False
        self._open_kernel: tuple[str, Any] | None = None  # timed steps: the kernel running and its start mark
        self.log: list[Decision] = []
        self.steps: list[StepStats] = []  # the last `keep_steps` (None: all), as the decision logs
        self.keep_steps = keep_steps
        self.time_steps = False  # steps run without `timed` mark their kernels and copies (step_timeline)
        self._steps_run = 0
        self._relocations = 0

    # -- the WeightSource protocol -------------------------------------------------

    def fetch(self, position: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """K_position's weights on the device, after carrying out the policy's answers.

        `names`, when given, are the weights the caller is about to read; they
        must be K_position's (else: schedule divergence)."""
        self._check_caller()
        if position != self._next:
            self._diverge(f"got {self._kernel(position)} (position {position})")
        if names is not None and set(names) != set(self._reads[position]):
            self._diverge(f"got weights {sorted(names)} for it, expected {sorted(self._reads[position])}")
        return self._issue(position)

    def fetch_next(self, kernel: str) -> dict[str, torch.Tensor]:
        """The next kernel's weights, for callers that know kernels by name (module hooks)."""
        self._check_caller()
        if kernel != self.order.kernels[self._next]:
            self._diverge(f"got kernel {kernel}")
        return self._issue(self._next)

    def hand_over(self) -> None:
        """The calling thread continues the running step: autograd runs a CUDA
        backward on its device thread while the thread that opened the step waits
        in backward(), and training fetches the backward's weights from there."""
        if self._owner is None:
            raise ExecutorError("hand_over outside a step; call it while `with executor.step():` runs")
        self._owner = threading.get_ident()

    # -- steps ---------------------------------------------------------------------

    @property
    def in_step(self) -> bool:
        """Whether a step (a forward) is running on this executor."""
        return self._lock.locked()

    @contextmanager
    def step(self, timed: bool | None = None, bound: bool = False) -> Iterator[StepStats]:
        """One forward: every kernel fetched once, in order. Records the step's telemetry;
        `timed` (default: `time_steps`) also marks each kernel and weight copy on the
        device (`step_timeline`). `bound`: a forward that fetches nothing, every weight
        fetched before and bound to the module (engine/modules/hooks.py KernelHooks.bound):
        each kernel counts as a hit, and a timed step is one compute span."""
        timed = self.time_steps if timed is None else timed
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise ExecutorError("step() inside a step of the same executor (a forward that calls itself?); "
                                    "finish one forward before starting the next")
            raise ExecutorError(
                "another forward is already running on this executor (concurrent execute from "
                "another thread); run forwards one at a time or give each thread its own executor")
        try:
            if self._broken:
                raise ExecutorError(f"this executor stopped after an earlier failure ({self._broken}); "
                                    "create a new one")
            self.backend.check_stream()
            self._owner = threading.get_ident()
            self.backend.reset_peak()
            if self.keep_steps is not None:
                keep_last_steps(self.log, self.keep_steps - 1)
                keep_last_steps(self.policy.log, self.keep_steps - 1)
                keep_last(self.steps, self.keep_steps - 1)
            stats = StepStats(step=self._steps_run, start=self.backend.timer(),
                              peak_resident_bytes=self._resident_bytes, marks=[] if timed else None)
            self._stats = stats
            try:
                with paused_gc():  # engine/gc_pause.py: a CLI process holds millions of objects
                    yield stats
                if bound:
                    stats.kernels = stats.hits = len(self.order)
                if stats.kernels != len(self.order):
                    self._diverge(f"the step ended after {stats.kernels} of {len(self.order)} kernels")
            except BaseException as err:
                self._broken = self._broken or f"{type(err).__name__}: {err}"
                raise
            stats.end = self.backend.timer()
            if timed and bound:
                stats.marks.append(("compute", "forward (every weight bound)", stats.start, stats.end))
            if timed and self._open_kernel is not None:
                stats.marks.append(("compute", *self._open_kernel, stats.end))
            self._open_kernel = None
            stats.peak_device_bytes = self.backend.peak_bytes()
            stats.held_device_bytes = self.backend.held_peak_bytes()
            self.steps.append(stats)
            self._steps_run += 1
        finally:
            self._stats = None
            self._owner = None
            self._lock.release()

    def step_timeline(self, step: int = -1) -> list[tuple[str, str, float, float]]:
        """A timed step's (track, name, start ms, end ms) from the step's start: each
        kernel on "compute" (from the wait for its weights to its last launch) and
        each weight copy on "h2d". Reading it waits for that step's end."""
        s = self.steps[step]
        if s.marks is None:
            raise ExecutorError("this step was not timed; run it as `with executor.step(timed=True):`")
        return [(track, name, self.backend.elapsed_ms(s.start, a), self.backend.elapsed_ms(s.start, b))
                for track, name, a, b in s.marks]

    def telemetry(self) -> list[dict]:
        """One dict per finished step (reading step_ms waits for that step's end)."""
        out = []
        for s in self.steps:
            out.append({
                "step": s.step,
                "step_ms": self.backend.elapsed_ms(s.start, s.end),
                "h2d_bytes": s.h2d_bytes,
                "fetches": s.fetches,
                "prefetches": s.prefetches,
                "hits": s.hits,
                "evictions": s.evictions,
                "peak_device_bytes": s.peak_device_bytes,
                "held_device_bytes": s.held_device_bytes,
                "peak_resident_bytes": s.peak_resident_bytes,
                "reserve_releases": s.reserve_releases,
                "relocations": s.relocations,
                "relocated_bytes": s.relocated_bytes,
            })
        return out

    # -- carrying out decisions ----------------------------------------------------

    def _issue(self, position: int) -> dict[str, torch.Tensor]:
        if self._stats.kernels == len(self.order):
            self._diverge(f"got a kernel past the end of the step ({self._kernel(position)})")
        marks = self._stats.marks
        try:
            if self._issued_any:  # the previous kernel's work is all enqueued now
                self._marks[(position - 1) % len(self.order)] = self.backend.mark()
            if marks is not None and self._open_kernel is not None:
                marks.append(("compute", *self._open_kernel, self.backend.timer()))
            self._issued_any = True
            for d in self.policy.issue(position):
                self._carry_out(d)
                self.log.append(d)
            out = {}
            for w in self._reads[position]:
                r = self._resident.get(w) or self._fixed.get(w)
                if r is None:
                    raise ExecutorError(f"policy bug: {w} is read by {self.order.kernels[position]} "
                                        "but was neither hit nor fetched")
                if not r.waited:
                    self.backend.wait_ready(r.ready)
                    r.waited = True
                self._last_reader[w] = position
                out[w] = r.tensor
            if marks is not None:
                self._open_kernel = (self.order.kernels[position], self.backend.timer())
        except BaseException as err:
            self._broken = self._broken or f"{type(err).__name__}: {err}"
            # The failed fetch's frames hold host tensors (views of the weight file's
            # mapping); cleared, they let the file close instead of hiding this error.
            traceback.clear_frames(err.__traceback__)
            raise
        self._next = (position + 1) % len(self.order)
        self._stats.kernels += 1
        return out

    def _carry_out(self, d: Decision) -> None:
        stats = self._stats
        w = d.target
        if d.action == "hit":
            stats.hits += 1
        elif d.action == "evict":
            r = self._resident.pop(w, None)
            if r is None:
                raise ExecutorError(f"policy bug: evict {w}, which is not resident")
            reader = self._last_reader.pop(w, None)  # None: never read, the copy stream's own order suffices
            self.backend.free_after(r.block, None if reader is None else self._marks[reader])
            self._resident_bytes -= r.block.nbytes
            stats.evictions += 1
        elif d.action in ("fetch", "prefetch"):
            if w in self._resident:
                raise ExecutorError(f"policy bug: {d.action} {w}, which is already resident")
            src = self.host[w]
            block = self._alloc(self.order.sizes[w], d.position)
            copy_start = self.backend.copy_timer() if stats.marks is not None else None
            try:
                ready = self.backend.copy_in(block, src)
            except BaseException:
                self.backend.free_after(block, None)  # not resident yet: close() would not free it
                raise
            if copy_start is not None:
                stats.marks.append(("h2d", w, copy_start, self.backend.copy_timer()))
            tensor = block.data.view(src.dtype).view(src.shape)
            self._resident[w] = _Resident(block, tensor, ready)
            self._resident_bytes += block.nbytes
            stats.peak_resident_bytes = max(stats.peak_resident_bytes, self._resident_bytes)
            stats.h2d_bytes += block.nbytes
            if d.action == "fetch":
                stats.fetches += 1
            else:
                stats.prefetches += 1
        else:
            raise ExecutorError(f"the policy answered {d.action} {w}; the executor never runs below "
                                "the floor (that is mode=simulate sim.allow_below_floor=true)")

    def _load_fixed(self) -> tuple[dict[str, _Resident], Block | None]:
        """The weights the placement keeps resident for the run, copied into one block."""
        p = self.placement
        if not p.resident:
            return {}, None
        block = self.backend.alloc(p.resident_bytes)
        fixed = {}
        for w, offset in p.resident.items():
            src = self.host[w]
            n = self.order.sizes[w]
            part = Block(block.address + offset, n, block.data[offset:offset + n])
            fixed[w] = _Resident(part, part.data.view(src.dtype).view(src.shape), self.backend.copy_in(part, src))
        return fixed, block

    def _alloc(self, nbytes: int, position: int) -> Block:
        """A block from the backend. A refusal the budget allows (fragmentation) is
        answered first by the pool releasing the reserve no live block uses (no weight
        moves), then by a relocation."""
        try:
            return self.backend.alloc(nbytes)
        except PlacementError:
            pass
        self.backend.defragment()
        self._stats.reserve_releases += 1
        try:
            return self.backend.alloc(nbytes)
        except PlacementError:
            pass
        self._relocate(position)
        return self.backend.alloc(nbytes)  # a refusal after relocating reaches the caller

    def _relocate(self, position: int) -> None:
        """The pool refused a block the budget allows: its free space is split.
        The resident blocks go back once the kernels issued so far are done, the
        backend releases its unused reserve, and those weights are copied in
        again, largest first (what packs best), before the refused allocation is
        retried. The weights of the kernel being issued and of the one before it
        stay where they are: as for eviction, tensors handed out for them may
        still be waiting for their kernel (autograd's backward takes a node's
        weights before it runs it). No earlier tensor is used again: each kernel
        fetches its weights, and a training step's autograd holds saved weight
        views as handles fetched again at their mirror (engine/executor/training.py).
        The policy's decisions are unchanged; the cost is one stall of the moved
        bytes over the H2D link, counted in the step's telemetry."""
        n = len(self.order)
        stay = set(self._reads[position]) | set(self._reads[(position - 1) % n])
        moved = sorted(((w, r) for w, r in self._resident.items() if w not in stay),
                       key=lambda item: item[1].block.nbytes, reverse=True)
        done = self.backend.mark()
        for w, _ in moved:
            del self._resident[w]  # a failure below leaves only blocks that exist for close() to free
        for _, r in moved:
            self.backend.free_after(r.block, done)
        for w, _ in moved:
            self._last_reader.pop(w, None)  # the new blocks have no reader yet
        self.backend.defragment()
        stats = self._stats
        stats.relocations += 1
        self._relocations += 1
        for w, r in moved:
            block = self.backend.alloc(r.block.nbytes)
            self._resident[w] = _Resident(block, block.data.view(r.tensor.dtype).view(r.tensor.shape),
                                          self.backend.copy_in(block, self.host[w]))
            stats.relocated_bytes += block.nbytes
        if self._relocations == 1:  # once per executor: telemetry counts every one
            log.warning("the weight pool relocated in step %d: its free space split into pieces too small for "
                        "a block the budget allows, so %.0f MB of resident weights were copied in again (a "
                        "stall the simulator does not predict; telemetry counts each as 'relocations'); the "
                        "vmm backend never relocates (weights.backend=vmm, or backend=\"vmm\")",
                        stats.step, stats.relocated_bytes / 1e6)

    # -- checks --------------------------------------------------------------------

    def _check_caller(self) -> None:
        if self._owner is None:
            raise ExecutorError("fetch outside a step; run the forward inside `with executor.step():`")
        if self._owner != threading.get_ident():
            raise ExecutorError("fetch from another thread while a forward runs (concurrent execute); "
                                "run forwards one at a time")
        if self._broken:
            raise ExecutorError(f"this executor stopped after an earlier failure ({self._broken}); "
                                "create a new one")

    def _kernel(self, position: int) -> str:
        if 0 <= position < len(self.order):
            return self.order.kernels[position]
        return f"<no kernel at {position}>"

    def _diverge(self, got: str) -> None:
        p = self._next
        message = (f"schedule divergence at kernel position {p}: expected {self.order.kernels[p]}, {got}; "
                   "the forward no longer follows the recorded access order: record it again "
                   "(handle.remove(), then offload() again; or a trace of this model and workload)")
        self._broken = message
        raise ExecutorError(message)

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the device, free every block and the pool."""
        if self._lock.locked() and self._owner is not None:
            raise ExecutorError("close() while a forward runs on this executor; wait for it to finish")
        self.backend.synchronize()
        refused = []  # a free the backend refuses (freed twice) must not keep the rest allocated
        for r in self._resident.values():
            try:
                self.backend.free_after(r.block, None)
            except ExecutorError as err:
                refused.append(err)
        self._resident.clear()
        self._last_reader.clear()
        self._resident_bytes = 0
        if self._fixed_block is not None:
            self.backend.free_after(self._fixed_block, None)
            self._fixed, self._fixed_block = {}, None
        self.host = {}  # the host views (a file mapping) may be closed after this
        leaked = self.backend.live_blocks()
        self.backend.close()  # frees leaked blocks with the pool
        if refused:
            raise refused[0]
        if leaked:
            raise ExecutorError(f"{leaked} pool blocks were still allocated after every resident weight was "
                                "freed: the runtime leaked them (a bug; freed with the pool now): report this")

    def __enter__(self) -> WeightExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_host(order: AccessOrder, host: Mapping[str, torch.Tensor]) -> None:
    for w, size in order.sizes.items():
        t = host.get(w)
        if t is None:
            raise ExecutorError(f"no host tensor for weight {w}; the weight source does not match the access order")
        nbytes = t.numel() * t.element_size()
        if nbytes != size:
            raise ExecutorError(f"weight {w} is {nbytes} bytes on the host but the access order says {size}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ExecutorError(f"weight {w}: host tensors must be contiguous CPU tensors (got {t.device}, "
                                f"contiguous={t.is_contiguous()})")
