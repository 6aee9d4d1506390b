"""The launcher: the simulated host thread that asks the policies and issues
copies and kernels ahead of the GPU.

For each kernel, in launch order, it asks exactly the questions the executor
asks, in the same order: the activation questions in the order of
engine/policy/schedule.py's StepSchedule, the weight policy's between the
layer boundary's and the kernel's unpacks:

1. at a layer boundary: activation policy on_layer_end (previous layer), then
   on_layer_start (this one);
2. weight policy issue(position): evict, fetch, prefetch, hit, hazard;
3. backward: on_unpack for each saved tensor the kernel needs;
4. launch the kernel (its recorded host_ns, else kernel_launch_us of host time);
5. forward: on_save for each tensor the kernel saves.

Host time: fetch_host_us per fetch/prefetch plus the pool's alloc_us (on the
vmm backend, also vmm_map_us, vmm_unmap_us, vmm_create_us and vmm_release_us
per driver call the chunk books make, engine/policy/chunks.py), and
per kernel its record's host_ns (a recorded module's block launches many
CUDA kernels) or, without one, kernel_launch_us. A weight allocation that must wait for a free
does not block the launcher: as in the executor's stream-ordered pool, the copy
waits in the copy engine's queue (gated) until the free, and behind every
eviction's last reader (the executor's copy stream waits for it to free). The
launcher blocks when an in-flight copy cap forces an inline finalize, and when a
record's launches would take CUDA's queue past launch_queue_depth launched but
unfinished operations (each record's recorded "launches", one where not counted),
and once after the first step, until it has run: the warm-up barrier every run has.
Under an activation policy the executor's saved-tensor hooks cost the host too:
offload_kernel_us per forward record, pack_hook_us per tensor autograd saves in it
(its "packs", else its saved tensors) and unpack_hook_us per unpack of them in its
backward mirror. A recorded module
whose forward synchronizes the host (header "host_syncs": the positions its host
reached only once every kernel launched before had run, e.g. a tensor made from a
Python list on the device) blocks there the same way, every step; so does a
synced loop (`synced`) at the end of every step, as a loop that reads each step's
output waits for its last kernel. A recorded
module's record is a block of many launches (header "block_records"): its GPU
work starts once the host has made the first launch (the record's host time over
its "launches", kernel_launch_us where they were not counted) and ends no sooner
than the host has issued the rest of it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Iterable, Iterator

import simpy

from engine.policy import ActivationPolicy, Decision, StepCounters, WeightPolicy, waits_for_step
from engine.policy.chunks import ChunkBooks, CountingDriver, conversion_slack
from engine.policy.placement import Placement
from engine.policy.schedule import Question, StepSchedule, ask
from engine.trace import Trace
from sim.activations import SavedActivations
from sim.compute import ComputeStream
from sim.link import H2D, Copy, PcieLink
from sim.pool import DevicePool

US = 1000  # ns


class SimFree:
    """A freed range's `freed` for the chunk books: passed once the free's last reader
    completed (or, never read, once its copy landed), which is what the executor's
    copy stream waits for. A wait (`synchronize`) is queued for the launcher, which
    blocks on it after the placement, as the executor's host does."""

    def __init__(self, done: simpy.Event | None, waits: list[simpy.Event]):
        self.done, self.waits = done, waits

    def query(self) -> bool:
        return self.done is None or self.done.triggered

    def synchronize(self) -> None:
        if not self.query():
            self.waits.append(self.done)


@dataclass(frozen=True)
class Hazard:
    """Below the floor: `weight` evicted while `kernel` may still read it."""

    step: int  # the reading kernel's step
    kernel: str
    weight: str
    evicted_by: str  # the kernel whose fetch needed the room
    time_ns: int  # when the launcher evicted it


