"""Activation spill: which saved tensors leave the device in forward, where they
go, and when backward gets them back.

Watermark mode (Activation Stagehand's design). The policy counts the logical
device bytes of kept saved tensors. When a save takes them above the high
watermark, kept tensors are spilled oldest first (backward needs them last)
until the bytes are at or under the low watermark; the band between the two is
the hysteresis that keeps one save from triggering a spill each time. The new
tensor is a candidate like the others, but being the youngest it is spilled only
when every older one already is. Tensors under `min_tensor_bytes` are always
kept: their copies cost more in latency than they free.

Every spill takes a slab from a size-class pinned pool ("spill", detail = class
index) or, when no slab fits or all are busy, falls back to unpinned host memory
("miss", counted). Backward restores are predictive: backward unpacks in reverse
save order, so each unpack keeps the next `restore_lookahead` spilled tensors
ahead of it restored, and, with `restore_within_low_watermark`, restores further
ahead, in that order, while the saved bytes on the device stay at or under the
low watermark. Backward frees the last layers' tensors first, so the restores
of the oldest (spilled) ones start as soon as there is room for them instead
of a few tensors before their use, when the H2D link can no longer hide them;
these restores never lift the saved bytes over the low watermark, and stop
short of max_inflight_h2d.

MB here is 1e6 bytes, as for the budget.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engine.errors import ConfigError
from engine.policy import ActivationPolicy, Decision
from engine.units import MB



def mb_to_bytes(mb: float) -> int:
    return int(round(mb * MB))


class SizeClassPool:
    """Pinned host slabs in fixed size classes; the driver owns the memory,
    this object only books it, so both drivers book identically.

    A tensor takes the smallest class whose slab holds it exactly (no rounding
    to powers of two); when that class has no free slab it moves up a class.
    """

    def __init__(self, class_sizes_bytes: Sequence[int], slabs_per_class: Sequence[int]):
        _check_classes(list(class_sizes_bytes), list(slabs_per_class), "class_sizes_bytes")
        self.class_sizes_bytes = tuple(class_sizes_bytes)
        self.slabs_per_class = tuple(slabs_per_class)
        self._in_use = [0] * len(self.class_sizes_bytes)
        self.hits = 0
        self.misses = 0

    def acquire(self, nbytes: int) -> int | None:
        """The class index of the slab booked for `nbytes`, or None on a miss."""
        first = bisect.bisect_left(self.class_sizes_bytes, nbytes)
        for c in range(first, len(self.class_sizes_bytes)):
            if self._in_use[c] < self.slabs_per_class[c]:
                self._in_use[c] += 1
                self.hits += 1
                return c
        self.misses += 1
        return None

    def release(self, class_index: int) -> None:
        if self._in_use[class_index] == 0:
            raise ValueError(
                f"release of size class {class_index} with no slab in use: a slab was released twice")
        self._in_use[class_index] -= 1

    def in_use(self, class_index: int) -> int:
        return self._in_use[class_index]


def _check_classes(sizes: list[float], slabs: list[int], key: str) -> None:
    if not sizes:
        raise ConfigError(f"activations.pool.{key} is empty; give at least one size class, "
                          "e.g. activations/pool=stagehand")
    if len(sizes) != len(slabs):
        raise ConfigError(
            f"activations.pool.{key} has {len(sizes)} classes but slabs_per_class has "
            f"{len(slabs)}; give one slab count per class")
    if sizes[0] <= 0:
        raise ConfigError(f"activations.pool.{key}[0]={sizes[0]} is not positive; give sizes > 0")
    for a, b in zip(sizes, sizes[1:]):
        if b <= a:
            raise ConfigError(
                f"activations.pool.{key} must be strictly increasing ({a} then {b}); "
                "sort them and drop duplicates")
    for c, n in enumerate(slabs):
        if n < 1:
            raise ConfigError(
                f"activations.pool.slabs_per_class[{c}]={n}; each class needs at least 1 slab "
                "(drop the class instead)")


def validate_pool(pool_cfg: Any) -> None:
    if getattr(pool_cfg, "exact", False):
        if list(pool_cfg.class_sizes_mb) or list(pool_cfg.slabs_per_class):
            raise ConfigError("activations.pool.exact=true sizes the pool from the step itself; drop "
                              "class_sizes_mb and slabs_per_class, or set activations.pool.exact=false")
        return
    _check_classes(list(pool_cfg.class_sizes_mb), list(pool_cfg.slabs_per_class), "class_sizes_mb")


def validate_caps(act_cfg: Any) -> None:
    for key in ("max_inflight_d2h", "max_inflight_h2d"):
        if getattr(act_cfg, key) < 1:
            raise ConfigError(f"activations.{key}={getattr(act_cfg, key)}; at least 1 copy must be "
                              "allowed in flight")
    if act_cfg.restore_lookahead < 0:
        raise ConfigError(f"activations.restore_lookahead={act_cfg.restore_lookahead} is negative; "
                          "use 0 (restore on demand only) or more")
    if act_cfg.min_tensor_bytes < 0:
        raise ConfigError(f"activations.min_tensor_bytes={act_cfg.min_tensor_bytes} is negative; "
                          "use 0 (every tensor may spill) or more")


def validate_watermarks(act_cfg: Any) -> None:
    """Raises ConfigError, one line naming the problem and the fix."""
    high, low = act_cfg.high_watermark_mb, act_cfg.low_watermark_mb
    for key, value in (("high_watermark_mb", high), ("low_watermark_mb", low)):
        if value < 0:
            raise ConfigError(f"activations.{key}={value} is negative; give MB of device memory (>= 0)")
    if low > high:
        raise ConfigError(
            f"activations.low_watermark_mb={low} is above high_watermark_mb={high}; "
            "the low watermark must be at or under the high one")
    validate_pool(act_cfg.pool)
    validate_caps(act_cfg)


@dataclass
class StepCounters:
    """What one step's activation policy did; `pool_*` count this step's spills."""

    saved: int = 0
    kept: int = 0  # saved tensors never spilled in the step
    spilled: int = 0  # pool hits and misses alike
    restored: int = 0
    spill_bytes: int = 0
    restore_bytes: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    peak_device_bytes: int = 0  # logical bytes of saved tensors on the device


@dataclass
class SavedRecord:
    name: str
    nbytes: int
    layer: int
    index: int  # save order within the step
    spilled: bool = False
    slab: int | None = None  # size class of its slab; None: kept, or a miss
    on_device: bool = True
    restored: bool = False


class SavedTensors:
    """Bookkeeping both activation policies share: records, the pool, the
    per-step counters and the decision log."""

    def __init__(self, act_cfg: Any):
        self.min_tensor_bytes = int(act_cfg.min_tensor_bytes)
        pool = act_cfg.pool
        if getattr(pool, "exact", False):
            raise ConfigError("activations.pool.exact=true but the pool was never sized for the step; the CLI "
                              "sizes it from the trace, a script calls engine.policy.pool_sizing.exact_pool")
        self.pool: SizeClassPool | None = None
        if list(pool.class_sizes_mb) or list(pool.slabs_per_class):
            validate_pool(pool)  # half a pool is a mistake, not "no pool"
            self.pool = SizeClassPool([mb_to_bytes(s) for s in pool.class_sizes_mb],
                                      list(pool.slabs_per_class))
        self.records: dict[str, SavedRecord] = {}
        self.device_bytes = 0
        self.step = 0
        self.counters = StepCounters()
        self.history: list[StepCounters] = []
        self.log: list[Decision] = []

    def save(self, tensor: str, nbytes: int, layer: int) -> SavedRecord:
        if tensor in self.records:
            raise ValueError(f"tensor {tensor!r} saved twice in step {self.step}; the driver "
                             "must save views through their base and duplicates once")
        rec = SavedRecord(tensor, nbytes, layer, self.counters.saved)
        self.records[tensor] = rec
        self.counters.saved += 1
        self.counters.kept += 1
        self._to_device(nbytes)
        return rec

    def spill(self, rec: SavedRecord, position: int, leaves_device: bool) -> Decision:
        """Book a slab for `rec`; `leaves_device`: its device bytes are free now
        (watermark) rather than when its group's offload is waited (sync)."""
        rec.spilled = True
        c = self.counters
        c.kept -= 1
        c.spilled += 1
        c.spill_bytes += rec.nbytes
        if leaves_device:
            self.leave_device(rec)
        rec.slab = self.pool.acquire(rec.nbytes) if self.pool is not None else None
        if rec.slab is None:
            c.pool_misses += 1
            return self.decide(position, "miss", rec.name)
        c.pool_hits += 1
        return self.decide(position, "spill", rec.name, rec.slab)

    def restore(self, rec: SavedRecord, position: int) -> Decision:
        self.bring_back(rec)
        return self.decide(position, "restore", rec.name)

    def bring_back(self, rec: SavedRecord) -> None:
        """Count `rec` restored; a sync group's reload logs one decision for all."""
        rec.restored = True
        self.counters.restored += 1
        self.counters.restore_bytes += rec.nbytes
        if rec.on_device:
            return  # a sync group reloaded before its offload was waited never left
        self._to_device(rec.nbytes)
        rec.on_device = True

    def release(self, tensor: str, position: int) -> Decision:
        rec = self.records.pop(tensor)
        if rec.on_device:
            self.device_bytes -= rec.nbytes
        if rec.slab is not None:
            self.pool.release(rec.slab)
        return self.decide(position, "release", tensor)

    def leave_device(self, rec: SavedRecord) -> None:
        rec.on_device = False
        self.device_bytes -= rec.nbytes

    def record(self, tensor: str) -> SavedRecord:
        try:
            return self.records[tensor]
        except KeyError:
            raise ValueError(f"unpack of {tensor!r}, which is not saved in step {self.step} "
                             "(never saved, or unpacked twice)") from None

    def decide(self, position: int, action: str, target: str, detail: int = -1) -> Decision:
        d = Decision(self.step, position, action, target, detail)
        self.log.append(d)
        return d

    def end_step(self) -> None:
        if self.records:
            names = ", ".join(list(self.records)[:3])
            raise RuntimeError(
                f"step {self.step} ended with {len(self.records)} saved tensors never unpacked "
                f"({names}...); the driver must call on_unpack for every saved tensor")
        self.history.append(self.counters)
        self.counters = StepCounters()
        self.step += 1

    def _to_device(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.counters.peak_device_bytes = max(self.counters.peak_device_bytes, self.device_bytes)


class WatermarkPolicy:
    """ActivationPolicy of watermark mode (module docstring).

    Decision.position is the layer of the tensor (the driver's layer for
    on_layer_* questions); Decision.step counts on_step_end calls.
    """

    def __init__(self, act_cfg: Any):
        validate_watermarks(act_cfg)
        self.high_bytes = mb_to_bytes(act_cfg.high_watermark_mb)
        self.low_bytes = mb_to_bytes(act_cfg.low_watermark_mb)
        self.restore_lookahead = int(act_cfg.restore_lookahead)
        self.within_low = bool(act_cfg.restore_within_low_watermark)
        # Restores ahead stop short of the in-flight cap: past it the driver waits
        # inline for the oldest, whose spill may still be on its way out.
        self.max_ahead = max(self.restore_lookahead, int(act_cfg.max_inflight_h2d) - 1)
        self.saved = SavedTensors(act_cfg)
        self.log = self.saved.log
        self._candidates: dict[str, SavedRecord] = {}  # kept, spillable, in save order
        self._spilled: list[tuple[int, SavedRecord]] = []  # (save index, record), sorted
        # Backward's restores: _spilled[:_cursor + 1] are not restored yet (or unpacked
        # out of order); _ahead holds the restored ones not yet unpacked.
        self._cursor = -1
        self._ahead: set[str] = set()

    @property
    def counters(self) -> StepCounters:
        return self.saved.counters

    @property
    def history(self) -> list[StepCounters]:
        return self.saved.history

    def on_save(self, tensor: str, nbytes: int, layer: int) -> list[Decision]:
        s = self.saved
        rec = s.save(tensor, nbytes, layer)
        if nbytes >= s.min_tensor_bytes:
            self._candidates[tensor] = rec
        out: list[Decision] = []
        if s.device_bytes > self.high_bytes:
            while s.device_bytes > self.low_bytes and self._candidates:
                oldest = self._candidates.pop(next(iter(self._candidates)))
                out.append(s.spill(oldest, oldest.layer, leaves_device=True))
                bisect.insort(self._spilled, (oldest.index, oldest), key=lambda e: e[0])
            self._cursor = len(self._spilled) - 1
        if not rec.spilled:
            out.append(s.decide(layer, "keep", tensor))
        return out

    def on_layer_start(self, phase: str, layer: int) -> list[Decision]:
        return []

    def on_layer_end(self, phase: str, layer: int) -> list[Decision]:
        return []

    def on_unpack(self, tensor: str) -> list[Decision]:
        s = self.saved
        rec = s.record(tensor)
        out: list[Decision] = []
        if rec.spilled and not rec.restored:
            out.append(s.restore(rec, rec.layer))  # on demand: the driver measures the stall
        self._ahead.discard(tensor)
        # Room under the low watermark once this tensor is released.
        room = self.low_bytes - (s.device_bytes - (rec.nbytes if rec.on_device else 0))
        while self._cursor >= 0:
            ahead = self._spilled[self._cursor][1]
            if ahead.restored or ahead.name not in s.records:
                self._cursor -= 1  # restored on demand, or unpacked already
                continue
            if ahead.index > rec.index:
                break  # backward ran out of reverse order: this one comes back on demand
            n = len(self._ahead)
            if n >= self.restore_lookahead and not (self.within_low and ahead.nbytes <= room and n < self.max_ahead):
                break
            out.append(s.restore(ahead, ahead.layer))
            self._ahead.add(ahead.name)
            room -= ahead.nbytes
            self._cursor -= 1
        self._candidates.pop(tensor, None)
        out.append(s.release(tensor, rec.layer))
        return out

    def on_step_end(self) -> None:
        self.saved.end_step()
        self._candidates.clear()
        self._spilled.clear()
        self._ahead.clear()


def _build_watermark(act_cfg: Any, num_layers: int) -> ActivationPolicy:
    return WatermarkPolicy(act_cfg)


def _build_sync(act_cfg: Any, num_layers: int) -> ActivationPolicy:
    from engine.policy.sync import SyncDictPolicy  # sync.py builds on this module

    return SyncDictPolicy(act_cfg, num_layers)


ACTIVATION_POLICIES: dict[str, Callable[[Any, int], ActivationPolicy | None]] = {
    "off": lambda act_cfg, num_layers: None,
    "watermark": _build_watermark,
    "sync": _build_sync,
}


def build_activation_policy(act_cfg: Any, num_layers: int) -> ActivationPolicy | None:
    """The policy for `act_cfg.mode`; None when activations stay on the device."""
    try:
        build = ACTIVATION_POLICIES[act_cfg.mode]
    except KeyError:
        raise ConfigError(f"activations.mode={act_cfg.mode!r} is not one of "
                          f"{', '.join(ACTIVATION_POLICIES)}; pick one of those") from None
    return build(act_cfg, num_layers)
