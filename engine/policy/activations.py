"""Activation spill: which saved tensors leave the device in forward, where they
go, and when backward gets them back.

Watermark mode (Activation Stagehand's design). The policy counts the logical
device bytes of kept saved tensors, those it is asked about: at least
`min_tensor_bytes` (the drivers hold smaller ones unasked,
engine/policy/schedule.py). When a save takes them above the high
watermark, kept tensors are spilled oldest first (backward needs them last)
until the bytes are at or under the low watermark; the band between the two is
the hysteresis that keeps one save from triggering a spill each time. The new
tensor is a candidate like the others, but being the youngest it is spilled only
when every older one already is. Tensors under `min_tensor_bytes` are always
kept: their copies cost more in latency than they free, and a real model saves
hundreds of them a step.

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
from typing import Any, Callable

from engine.errors import ConfigError
from engine.policy import ActivationPolicy, Decision
from engine.policy.saved import SavedRecord, SpillPolicy, mb_to_bytes, validate_caps, validate_pool
from engine.policy.sync import SyncDictPolicy


def validate_watermarks(act_cfg: Any) -> None:
    """The watermarks, the pool and the caps of watermark mode: raises ConfigError,
    one line naming the problem and the fix."""
    _check_watermarks(act_cfg)
    validate_pool(act_cfg.pool)
    validate_caps(act_cfg)


def _check_watermarks(act_cfg: Any) -> None:
    high, low = act_cfg.high_watermark_mb, act_cfg.low_watermark_mb
    for key, value in (("high_watermark_mb", high), ("low_watermark_mb", low)):
        if value < 0:
            raise ConfigError(f"activations.{key}={value} is negative; give MB of device memory (>= 0)")
    if low > high:
        raise ConfigError(
            f"activations.low_watermark_mb={low} is above high_watermark_mb={high}; "
            "the low watermark must be at or under the high one")


class WatermarkPolicy(SpillPolicy):
    """ActivationPolicy of watermark mode (module docstring).

    Decision.position is the layer of the tensor (the driver's layer for
    on_layer_* questions); Decision.step counts on_step_end calls. `pool`
    replaces act_cfg.pool (pool_sizing sizes one).
    """

    def __init__(self, act_cfg: Any, pool: Any = None):
        pool = act_cfg.pool if pool is None else pool
        _check_watermarks(act_cfg)
        validate_pool(pool)
        validate_caps(act_cfg)
        super().__init__(pool, act_cfg.min_tensor_bytes)
        self.high_bytes = mb_to_bytes(act_cfg.high_watermark_mb)
        self.low_bytes = mb_to_bytes(act_cfg.low_watermark_mb)
        self.restore_lookahead = int(act_cfg.restore_lookahead)
        self.within_low = bool(act_cfg.restore_within_low_watermark)
        # Restores ahead stop short of the in-flight cap: past it the driver waits
        # inline for the oldest, whose spill may still be on its way out.
        self.max_ahead = max(self.restore_lookahead, int(act_cfg.max_inflight_h2d) - 1)
        self._candidates: dict[str, SavedRecord] = {}  # kept, spillable, in save order
        self._spilled: list[tuple[int, SavedRecord]] = []  # (save index, record), sorted
        # Backward's restores: _spilled[:_cursor + 1] are not restored yet (or unpacked
        # out of order); _ahead holds the restored ones not yet unpacked.
        self._cursor = -1
        self._ahead: set[str] = set()

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
        rec, out = s.unpacked(tensor)
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


ACTIVATION_POLICIES: dict[str, Callable[[Any, int, Any], ActivationPolicy | None]] = {
    "off": lambda act_cfg, num_layers, pool: None,
    "watermark": lambda act_cfg, num_layers, pool: WatermarkPolicy(act_cfg, pool),
    "sync": SyncDictPolicy,
}


def build_activation_policy(act_cfg: Any, num_layers: int, pool: Any = None) -> ActivationPolicy | None:
    """The policy for `act_cfg.mode`; None when activations stay on the device.
    `pool` (a SlabClasses) replaces act_cfg.pool."""
    try:
        build = ACTIVATION_POLICIES[act_cfg.mode]
    except KeyError:
        raise ConfigError(f"activations.mode={act_cfg.mode!r} is not one of "
                          f"{', '.join(ACTIVATION_POLICIES)}; pick one of those") from None
    return build(act_cfg, num_layers, pool)
