"""Sync-dict activation offload, as TransformerEngine schedules it.

A sync dict maps a layer to four integers (a 4-int list in the config):

    {layer: (offload_fwd, offload_num, reload_fwd, reload_num)}

Our semantics, for a model of N layers (forward runs 0 → N-1, backward N-1 → 0):

- The saved tensors of `layer` are offloaded as one group. Its members are the
  first `offload_num` of the layer's saved tensors in save order, counting only
  those of at least `min_tensor_bytes` (-1: all of them); the rest stay.
- The group's D2H is issued when the forward of `layer` ends ("offload_group").
- It must have finished, and the device copies be freed, before the forward of
  layer `offload_fwd` starts ("wait_offload"); so layer < offload_fwd <= N-1.
- The group's H2D is issued when the backward of layer `reload_fwd` ends
  ("reload_group"). Backward runs N-1 → 0, so reload_fwd > layer gives the
  reload the backward of layers reload_fwd-1 .. layer+1 to land before the
  layer's own backward needs it; reload_fwd <= layer would reload too late.
- `reload_num` must equal `offload_num`: a group comes back whole.

`null` derives the dict from the number K of offloaded layers: layers 0..K-1,
layer i → (N-K+i, -1, N-K+i, -1).

A group member's on_save answer books a slab of the size-class pool as in
watermark mode ("spill", detail = class index; "miss": unpinned host memory,
and every member is a miss when no pool is configured), so a driver handles
both modes' spills alike; its D2H still waits for "offload_group".
"""
from __future__ import annotations

from typing import Any, Mapping

from engine.errors import ConfigError
from engine.policy import Decision
from engine.policy.saved import SavedRecord, SpillPolicy, validate_caps

SyncDict = dict[int, tuple[int, int, int, int]]


def derive_sync_dict(num_layers: int, num_offload_layers: int) -> SyncDict:
    """Offload the first K layers, each waited and reloaded K layers before the end."""
    n, k = num_layers, num_offload_layers
    if not 1 <= k < n:
        raise ConfigError(
            f"activations.num_offload_layers={k} must be in 1..{n - 1} for a model of {n} layers "
            "(the last layer's activations are needed first in backward, so it is never offloaded)")
    return {i: (n - k + i, -1, n - k + i, -1) for i in range(k)}


def validate_sync_dict(sync_dict: Mapping[Any, Any], num_layers: int) -> SyncDict:
    """Raises ConfigError naming the layer and the reason; returns the dict with
    int keys and 4-int tuples."""
    n = num_layers
    out: SyncDict = {}
    for key, value in sync_dict.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"activations.sync_dict key {key!r} is not a layer number") from None
        where = f"activations.sync_dict layer {layer}"
        if not 0 <= layer < n:
            raise ConfigError(f"{where}: outside 0..{n - 1} (the model has {n} layers)")
        values = list(value) if not isinstance(value, (str, bytes, int)) else [value]
        if len(values) != 4 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(
                f"{where}: needs 4 integers [offload_fwd, offload_num, reload_fwd, reload_num], "
                f"got {value!r}")
        offload_fwd, offload_num, reload_fwd, reload_num = values
        if not layer < offload_fwd <= n - 1:
            raise ConfigError(
                f"{where}: offload_fwd={offload_fwd} must be in {layer + 1}..{n - 1}: the offload "
                "can only finish after the layer's own forward, and before the last layer's")
        if offload_num != -1 and offload_num < 1:
            raise ConfigError(
                f"{where}: offload_num={offload_num}; use -1 (all saved tensors) or 1 or more")
        if not layer < reload_fwd <= n - 1:
            raise ConfigError(
                f"{where}: reload_fwd={reload_fwd} must be in {layer + 1}..{n - 1}: the reload is "
                "issued after that layer's backward, which must come before this layer's own "
                "backward needs it (too late otherwise)")
        if reload_num != offload_num:
            raise ConfigError(
                f"{where}: reload_num={reload_num} differs from offload_num={offload_num}; "
                "a group is reloaded whole, set them equal")
        out[layer] = (offload_fwd, offload_num, reload_fwd, reload_num)
    return out


class SyncDictPolicy(SpillPolicy):
    """ActivationPolicy of sync mode (module docstring).

    Decision.position is the tensor's layer for on_save/on_unpack answers and
    the driver's layer for on_layer_* answers; group decisions name the group
    as target "layer{L}" with detail L. `pool` replaces act_cfg.pool
    (pool_sizing sizes one).
    """

    def __init__(self, act_cfg: Any, num_layers: int, pool: Any = None):
        validate_caps(act_cfg)
        if act_cfg.sync_dict is None:
            sync_dict = derive_sync_dict(num_layers, act_cfg.num_offload_layers)
        else:
            sync_dict = act_cfg.sync_dict
        self.sync_dict = validate_sync_dict(sync_dict, num_layers)
        super().__init__(act_cfg.pool if pool is None else pool, act_cfg.min_tensor_bytes)
        self._groups: dict[int, list[SavedRecord]] = {layer: [] for layer in self.sync_dict}
        self._offloaded: set[int] = set()  # groups whose D2H is issued this step

    def on_save(self, tensor: str, nbytes: int, layer: int) -> list[Decision]:
        s = self.saved
        rec = s.save(tensor, nbytes, layer)
        if self._joins_group(rec):
            self._groups[layer].append(rec)
            # Stays on the device until its group's offload is waited.
            return [s.spill(rec, layer, leaves_device=False)]
        return [s.decide(layer, "keep", tensor)]

    def _joins_group(self, rec: SavedRecord) -> bool:
        if rec.layer not in self.sync_dict or rec.layer in self._offloaded:
            return False
        if rec.nbytes < self.saved.min_tensor_bytes:
            return False
        offload_num = self.sync_dict[rec.layer][1]
        return offload_num == -1 or len(self._groups[rec.layer]) < offload_num

    def on_layer_start(self, phase: str, layer: int) -> list[Decision]:
        if phase != "fwd":
            return []
        out: list[Decision] = []
        for group, (offload_fwd, *_rest) in sorted(self.sync_dict.items()):
            if offload_fwd != layer:
                continue
            if group not in self._offloaded:
                raise ValueError(
                    f"forward of layer {layer} starts before the forward of layer {group} ended; "
                    "the driver must call on_layer_end('fwd', L) after each layer")
            for rec in self._groups[group]:
                if rec.name in self.saved.records and rec.on_device:
                    self.saved.leave_device(rec)
            out.append(self.saved.decide(layer, "wait_offload", f"layer{group}", group))
        return out

    def on_layer_end(self, phase: str, layer: int) -> list[Decision]:
        if phase == "fwd":
            if layer not in self.sync_dict:
                return []
            self._offloaded.add(layer)
            return [self.saved.decide(layer, "offload_group", f"layer{layer}", layer)]
        out: list[Decision] = []
        for group, (_, _, reload_fwd, _) in sorted(self.sync_dict.items()):
            if reload_fwd != layer:
                continue
            for rec in self._groups[group]:
                if rec.name in self.saved.records and not rec.restored:
                    self.saved.bring_back(rec)
            out.append(self.saved.decide(layer, "reload_group", f"layer{group}", group))
        return out

    def on_unpack(self, tensor: str) -> list[Decision]:
        rec, out = self.saved.unpacked(tensor)  # a restore here: its group is not reloaded yet
        return out + [self.saved.release(tensor, rec.layer)]

    def on_step_end(self) -> None:
        self.saved.end_step()
        for group in self._groups.values():
            group.clear()
        self._offloaded.clear()
