"""The host thread: asks the policies, issues copies and kernels ahead of the GPU.

For each kernel, in launch order, it asks exactly the questions the executor
asks, in the same order (the "one policy, two clocks" invariant):

1. at a layer boundary: activation policy on_layer_end (previous layer), then
   on_layer_start (this one);
2. weight policy issue(position): evict, fetch, prefetch, hit, hazard;
3. backward: on_unpack for each saved tensor the kernel needs;
4. launch the kernel (kernel_launch_us of host time);
5. forward: on_save for each tensor the kernel saves.

Host time: fetch_host_us per fetch/prefetch plus the pool's alloc_us, and
kernel_launch_us per kernel. A weight allocation that must wait for a free
does not block the host: as in the executor's stream-ordered pool, the copy
waits in the copy engine's queue (gated) until the free, and behind every
eviction's last reader (the executor's copy stream waits for it to free). The host blocks when an
in-flight copy cap forces an inline finalize, and when launch_queue_depth
kernels are launched but unfinished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import simpy

from engine.policy import ActivationPolicy, Decision, WeightPolicy
from engine.trace import Trace
from sim.activations import SavedActivations, StepCounts
from sim.compute import ComputeStream
from sim.link import H2D, Copy, PcieLink
from sim.pool import DevicePool

US = 1000  # ns


@dataclass(frozen=True)
class Hazard:
    """Below the floor: `weight` evicted while `kernel` may still read it."""

    step: int  # the reading kernel's step
    kernel: str
    weight: str
    evicted_by: str  # the kernel whose fetch needed the room
    time_ns: int  # when the host evicted it


class HostThread:
    def __init__(self, env: simpy.Environment, trace: Trace, weights: WeightPolicy,
                 activations: ActivationPolicy | None, link: PcieLink, pool: DevicePool,
                 compute: ComputeStream, saved: SavedActivations | None, hardware: Any,
                 weight_gbps: float, steps: int, log: Callable[[int, str, str], None]):
        self.env = env
        self.trace = trace
        self.weights = weights
        self.activations = activations
        self.link = link
        self.pool = pool
        self.compute = compute
        self.saved = saved
        self.weight_gbps = weight_gbps
        self.steps = steps
        self.log = log
        self.fetch_ns = round((hardware.fetch_host_us + hardware.alloc_us) * US)
        self.launch_ns = round(hardware.kernel_launch_us * US)
        self.depth = int(hardware.launch_queue_depth)
        self.decisions: list[Decision] = []
        self.hazards: list[Hazard] = []
        self.copies: list[tuple[int, str, Copy]] = []  # (step, direction, copy) as issued
        # When the host sat blocked on copies (an allocation waiting for a free, an
        # inline finalize): a GPU idle for want of a launch then is waiting on copies too.
        self.blocked: list[tuple[int, int]] = []
        self.step_counts: list[StepCounts] = []
        self.step = 0
        # Resident weights -> the copy that brought them in; the last issued kernel reading each.
        self.resident: dict[str, Copy] = {}
        self.last_reader: dict[str, int] = {}
        self.evicted_reader = -1  # the latest last reader of an evicted weight (_copy_gate)
        self._barrier: tuple[int, simpy.Event | None] | None = None  # (that reader, its completion)

    def issued(self, direction: str, c: Copy) -> None:
        self.copies.append((self.step, direction, c))

    def run(self):
        records = self.trace.records
        n = len(records)
        env = self.env
        act = self.activations
        for step in range(self.steps):
            self.step = step
            boundary: tuple[str, int] | None = None
            for pos, rec in enumerate(records):
                seq = step * n + pos
                if seq - self.compute.completed >= self.depth:
                    yield self.compute.slot(self.depth)
                self.log(env.now, "host", "start " + rec.name)
                deps: list[simpy.Event] = []
                if act is not None and boundary != (rec.phase, rec.layer):
                    if boundary is not None and boundary[1] >= 0:
                        yield from self._activation(act.on_layer_end(*boundary), seq, deps)
                    if rec.layer >= 0:
                        yield from self._activation(act.on_layer_start(rec.phase, rec.layer), seq, deps)
                    boundary = (rec.phase, rec.layer)
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
                for name in rec.needs:
                    if act is None:
                        self.saved.release(name, seq, deps)  # no policy: everything stayed on the device
                    else:
                        self.saved.unpacking = name
                        yield from self._activation(act.on_unpack(name), seq, deps)
                        self.saved.unpacking = None
                yield env.timeout(self.launch_ns)
                self.log(env.now, "host", "end " + rec.name)
                self.compute.launch(seq, rec, deps)
                for s in rec.saved:
                    self.saved.saved(s, seq)
                    if act is not None:
                        yield from self._activation(act.on_save(s.name, s.nbytes, s.layer), seq, deps)
            if act is not None:
                if boundary is not None and boundary[1] >= 0:
                    yield from self._activation(act.on_layer_end(*boundary), (step + 1) * n - 1, [])
                act.on_step_end()
            if self.saved is not None:
                self.step_counts.append(self.saved.new_step())

    def _activation(self, decisions: Decision | list[Decision], seq: int, deps: list[simpy.Event]):
        for d in decisions if isinstance(decisions, list) else (decisions,):
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
            yield self.env.timeout(self.fetch_ns)
            nbytes = self.trace.weight_sizes[w]
            # Stream-ordered allocation: the executor's host gets the block at once
            # (cudaMallocFromPoolAsync on the copy stream) and the copy waits on the
            # copy stream for the free; the host does not block.
            granted = self.pool.allocate(nbytes, w)
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
            raise ValueError(f"weight decision {a!r} is not one the simulator knows; add it to sim/host.py")

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
        nbytes = self.trace.weight_sizes[w]
        reader = self.last_reader.pop(w, None)
        if reader is not None:
            self.evicted_reader = max(self.evicted_reader, reader)
            self.compute.after(reader, lambda: self.pool.free(nbytes))
        elif c.done.callbacks is None:
            self.pool.free(nbytes)
        else:
            c.done.callbacks.append(lambda _ev: self.pool.free(nbytes))