@dataclass(eq=False)
class Launcher:
    """Runs `steps` steps of `trace` (run() is its SimPy process); `saved` carries
    out the activation policy's answers when the trace saves tensors."""

    env: simpy.Environment
    trace: Trace
    weights: WeightPolicy
    activations: ActivationPolicy | None
    link: PcieLink
    pool: DevicePool
    compute: ComputeStream
    hardware: Any
    weight_gbps: float
    steps: int
    log: Callable[[int, str, str], None]
    saved: SavedActivations | None = None
    decisions: list[Decision] = field(default_factory=list)
    hazards: list[Hazard] = field(default_factory=list)
    copies: list[tuple[int, str, Copy]] = field(default_factory=list)  # (step, direction, copy) as issued
    # When the launcher sat blocked on copies (an allocation waiting for a free, an
    # inline finalize): a GPU idle for want of a launch then is waiting on copies too.
    blocked: list[tuple[int, int]] = field(default_factory=list)
    host_work_ns: list[int] = field(default_factory=list)  # per step: the host's own work (launches, fetches)
    step: int = 0
    placement: Placement | None = None  # where the backend places weights (None: each at its own size)
    loop: str = "free"  # how the driver's host waits between steps (engine.policy.LOOPS, waits_for_step)

    def __post_init__(self) -> None:
        hw = self.hardware
        self.fetch_ns = round((hw.fetch_host_us + hw.alloc_us) * US)
        # The pool's bytes per weight: whole granules on the vmm backend, each
        # granule mapped (and later unmapped) by the host: vmm_map_us.
        p = self.placement
        self.placed = self.trace.weight_sizes if p is None else p.order.sizes
        # A backend of granules keeps the executor's chunk books; the host pays for
        # the granules they map and unmap (vmm_map_us, vmm_unmap_us).
        self.chunks = self.addresses = None
        self.waits: list[simpy.Event] = []  # frees the chunk books wait for before the launcher goes on
        if p is not None and p.granule > 1:
            self.chunks = ChunkBooks(CountingDriver(p.granule), self.pool.cap or sum(self.placed.values())
                                     + p.resident_bytes, 0, conversion_slack(max(self.placed.values(), default=0),
                                                                             p.granule))
            self.addresses: dict[str, int] = {}
            self.chunks.grow([*self.placed.values()] + ([p.resident_bytes] if p.resident else []))  # as warmed
            if p.resident:
                self.chunks.place(p.resident_bytes)
            self.call_ns = {"maps": hw.vmm_map_us * US, "unmaps": hw.vmm_unmap_us * US,
                            "creates": hw.vmm_create_us * US, "releases": hw.vmm_release_us * US}
        self.launch_ns = round(hw.kernel_launch_us * US)
        self.depth = int(hw.launch_queue_depth)
        records = self.trace.records
        launches = [max(1, r.launches) for r in records]
        self.queued = [0, *accumulate(launches)]  # launches before each position of a step, and the step's
        self.hooks_ns = self._hook_costs() if self.activations is not None else [0] * len(records)
        # Resident weights -> the copy that brought them in; the last issued kernel reading each.
        self.resident: dict[str, Copy] = {}
        self.last_reader: dict[str, int] = {}
        self.evicted_reader = -1  # the latest last reader of an evicted weight (_copy_gate)
        self._barrier: tuple[int, simpy.Event | None] | None = None  # (that reader, its completion)
        self.syncs = frozenset(self.trace.header.get("host_syncs") or ())
        self.blocks = bool(self.trace.header.get("block_records"))

    def _hook_costs(self) -> list[int]:
        """Host ns the offloader's hooks add to each record (module docstring)."""
        hw, records = self.hardware, self.trace.records
        forward = [r for r in records if r.phase == "fwd"]
        packs = [max(r.packs, len(r.saved)) for r in forward]
        out = [round((hw.offload_kernel_us + n * hw.pack_hook_us) * US) for n in packs]
        # Backward records mirror the forward's, in reverse.
        out += [round(n * hw.unpack_hook_us * US) for n in reversed(packs)][:len(records) - len(forward)]
        return out

    def _launched(self, seq: int) -> int:
        """Launches the host has made before kernel `seq` (all steps)."""
        n = len(self.trace.records)
        return seq // n * self.queued[-1] + self.queued[seq % n]

    def _queue_room(self, seq: int) -> simpy.Event | None:
        """What the host waits for before launching kernel `seq`: the completion that leaves
        CUDA's queue room for its launches (the queue empty, for a record of more launches
        than it holds), or None."""
        n = len(self.trace.records)
        over = self._launched(seq + 1) - self.depth  # launches that must have finished first
        if over <= self._launched(self.compute.completed):
            return None
        step, rest = divmod(over, self.queued[-1])
        first = step * n + bisect.bisect_left(self.queued, rest)  # the first kernel whose start is that far
        return self.compute.done_event(min(first, seq) - 1)

    def issued(self, direction: str, c: Copy) -> None:
        self.copies.append((self.step, direction, c))

    def step_counters(self, step: int) -> StepCounters:
        """What the activation policy did in `step` (no policy: every saved tensor stayed)."""
        if self.activations is None:
            return StepCounters.all_kept(sum(len(r.saved) for r in self.trace.records))
        return self.activations.history[step]

    def run(self) -> Iterator[simpy.Event]:
        records = self.trace.records
        n = len(records)
        env = self.env
        act = self.activations
        for step in range(self.steps):
            self.step = step
            self.host_work_ns.append(0)
            schedule = StepSchedule(act.min_tensor_bytes if act is not None else 0)
            for pos, rec in enumerate(records):
                seq = step * n + pos
                room = self._queue_room(seq)
                if room is not None:
                    yield room
                if pos in self.syncs and seq > 0:
                    done = self.compute.done_event(seq - 1)
                    if done is not None:
                        yield done
                self.log(env.now, "host", "start " + rec.name)
                deps: list[simpy.Event] = []
                boundary, unpacks, saves, held = schedule.kernel(rec)
                yield from self._ask(boundary, seq, deps)
                for d in self.weights.issue(pos):
                    self.decisions.append(d)
                    yield from self._weight(d)
                for w in rec.weights:
                    c = self.resident.get(w)
                    if c is None:
                        continue  # not resident: the policy reported the hazard
                    if c.done.callbacks is not None:
                        deps.append(c.done)
                    self.last_reader[w] = seq
                for q in unpacks:
                    if act is None:
                        self.saved.release(q[1], seq, deps)  # no policy: everything stayed on the device
                    else:
                        self.saved.unpacking = q[1]
                        yield from self._ask([q], seq, deps)
                        self.saved.unpacking = None
                for name in held:  # under min_tensor_bytes: held on the device, never asked about
                    self.saved.release(name, seq, deps)
                host_ns = (rec.host_ns or self.launch_ns) + self.hooks_ns[pos]
                self.host_work_ns[step] += host_ns
                if self.blocks:  # the block's first launch, then the rest of its host work
                    first = host_ns // rec.launches if rec.launches else min(self.launch_ns, host_ns)
                    yield env.timeout(first)
                    self.compute.launch(seq, rec, deps, env.now + host_ns - first)
                    yield env.timeout(host_ns - first)
                    self.log(env.now, "host", "end " + rec.name)
                else:
                    yield env.timeout(host_ns)
                    self.log(env.now, "host", "end " + rec.name)
                    self.compute.launch(seq, rec, deps)
                asked = iter(saves)
                for s in rec.saved:
                    self.saved.saved(s, seq)
                    if schedule.asks(s.nbytes):
                        yield from self._ask([next(asked)], seq, deps)
            yield from self._ask(schedule.end(), (step + 1) * n - 1, [])
            if self.saved is not None:
                self.saved.new_step()
            if waits_for_step(self.loop, step):  # the warm-up barrier; a synced loop's every step
                done = self.compute.done_event((step + 1) * n - 1)
                if done is not None:
                    yield done

    def _ask(self, questions: Iterable[Question], seq: int, deps: list[simpy.Event]):
        """Put `questions` to the activation policy (if any) and carry out its answers."""
        if self.activations is None:
            return
        for q in questions:
            for d in ask(self.activations, q):
                self.decisions.append(d)
                for finalize in self.saved.carry_out(d, seq, deps):
                    yield from self._blocked_on(finalize)

    def _blocked_on(self, event: simpy.Event):
        start = self.env.now
        yield event
        self.blocked.append((start, self.env.now))

    def _weight(self, d: Decision):
        a, w = d.action, d.target
        if a == "hit":
            return
        if a in ("fetch", "prefetch"):
            work = self.fetch_ns + self._place(w)
            self.host_work_ns[self.step] += work
            yield self.env.timeout(work)
            while self.waits:  # the chunk books waited for a free to pass
                yield from self._blocked_on(self.waits.pop(0))
            nbytes = self.trace.weight_sizes[w]
            # Stream-ordered allocation: the executor gets the block at once
            # (cudaMallocFromPoolAsync on the copy stream) and the copy waits on the
            # copy stream for the free; the launcher does not block.
            granted = self.pool.allocate(self.placed[w], w)
            if granted is not None:
                self.log(self.env.now, "host", "wait-alloc " + w)
            self.last_reader.pop(w, None)
            c = self.link.copy(H2D, w, nbytes, self.weight_gbps, gate=self._copy_gate(granted))
            self.resident[w] = c
            self.issued(H2D, c)
        elif a == "evict":
            self._evict(w)
        elif a == "hazard":
            records = self.trace.records
            self.hazards.append(Hazard(d.step, records[d.position].name, w, records[d.detail].name,
                                       self.env.now))
        else:
            raise ValueError(f"weight decision {a!r} is not one the simulator knows; add it to sim/launcher.py")

    def _place(self, w: str) -> int:
        """Host ns the chunk books' driver calls take to place `w` (0 without books)."""
        if self.chunks is None:
            return 0
        before = {k: getattr(self.chunks, k) for k in self.call_ns}
        self.addresses[w] = self.chunks.place(self.placed[w])
        return round(sum((getattr(self.chunks, k) - n) * self.call_ns[k] for k, n in before.items()))

    def _copy_gate(self, granted: simpy.Event | None) -> simpy.Event | None:
        """What the next weight copy waits for on the copy engine: every eviction's
        last reader so far. The executor frees a block by making its copy stream
        wait for the block's last reader, so every later copy on that stream waits
        too, whether or not it reuses those bytes. That also covers the
        allocation: every free it could wait for has happened by then (blocks
        never read free when their copy lands, ahead in the same queue)."""
        if self.evicted_reader < 0:
            return granted
        if self._barrier is None or self._barrier[0] != self.evicted_reader:
            self._barrier = (self.evicted_reader, self.compute.done_event(self.evicted_reader))
        return self._barrier[1] or granted

    def _evict(self, w: str) -> None:
        # Stream-ordered free: the bytes return to the pool only after the last
        # kernel that reads them has run (or, if none has, after the copy landed).
        c = self.resident.pop(w)
        nbytes = self.placed[w]
        reader = self.last_reader.pop(w, None)
        if self.chunks is not None:
            done = self.compute.done_event(reader) if reader is not None else c.done
            self.chunks.free(self.addresses.pop(w), SimFree(done, self.waits))
        if reader is not None:
            self.evicted_reader = max(self.evicted_reader, reader)
            self.compute.after(reader, lambda: self.pool.free(nbytes))
        elif c.done.callbacks is None:
            self.pool.free(nbytes)
        else:
            c.done.callbacks.append(lambda _ev: self.pool.free(nbytes))
