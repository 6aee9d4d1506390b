"""Saved activations on the simulated clock: carries out the activation policy.

The policy says keep, spill (into a pinned slab), miss (no slab: unpinned
host memory), restore, release, or, in sync-dict mode, offload / wait for /
reload a whole layer's group. This module turns those into copies on the
link and device bytes in the pool:

- a saved tensor's bytes count from the end of the kernel that produced it;
- a spill is a D2H copy that may start only after that kernel, and the
  device bytes drop when it lands;
- a restore is an H2D copy after the spill landed; device bytes rise when it
  starts; the backward kernel that needs the tensor waits for it; a restore
  of the tensor being unpacked (on demand) jumps the H2D queue, as the
  executor's own stream for those does;
- a release frees the device bytes once the backward kernel that read the
  tensor has completed (stream-ordered).

In-flight copies are capped per direction (max_inflight_d2h / _h2d): at the
cap the launcher finalizes the oldest inline, i.e. waits for it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import simpy

from engine.policy import Decision
from engine.models.spec import SavedTensor
from sim.compute import ComputeStream
from sim.link import ACTIVATIONS, D2H, H2D, Copy, PcieLink
from sim.pool import DevicePool


@dataclass(eq=False)
class _Saved:
    name: str
    nbytes: int
    layer: int
    producer: int  # kernel seq that saved it
    pinned: bool = True  # where its spill goes: a pinned slab, or unpinned memory (a miss)
    booked: bool = False  # the policy decided to spill it
    spill: Copy | None = None
    restore: Copy | None = None


class SavedActivations:
    """The step's saved tensors on the simulated device, and the copies that move them.

    `activations_cfg` is None when no policy runs: every tensor then stays on
    the device until backward has used it.
    """

    def __init__(self, env: simpy.Environment, link: PcieLink, pool: DevicePool,
                 compute: ComputeStream, hardware: Any, activations_cfg: Any | None,
                 issued: Callable[[str, Copy], None], log: Callable[[int, str, str], None]):
        self.env = env
        self.link = link
        self.pool = pool
        self.compute = compute
        self.pinned_d2h = float(hardware.d2h_gbps)
        self.pinned_h2d = float(hardware.h2d_gbps)
        self.pageable = float(hardware.pageable_gbps)
        if activations_cfg is not None:
            self.max_d2h = int(activations_cfg.max_inflight_d2h)
            self.max_h2d = int(activations_cfg.max_inflight_h2d)
        # Sync-dict mode copies a layer's group when the layer's forward ends
        # (offload_group), as TransformerEngine does; watermark spills go at once.
        self.spill_by_group = activations_cfg is not None and activations_cfg.mode == "sync"
        self.issued = issued  # tells the simulator about each copy, for per-step bytes
        self.log = log
        self.tensors: dict[str, _Saved] = {}
        self.by_layer: dict[int, list[_Saved]] = {}
        self.groups: dict[int, list[Copy]] = {}
        self.in_flight: dict[str, deque[Copy]] = {D2H: deque(), H2D: deque()}
        self.unpacking: str | None = None  # the tensor whose unpack the policy is answering

    def new_step(self) -> None:
        """Forget the finished step's layer groups."""
        self.by_layer = {}
        self.groups = {}

    def saved(self, tensor: SavedTensor, producer: int) -> None:
        """The forward kernel `producer` saves `tensor`: its bytes count once it has run."""
        t = _Saved(tensor.name, tensor.nbytes, tensor.layer, producer)
        self.tensors[t.name] = t
        self.by_layer.setdefault(t.layer, []).append(t)
        self.compute.after(producer, lambda: self.pool.add_activation(t.nbytes))

    def carry_out(self, d: Decision, seq: int, deps: list[simpy.Event]) -> Iterator[simpy.Event]:
        """Do what `d` says; yields events the launcher must wait for (inline finalize).

        `seq` is the kernel being issued; waits it must do before running are
        appended to `deps`. Group decisions carry the layer in `detail`.
        """
        a = d.action
        if a == "keep":
            return
        if a in ("spill", "miss"):
            t = self.tensors[d.target]
            t.booked, t.pinned = True, a == "spill"
            if not self.spill_by_group:
                yield from self._spill(t)
        elif a == "offload_group":
            copies = self.groups.setdefault(d.detail, [])
            for t in self.by_layer.get(d.detail, ()):
                if t.booked and t.spill is None:
                    yield from self._spill(t)
                    copies.append(t.spill)
        elif a == "wait_offload":
            deps.extend(c.done for c in self.groups.get(d.detail, ()))
        elif a == "restore":
            yield from self._restore(self.tensors[d.target], urgent=d.target == self.unpacking)
        elif a == "reload_group":
            for t in self.by_layer.get(d.detail, ()):
                if t.name in self.tensors:
                    yield from self._restore(t)
        elif a == "release":
            self.release(d.target, seq, deps)
        else:
            raise ValueError(f"activation decision {a!r} is not one the simulator knows; "
                             "add it to sim/activations.py")

    def _finalize_oldest(self, direction: str, cap: int) -> Iterator[simpy.Event]:
        q = self.in_flight[direction]
        while q and q[0].done.processed:
            q.popleft()
        while len(q) >= cap:
            oldest = q.popleft()
            self.log(self.env.now, "host", "finalize " + oldest.label)
            yield oldest.done

    def _spill(self, t: _Saved) -> Iterator[simpy.Event]:
        yield from self._finalize_oldest(D2H, self.max_d2h)
        gate = self.compute.done_event(t.producer)
        c = self.link.copy(D2H, "spill " + t.name, t.nbytes,
                           self.pinned_d2h if t.pinned else self.pageable, gate=gate, stream=ACTIVATIONS)
        t.spill = c

        c.done.callbacks.append(lambda _ev: self.pool.drop_activation(t.nbytes))
        self.in_flight[D2H].append(c)
        self.issued(D2H, c)

    def _restore(self, t: _Saved, urgent: bool = False) -> Iterator[simpy.Event]:
        if t.spill is None or t.restore is not None:
            return  # never left the device, or already coming back
        yield from self._finalize_oldest(H2D, self.max_h2d)
        spill_done = t.spill.done
        c = self.link.copy(H2D, "restore " + t.name, t.nbytes,
                           self.pinned_h2d if t.pinned else self.pageable,
                           gate=spill_done if spill_done.callbacks is not None else None,
                           on_start=lambda: self.pool.add_activation(t.nbytes), urgent=urgent,
                           stream=ACTIVATIONS)
        t.restore = c
        self.in_flight[H2D].append(c)
        self.issued(H2D, c)

    def release(self, name: str, seq: int, deps: list[simpy.Event]) -> None:
        """Backward kernel `seq` unpacks `name`; it is freed once that kernel has run."""
        t = self.tensors[name]
        if t.spill is not None and t.restore is None:
            raise RuntimeError(f"the activation policy released {t.name} for kernel seq {seq} without "
                               "restoring it after its spill; the backward would read host memory")
        if t.restore is not None:
            deps.append(t.restore.done)
        self.tensors.pop(t.name)

        # The consumer waited for the restore, so the tensor is on the device when it ends.
        self.compute.after(seq, lambda: self.pool.drop_activation(t.nbytes))
