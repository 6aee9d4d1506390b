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

With a budget the frozen weights stream too (`offload(..., budget_mb=B,
example_inputs=..., training=True)`): the module is made streamable as for
inference (trainable parameters stay resident), and each step's weight order is
the forward's kernels then their mirror; `activations` may then be None (weights
streamed, activations kept). Where every weight fits the budget (or with no budget
and a checkpoint to load from) they are fetched once and bound and the hooks come
off, as offload binds an inference: each step is the plain module's.
"""
from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, ContextManager, Hashable, Iterator, Sequence

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                      register_module_parameter_registration_hook)

from engine.config import ActivationsConfig
from engine.errors import ConfigError, ExecutorError
from engine.executor.model_hooks import ResidentWeights
from engine.executor.offloader import ActivationOffloader
from engine.executor.runtime import WeightExecutor
from engine.executor.training import RECOMPUTE, StreamedWeights, train_order, weight_handles
from engine.modules.kernels import find_blocks, run_order
from engine.modules.streamed import StreamedModule
from engine.policy.activations import build_activation_policy, validate_watermarks
from engine.policy.placement import all_resident
from engine.policy.pool_sizing import exact_pool
from engine.policy.schedule import step_questions
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
    validate_pool(act.pool)
    return act


def sized_for(act: Any, trace: Any) -> Any:
    """`act` with its pool sized from a training trace's spills when `pool.exact` (what the
    sizing step would find, known before the first step): the simulator and the run agree."""
    if act.mode == "off" or not act.pool.exact:
        return act
    sized = exact_pool(act, step_questions(trace.records, act.min_tensor_bytes), trace.num_layers)
    return OmegaConf.merge(act, {"pool": {**sized, "exact": False}})


class _EitherWeights:
    """ManagedWeights over the streamed weights (views of pool blocks, fetched again in
    backward) and the resident frozen ones."""

    def __init__(self, streamed: StreamedWeights, resident: ResidentWeights):
        self.streamed = streamed
        self.resident = resident

    def handle(self, tensor: torch.Tensor) -> Hashable | None:
        h = self.streamed.handle(tensor)
        if h is not None:
            return ("streamed", h)
        h = self.resident.handle(tensor)
        return None if h is None else ("resident", h)

    def fetch(self, handle: Hashable) -> torch.Tensor:
        kind, h = handle
        return self.streamed.fetch_handle(h) if kind == "streamed" else self.resident.fetch(h)


class _Trainable:
    """The module's trainable parameters as offload saw them, checked at each step without
    walking the whole module each time (thousands of submodules under peft): the parameters
    it had are walked again only after a module or parameter was registered anywhere (peft
    adding adapters); otherwise their requires_grad is read (one unfrozen)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._params = list(module.parameters())
        self.ids = {id(p) for p in self._params if p.requires_grad}
        self._registered = False
        ref = weakref.ref(self)  # the global hooks must not keep a dropped handle's module alive

        def mark(*args: Any) -> None:
            watch = ref()
            if watch is not None:
                watch._registered = True

        hooks = [register_module_module_registration_hook(mark), register_module_parameter_registration_hook(mark)]
        self._close = weakref.finalize(self, _remove_all, hooks)

    def unchanged(self) -> bool:
        if self._registered:
            self._params, self._registered = list(self.module.parameters()), False
        return {id(p) for p in self._params if p.requires_grad} == self.ids

    def close(self) -> None:
        self._close()


