"""Training a real module with its activations spilled: `offload(..., training=True)`.

    h = engine.offload(model, budget_mb=None, example_inputs=batch, training=True,
                       activations={"mode": "sync", "num_offload_layers": 2})
    for batch in loader:
        with h.step():
            loss = loss_fn(model(**batch))
            loss.backward()
        optimizer.step(); optimizer.zero_grad()
    h.telemetry()[-1]      # Activation Stagehand's fields, one dict per step

What autograd saves inside `h.step()` goes through the activation offloader
(engine/executor/offloader.py) under the configured policy (watermark or sync
dictionary, engine/policy/activations.py). Layer boundaries are the module's
repeated blocks (engine/modules/kernels.py `find_blocks`, or `blocks=`): each
block's forward pre-hook enters its layer. Frozen parameters saved by autograd
(a frozen linear saves its weight for the input's gradient) are handles, not
activations (ResidentWeights). Works with per-block `torch.utils.checkpoint`.

The slab pool: `activations.pool.exact` (the default here) sizes it from the
first step, which runs with one tiny slab (its spills go to ordinary host memory);
from the second step the pool holds exactly the step's spills.

The weights stay where they are (budget_mb=None): streaming them under autograd
is built for the spec models (engine/executor/training.py), not yet for modules.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
from omegaconf import OmegaConf
from torch import nn

from engine.config import ActivationsConfig
from engine.errors import ConfigError, ExecutorError
from engine.executor.model_hooks import ResidentWeights
from engine.executor.offloader import ActivationOffloader
from engine.modules.kernels import find_blocks
from engine.policy.activations import build_activation_policy, validate_watermarks
from engine.policy.pool_sizing import exact_pool
from engine.policy.saved import validate_pool

# A real block saves ~150 tensors, a spilled layer ~80 of them at once: at the spec
# models' cap of 64 copies in flight the host waits inline for the oldest copy and the
# GPU starves. The cap bounds copies in flight, not memory (slabs are booked either way).
MODULE_INFLIGHT = 1024
SIZING_SLAB_MB = 0.001  # the sizing step's pool: one slab no saved tensor fits (a policy needs a class)


def activations_config(activations: Any) -> Any:
    """An ActivationsConfig from a mapping (or a config node), checked; pool.exact
    unless class sizes are given, MODULE_INFLIGHT copies in flight unless given."""
    given = OmegaConf.to_container(activations, resolve=True) if OmegaConf.is_config(activations) \
        else dict(activations or {})
    for key in ("max_inflight_d2h", "max_inflight_h2d"):
        given.setdefault(key, MODULE_INFLIGHT)
    pool = dict(given.get("pool") or {})
    if not pool.get("class_sizes_mb"):
        pool.setdefault("exact", True)
    given["pool"] = pool
    try:
        act = OmegaConf.merge(OmegaConf.structured(ActivationsConfig), given)
    except Exception as err:  # omegaconf's validation errors: one line naming the key
        raise ConfigError(f"activations: {str(err).splitlines()[0]}; fields are ActivationsConfig's "
                          "(engine/config.py)") from None
    if act.mode == "off":
        raise ConfigError("training=True spills activations: give activations={'mode': 'sync', "
                          "'num_offload_layers': K} or {'mode': 'watermark', 'high_watermark_mb': ..., "
                          "'low_watermark_mb': ...}")
    if act.mode == "watermark":
        validate_watermarks(act)
    if act.mode == "sync" and act.sync_dict is None and act.num_offload_layers <= 0:
        raise ConfigError("activations mode sync needs num_offload_layers > 0 or a sync_dict")
    if not act.pool.exact:
        validate_pool(act.pool)
    return act


class TrainingHandle:
    """What `offload(..., training=True)` returns: `step()`, `telemetry()`, `remove()`."""

    def __init__(self, module: nn.Module, activations: Any, blocks: Sequence[str] | None = None):
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if not trainable:
            raise ConfigError(f"this {type(module).__name__} has no trainable parameters; add the adapters "
                              "(peft get_peft_model, or requires_grad_ on what trains) before offloading it")
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ConfigError(f"the module's parameters are on {len(devices)} devices; move it to one "
                              "(module.to('cuda')) before offloading with training=True")
        self.module = module
        self.device = next(iter(devices))
        self.act = activations_config(activations)
        modules = dict(module.named_modules())
        names = list(find_blocks(module) if blocks is None else blocks)
        missing = [b for b in names if b not in modules]
        if missing:
            raise ConfigError(f"blocks names {missing[0]!r}, which is not a submodule of this "
                              f"{type(module).__name__}; name submodules as named_modules() does")
        if not names:
            raise ConfigError(f"found no repeated blocks in this {type(module).__name__} (no ModuleList of "
                              "two or more modules with parameters); name its layers with blocks=[...]")
        self.layers = {modules[b]: i for i, b in enumerate(names)}
        self._trainable = trainable
        self._frozen = ResidentWeights({n: p.detach() for n, p in module.named_parameters()
                                        if not p.requires_grad})
        self._sizing = bool(self.act.pool.exact)
        self._rows: list[dict] = []
        self._offloader = self._make_offloader(self.act)
        self._hooks = self._offloader.layer_hooks(self.layers)

    def _make_offloader(self, act: Any) -> ActivationOffloader:
        if act.pool.exact:  # the sizing step: one small slab, the spills to ordinary host memory (misses)
            act = OmegaConf.merge(act, {"pool": {"class_sizes_mb": [SIZING_SLAB_MB], "slabs_per_class": [1],
                                                 "exact": False}})
        policy = build_activation_policy(act, len(self.layers))
        return ActivationOffloader(policy, act, self.device, weights=self._frozen, keep_steps=1)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step: run the forward and its backward inside."""
        if self._offloader is None:
            raise ExecutorError("this handle was removed; offload the module again")
        now = {id(p) for p in self.module.parameters() if p.requires_grad}
        if now != self._trainable:
            raise ExecutorError("the module's trainable parameters changed since it was offloaded (adapters "
                                "added or unfrozen after wrapping); handle.remove(), then offload it again")
        with self._offloader.step():
            yield
        self._rows.append({**_stagehand(self._offloader.telemetry()[-1]), "step": len(self._rows)})
        if self._sizing:
            self._resize()

    def _resize(self) -> None:
        """After the first step: a pool holding exactly that step's spills."""
        sized = exact_pool(self.act, self._offloader.questions, len(self.layers))
        for h in self._hooks:
            h.remove()
        self._offloader.close()
        self.act = OmegaConf.merge(self.act, {"pool": {**sized, "exact": False}})
        self._sizing = False
        self._offloader = self._make_offloader(self.act)
        self._hooks = self._offloader.layer_hooks(self.layers)

    def telemetry(self) -> list[dict]:
        return list(self._rows)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = None


def _stagehand(row: Mapping[str, Any]) -> dict:
    """Activation Stagehand's telemetry fields first, then ours."""
    first = ("activations_saved", "activations_kept", "activations_spilled", "activations_restored",
             "spill_bytes", "restore_bytes", "stall_time_ms", "stall_count", "pool_hits", "pool_misses",
             "vram_peak_mb")
    return {**{k: row[k] for k in first}, **{k: v for k, v in row.items() if k not in first}}
