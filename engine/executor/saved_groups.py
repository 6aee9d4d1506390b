"""The offloader's saved groups, on the device and off it, and the copies that
move them: the activation policy's decisions carried out (the table of answers
in engine/executor/offloader.py's docstring).

A group is the unit the policy is asked about and that moves: the storage span
of a base and its saved views, or one saved tensor. `SavedGroups` holds one
step's groups by name, the copies in flight per direction (capped: at the cap
the host finalizes the oldest inline), the logical bytes of saved groups on
the device, and what the step measured (`StepMeasures`, the stall timing events).
"""
from __future__ import annotations

import time
import warnings
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import ExecutorError
from engine.executor.copies import Copies, bytes_of
from engine.executor.pinned_pool import SlabPool
from engine.policy import Decision

Tensor = torch.Tensor


@dataclass(eq=False, slots=True)
class SavedGroup:
    """Saved tensors that share one storage span (the unit), asked about and moved as one."""

    name: str
    layer: int
    nbytes: int
    step: int
    device: Tensor | None  # the unit on the device (original or restored); None while off it
    unit_offset: int  # storage offset of the unit when it was saved (views are relative to it)
    shape: tuple[int, ...]  # the unit's, as it leaves the device (restores recreate it)
    stride: tuple[int, ...]
    dtype: torch.dtype
    dense: bool  # False: saved references get the unit itself (made contiguous if spilled)
    refs: int = 0
    unpacked: int = 0
    booked: bool = False  # the policy spilled it (a slab or, on a miss, host memory is booked)
    sent: bool = False  # its D2H is issued
    restored: bool = False
    released: bool = False
    waited: bool = True  # the compute stream has waited for its restore (or there was none)
    host: Tensor | None = None  # its bytes off the device: a slab's view, or unpinned memory
    slab: Any = None
    spill_done: Any = None
    restore_done: Any = None
    checksum: int | None = None


HOOKS = ("kernel", "pack", "unpack")  # a forward kernel or layer entered; a tensor saved; one unpacked


@dataclass
class StepMeasures:
    """What the offloader measured in a step (the policy counts its own decisions)."""

    weight_handles: int = 0
    held: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    finalize_wait_s: float = 0.0
    # The offloader's host time in its hooks, finalize waits left out: (calls, ns) per hook.
    hooks: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in HOOKS})
    saved_peak_bytes: int = 0
    vram_peak_bytes: int = 0