def _remove_all(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()


class TrainingHandle:
    """What `offload(..., training=True)` returns: `step()`, `telemetry()`, `remove()`.

    With `streamed` (a StreamedModule made with training=True) and a budget, the frozen
    weights stream through a WeightExecutor whose order is the forward's kernels then
    their mirror (engine/executor/training.py's StreamedWeights): forward fetches by
    the module's hooks, backward by the saved weight views' handles."""

    def __init__(self, module: nn.Module, activations: Any, blocks: Sequence[str] | None = None, *,
                 streamed: StreamedModule | None = None, budget_bytes: int | None = None,
                 eviction: str = "priority", lookahead: int = 2, backend: str = "cuda"):
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(f"this {type(module).__name__} has no trainable parameters; add the adapters "
                              "(peft get_peft_model, or requires_grad_ on what trains) before offloading it")
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ConfigError(f"the module's parameters are on {len(devices)} devices; move it to one "
                              "(module.to('cuda')) before offloading with training=True")
        self.module = module
        self.device = next(iter(devices))
        self.act = activations_config(activations) if activations is not None or streamed is None else None
        modules = dict(module.named_modules())
        names = list(find_blocks(module) if blocks is None else blocks)
        missing = [b for b in names if b not in modules]
        if missing:
            raise ConfigError(f"blocks names {missing[0]!r}, which is not a submodule of this "
                              f"{type(module).__name__}; name submodules as named_modules() does")
        if not names:
            raise ConfigError(f"found no repeated blocks in this {type(module).__name__} (no ModuleList of "
                              "two or more modules with parameters); name its layers with blocks=[...]")
        if streamed is not None:  # numbered as the recorded forward ran them, as its trace's layers are
            names = run_order(names, streamed.order.kernels)
        self.layers = {modules[b]: i for i, b in enumerate(names)}
        streamed_ids = set(streamed.placeholders) if streamed is not None else set()
        resident = ResidentWeights({n: p.detach() for n, p in module.named_parameters()
                                    if not p.requires_grad and id(p) not in streamed_ids})
        self.streamed = streamed
        self.executor: WeightExecutor | None = None
        self._weights: StreamedWeights | None = None
        self._managed: Any = resident
        self._binding: ExitStack | None = None
        if streamed is not None:
            order = streamed.order
            train = train_order(order)
            self.executor = WeightExecutor(train, streamed.host, budget_bytes=budget_bytes, eviction=eviction,
                                           lookahead=lookahead, backend=backend)
            self._weights = StreamedWeights(self.executor, len(order))
            if all_resident(self.executor.placement):  # none would ever be evicted: bound, the hooks off
                self._binding = streamed.bind(self.executor)
                self._managed = ResidentWeights({n: p.detach() for n, p in module.named_parameters()
                                                 if not p.requires_grad})
            else:
                self._managed = _EitherWeights(self._weights, resident)
                index = {name: i for i, name in enumerate(order.kernels)}
                streamed.hooks.recompute = lambda name: self._weights.mirror(index[name], f"{RECOMPUTE} {name}")
                self._wrap_forward()
        self.bound = self._binding is not None  # every weight bound: each step the plain module's
        # What streams the frozen weights (None with every weight resident), as OffloadHandle says it.
        self.eviction = eviction if streamed is not None else None
        self.lookahead = lookahead if streamed is not None else None
        self.setup_s = dict(streamed.setup_s) if streamed is not None else {}
        self.trace = None  # offload(eviction="auto", loss_fn=...): the recorded training step
        self.prediction: dict | None = None  # and the simulator's figures for the chosen policy
        self._sizing = bool(self.act is not None and self.act.pool.exact)
        self._rows: list[dict] = []
        self._offloader = self._make_offloader(self.act) if self.act is not None else None
        self._hooks = self._offloader.layer_hooks(self.layers) if self._offloader is not None else []
        self._trainable = _Trainable(module)  # last: its global hooks go with remove()
        self._removed = False

    def _wrap_forward(self) -> None:
        inner, hooks, executor, weights = self.module.forward, self.streamed.hooks, self.executor, self._weights

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not executor.in_step:
                raise ExecutorError("a forward of a module offloaded with training=True runs inside "
                                    "`with handle.step():` (its weights stream there)")
            with hooks.forward(weights):
                return inner(*args, **kwargs)

        self.module.forward = forward

    def _make_offloader(self, act: Any) -> ActivationOffloader:
        if act.pool.exact:  # the sizing step: one small slab, the spills to ordinary host memory (misses)
            act = OmegaConf.merge(act, {"pool": {"class_sizes_mb": [SIZING_SLAB_MB], "slabs_per_class": [1],
                                                 "exact": False}})
        policy = build_activation_policy(act, len(self.layers))
        return ActivationOffloader(policy, act, self.device, weights=self._managed, keep_steps=1)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step: run the forward and its backward inside."""
        if self._removed:
            raise ExecutorError("this handle was removed; offload the module again")
        if not self._trainable.unchanged():
            raise ExecutorError("the module's trainable parameters changed since it was offloaded (adapters "
                                "added or unfrozen after wrapping); handle.remove(), then offload it again")
        streaming = self.executor is not None and not self.bound
        with ExitStack() as stack:
            if self.executor is not None:
                stack.enter_context(self.executor.step(bound=self.bound))
            if streaming:
                self._weights.start_step()
            if self._offloader is not None:
                stack.enter_context(self._offloader.step())
            elif streaming:
                stack.enter_context(weight_handles(self._weights))
            yield
            if streaming:
                self._weights.finish()  # the backward kernels nobody unpacked, so the step is whole
                self.streamed.hooks.release_recomputed()
        row = dict(self._offloader.telemetry()[-1]) if self._offloader is not None else {}
        if self._offloader is not None:
            row["pinned_bytes"] = self._offloader.pinned_bytes
        if self.executor is not None:
            w = self.executor.telemetry()[-1]
            row.update({f"weight_{k}": v for k, v in w.items() if k != "step"})
        self._rows.append({**row, "step": len(self._rows)})
        if self._sizing:
            self._resize()

    def fetches_through(self, source: Any) -> ContextManager[None]:
        """Steps inside fetch each streamed weight, forward and backward, through `source`, a
        wrapper of `executor` (a timer such as engine.measure.timing.KernelStamps); None, or every
        weight resident: as they would."""
        if self._weights is None or self.bound:
            return nullcontext()
        return self._weights.fetches_through(source)

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
        """Close the offloader and the executor; the module's parameters go back where they were."""
        self._trainable.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = None
        if self.executor is not None:
            self.module.__dict__.pop("forward", None)
            if self._binding is not None:
                self._binding.close()  # the parameters at their placeholders again, the hooks back
                self._binding = None
            self._weights.release()
            self._managed = None  # the resident frozen weights: on the cpu backend, views of the checkpoint
            self.executor.close()
            self.executor = None
            self.streamed.remove()
        self._removed = True
