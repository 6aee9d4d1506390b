"""Saved-tensor books both activation policies keep: the size-class pool's
bookings, the step's saved-tensor records, the step counters and the decision log.

The policies (activations.py: watermark, sync.py: sync dict) decide; this
module only books what they decide, so both book alike. MB here is 1e6
bytes, as for the budget.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

from engine.errors import ConfigError
from engine.policy import Decision, StepCounters
from engine.units import MB


@dataclass(frozen=True)
class SlabClasses:
    """A size-class pool as the policy books it (the shape of activations.pool)."""

    class_sizes_mb: Sequence[float]  # strictly increasing
    slabs_per_class: Sequence[int]  # one count per size


def mb_to_bytes(mb: float) -> int:
    """Config MB (1e6 bytes) as whole bytes."""
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
    """activations.pool (or SlabClasses): raises ConfigError naming the problem and the fix."""
    cap = getattr(pool_cfg, "max_mb", None)
    if cap is not None and cap <= 0:
        raise ConfigError(f"activations.pool.max_mb={cap}; give the pinned MB the pool may hold (> 0) or null")
    if getattr(pool_cfg, "exact", False):
        if list(pool_cfg.class_sizes_mb) or list(pool_cfg.slabs_per_class):
            raise ConfigError("activations.pool.exact=true sizes the pool from the step itself; drop "
                              "class_sizes_mb and slabs_per_class, or set activations.pool.exact=false")
        return
    _check_classes(list(pool_cfg.class_sizes_mb), list(pool_cfg.slabs_per_class), "class_sizes_mb")
    total = sum(s * n for s, n in zip(pool_cfg.class_sizes_mb, pool_cfg.slabs_per_class))
    if cap is not None and total > cap:
        raise ConfigError(f"activations.pool holds {total:.1f} MB of slabs, over activations.pool.max_mb={cap}; "
                          "drop slabs or use activations.pool.exact=true (sized under the cap)")


def validate_caps(act_cfg: Any) -> None:
    """The activations config's in-flight caps, restore lookahead and size threshold."""
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
    per-step counters and the decision log.

    `pool` is activations.pool or a SlabClasses (empty: every spill is a miss);
    tensors under `min_tensor_bytes` never spill.
    """

    def __init__(self, pool: Any, min_tensor_bytes: int):
        self.min_tensor_bytes = int(min_tensor_bytes)
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

    def unpacked(self, tensor: str) -> tuple[SavedRecord, list[Decision]]:
        """Backward unpacks `tensor`: its record, and its restore when it is still
        off the device (on demand: the driver measures the stall)."""
        rec = self._record(tensor)
        if rec.spilled and not rec.restored:
            return rec, [self.restore(rec, rec.layer)]
        return rec, []

    def _record(self, tensor: str) -> SavedRecord:
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


class SpillPolicy:
    """What both activation policies share: the books of the step's saved
    tensors (`saved`), the decision `log`, this step's `counters` and the
    finished steps' `history`."""

    def __init__(self, pool: Any, min_tensor_bytes: int):
        self.saved = SavedTensors(pool, min_tensor_bytes)
        self.log = self.saved.log

    @property
    def counters(self) -> StepCounters:
        return self.saved.counters

    @property
    def min_tensor_bytes(self) -> int:
        return self.saved.min_tensor_bytes

    @property
    def history(self) -> list[StepCounters]:
        return self.saved.history