class SavedGroups:
    """One step's saved groups and their copies (module docstring); `new_step` starts the next."""

    def __init__(self, copies: Copies, slabs: SlabPool, act_cfg: Any):
        self.copies = copies
        self.slabs = slabs
        # Sync mode copies a layer's groups when its offload_group comes; watermark spills go at once.
        self.spill_by_group = act_cfg.mode == "sync"
        self.max_d2h = int(act_cfg.max_inflight_d2h)
        self.max_h2d = int(act_cfg.max_inflight_h2d)
        self.debug_checksums = bool(act_cfg.debug_checksums)
        self._warned_contiguous = False
        self.new_step()

    def new_step(self) -> None:
        """Forget the finished step's groups, copies and measures."""
        self.measures = StepMeasures()
        self.stalls: list = []  # (start, end) timing events around compute-stream waits on copies
        self.by_name: dict[str, SavedGroup] = {}
        self.unpacking: SavedGroup | None = None  # the group whose unpack the policy is answering
        self.device_bytes = 0
        self._booked: dict[int, list[SavedGroup]] = {}  # sync mode: booked groups by layer
        self._d2h: deque[SavedGroup] = deque()
        self._h2d: deque[SavedGroup] = deque()

    def add(self, g: SavedGroup) -> None:
        """A new group, on the device (before the policy hears of it)."""
        self.by_name[g.name] = g
        self._to_device(g.nbytes)

    @property
    def off_device_bytes(self) -> int:
        return sum(g.nbytes for g in self.by_name.values() if g.device is None and not g.released)

    def host_copy(self, name: str) -> Tensor:
        """The host bytes holding spilled group `name`, once its copy has landed."""
        g = self.by_name[name]
        if g.host is None or not g.sent:
            raise ExecutorError(f"{name} has no host copy (kept, not yet offloaded, or released)")
        self.copies.wait_host(g.spill_done)
        return g.host

    def use(self, g: SavedGroup) -> None:
        """Backward uses `g`: the compute stream waits for its restore (timed), once."""
        if g.waited:
            return
        self._stalled(self.copies.use(g.device, g.restore_done))
        g.waited = True
        if self.debug_checksums:
            self._verify(g)

    def synchronize(self) -> None:
        """Wait for every copy."""
        self.copies.synchronize()

    def carry_out(self, d: Decision) -> None:
        """Do what the policy decided (offloader docstring: the answers, carried out)."""
        a = d.action
        if a == "keep":
            return
        if a in ("spill", "miss"):
            g = self.by_name[d.target]
            self._book(g, d.detail if a == "spill" else None)
            if not self.spill_by_group:
                self._spill(g)
                self.leave_device(g)  # recorded on the spill stream: freed once the copy has read it
        elif a == "offload_group":
            for g in self._booked.get(d.detail, ()):
                if not g.sent and not g.released:
                    self._spill(g)
        elif a == "wait_offload":
            for g in self._booked.get(d.detail, ()):
                if not g.released and not g.restored and g.device is not None:
                    self._stalled(self.copies.wait(g.spill_done))  # later compute work runs after the D2H
                    self.leave_device(g)
        elif a == "restore":
            self._restore(self.by_name[d.target])
        elif a == "reload_group":
            for g in self._booked.get(d.detail, ()):
                if not g.released and not g.restored:
                    self._restore(g)
        elif a == "release":
            self._release(self.by_name[d.target])
        else:
            raise ExecutorError(f"activation decision {a!r} is not one the executor knows; "
                                "add it to engine/executor/saved_groups.py")

    def _book(self, g: SavedGroup, size_class: int | None) -> None:
        g.booked = True
        if size_class is None:
            g.host = torch.empty(g.nbytes, dtype=torch.uint8)  # a miss: unpinned host memory
        else:
            g.slab = self.slabs.take(size_class)
            g.host = g.slab.data[:g.nbytes]
        if self.spill_by_group:
            self._booked.setdefault(g.layer, []).append(g)

    def _spill(self, g: SavedGroup) -> None:
        if not g.dense:
            if not self._warned_contiguous:
                self._warned_contiguous = True
                warnings.warn(
                    f"saved tensor {g.name} (layer {g.layer}) has no base to spill through and is not dense "
                    f"(shape {tuple(g.device.shape)}, stride {g.device.stride()}); it is made contiguous on "
                    "the compute stream before its spill, and backward gets the contiguous copy "
                    "(shown once per offloader)", stacklevel=2)
            g.device = g.device.contiguous()
            g.stride = g.device.stride()
        self._make_room(self._d2h, self.max_d2h)
        src = bytes_of(g.device)
        if self.debug_checksums:
            g.checksum = zlib.crc32(src.cpu().numpy())
        after = [g.slab.last_read] if g.slab is not None and g.slab.last_read is not None else []
        g.spill_done = self.copies.spill(g.host, src, after)
        g.sent = True
        self.measures.d2h_bytes += g.nbytes
        self._d2h.append(g)

    def _restore(self, g: SavedGroup) -> None:
        g.restored = True
        if g.device is not None:
            return  # a sync group whose offload was not waited yet: it never left
        self._make_room(self._h2d, self.max_h2d)
        g.device, g.restore_done = self.copies.restore(g.shape, g.stride, g.dtype, g.host, g.spill_done,
                                                        on_demand=g is self.unpacking)
        g.waited = False
        self.measures.h2d_bytes += g.nbytes
        self._to_device(g.nbytes)
        self._h2d.append(g)

    def _release(self, g: SavedGroup) -> None:
        g.released = True
        if g.slab is not None:
            self.slabs.give_back(g.slab, g.restore_done)
        g.slab = None
        g.host = None

    def _stalled(self, wait: tuple[Any, Any] | None) -> None:
        if wait is not None:
            self.stalls.append(wait)

    def leave_device(self, g: SavedGroup) -> None:
        g.device = None
        self.device_bytes -= g.nbytes

    def _to_device(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        m = self.measures
        m.saved_peak_bytes = max(m.saved_peak_bytes, self.device_bytes)

    def poll(self) -> None:
        """Forget copies that have completed (they no longer count against the caps)."""
        while self._d2h and self.copies.done(self._d2h[0].spill_done):
            self._d2h.popleft()
        while self._h2d and self.copies.done(self._h2d[0].restore_done):
            self._h2d.popleft()

    def _make_room(self, queue: deque, cap: int) -> None:
        """At the in-flight cap, finalize the oldest copy inline (the host waits for it)."""
        self.poll()
        while len(queue) >= cap:
            g = queue.popleft()
            start = time.perf_counter()
            self.copies.wait_host(g.spill_done if queue is self._d2h else g.restore_done)
            self.measures.finalize_wait_s += time.perf_counter() - start

    def _verify(self, g: SavedGroup) -> None:
        if g.checksum is None:
            return
        got = zlib.crc32(bytes_of(g.device).cpu().numpy())
        if got != g.checksum:
            raise ExecutorError(
                f"checksum mismatch for saved tensor {g.name} (layer {g.layer}): CRC32 {g.checksum:#010x} at "
                f"spill, {got:#010x} after restore; its host copy was corrupted between the two "
                "(a slab reused too early, or memory errors); rerun with activations.debug_checksums=true "
                "and report this")
