"""`offload(module, ...)`: stream any torch.nn.Module's weights through the executor.

Each leaf module that owns parameters is one kernel reading its own parameters.
A first forward on the example inputs records the access order (the order the
leaves run), with each leaf's parameters copied in on demand, so the model never
has to fit on the device. Then the floor is checked, the parameters live in host
memory (pinned on CUDA) and pre-hooks fetch them through the runtime into
`param.data`; post-hooks put a placeholder back so no reference outlives the
kernel (the pool reuses that memory).

Kept on the device, outside the budget: parameters owned by modules with
children (they may be read between the children's kernels), buffers, and any
parameter the recording saw read outside its own module (a tied weight used by
a parent, say). `OffloadHandle.resident_params` lists them.

Between kernels a streamed parameter's data is a NaN scalar expanded to its
shape on the compute device: dtype, shape and device queries still answer,
and a read that escaped the recording poisons the output instead of reading
stale memory.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.errors import ConfigError, ExecutorError
from engine.executor.runtime import WeightExecutor
from engine.executor.setup import compute_device
from engine.executor.sources import pack
from engine.policy import AccessOrder
from engine.policy.weights import EVICTIONS, fewest_bytes_eviction
from engine.units import MB, budget_bytes

_OFFLOADED = "_offload_engine_handle"  # set in an offloaded module's __dict__
NO_CUDA = "no CUDA device; use backend='cpu' to exercise the executor on the CPU"


# Tensor properties that read metadata, not data: reading them outside the
# owning module does not need the weight on the device.
_METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "is_cuda", "is_leaf", "ndim",
                       "layout", "grad_fn", "names", "is_sparse", "is_meta", "is_quantized",
                       "itemsize", "nbytes", "grad", "_version", "is_cpu"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "element_size",
                               "nelement", "ndimension", "is_floating_point", "is_complex",
                               "data_ptr", "storage_offset", "__len__", "requires_grad_"})


@dataclass
class _Leaf:
    name: str
    module: nn.Module
    params: dict[str, nn.Parameter]  # weight name -> parameter, streamed ones only


class OffloadHandle:
    """What `offload` returns: the executor, the recorded order, and `remove()`."""

    def __init__(self, module: nn.Module, executor: WeightExecutor, order: AccessOrder,
                 restore: _Restore, hooks: list, resident_params: list[str]):
        self.module = module
        self.executor = executor
        self.order = order
        self.resident_params = resident_params
        self.eviction = executor.policy.eviction
        # eviction="auto": each policy's bytes copied a step for the recorded order (the fewest was chosen)
        self.eviction_bytes: dict[str, int] | None = None
        self._restore = restore
        self._hooks = hooks

    def telemetry(self) -> list[dict]:
        return self.executor.telemetry()

    def remove(self) -> None:
        """Close the executor and put every parameter back where it was."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.module.__dict__.pop("forward", None)
        self.module.__dict__.pop(_OFFLOADED, None)
        self.executor.close()
        self._restore.restore()


class _Restore:
    """Where every parameter and buffer of the module lived, to put them back."""

    def __init__(self, module: nn.Module):
        self.params = {id(p): (p, p.device, p.data) for p in module.parameters()}
        self.buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items()
                        if b is not None]
        self.host: dict[int, torch.Tensor] = {}  # param id -> host copy (streamed ones)

    def stream(self, host: dict[int, torch.Tensor]) -> None:
        """These parameters now live in `host`: forget their original data (it may
        be device memory that must go back to the pool)."""
        self.host = host
        for key in host:
            p, device, _ = self.params[key]
            self.params[key] = (p, device, None)

    def restore(self) -> None:
        for key, (p, device, original) in self.params.items():
            host = self.host.get(key)
            if host is None:
                p.data = original
            elif device.type == "cpu":
                p.data = host.clone()  # out of the shared (pinned) buffer
            else:
                p.data = host.to(device)
        for m, name, b in self.buffers:
            m._buffers[name] = b


def offload(module: nn.Module, *, budget_mb: float | None, example_inputs: Any,
            eviction: str = "priority", lookahead: int = 2, backend: str = "cuda") -> OffloadHandle:
    """Stream `module`'s parameters through a pool capped at `budget_mb` (None: all resident).

    `example_inputs` (a tuple of positional arguments, a dict of keyword
    arguments, or one tensor as the only argument) drive the recording forward; later forwards must run the same
    leaves in the same order (else ExecutorError: schedule divergence). Forwards
    run under torch.no_grad() (inference). A budget under the floor raises
    BelowFloorError with the exact minimum in MB; the module is left untouched.
    `eviction="auto"` picks the policy that copies the fewest bytes a step for the
    recorded order (`handle.eviction`, `handle.eviction_bytes`).
    """
    if _OFFLOADED in module.__dict__:
        raise ExecutorError(f"this {type(module).__name__} is already offloaded; call remove() on its handle "
                            "before offloading it again")
    if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, (int, float))
                                  or not math.isfinite(budget_mb) or budget_mb < 0):
        raise ConfigError(f"budget_mb={budget_mb!r}: give MB of GPU memory as a finite number >= 0, or None")
    if eviction not in (*EVICTIONS, "auto"):
        raise ConfigError(f"eviction={eviction!r} is not one of {', '.join(EVICTIONS)}, auto; pick one of those")
    device = compute_device(backend, no_cuda=NO_CUDA)
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}  # one tensor is one argument, never its rows
    else:
        args, kwargs = tuple(example_inputs), {}
    restore = _Restore(module)
    try:
        return _offload(module, device, args, kwargs, budget_mb, eviction, lookahead, backend, restore)
    except BaseException:
        restore.restore()
        raise


def _offload(module: nn.Module, device: torch.device, args: tuple, kwargs: dict, budget_mb: float | None,
             eviction: str, lookahead: int, backend: str, restore: _Restore) -> OffloadHandle:
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)  # a tied parameter is one weight, named where first seen
    leaves, kept = _leaves(module, names)
    streamed = {id(p): p for leaf in leaves for p in leaf.params.values()}

    # Host copies of the streamed parameters (one pinned buffer on CUDA); the rest to the device.
    host_buffer = _pinned if device.type == "cuda" else _pageable
    host = pack({names[k]: p.data.contiguous() for k, p in streamed.items()}, host_buffer)
    restore.stream({k: host[names[k]] for k in streamed})
    placeholders = {k: _placeholder(p, device) for k, p in streamed.items()}
    for k, p in streamed.items():
        p.data = placeholders[k]
    for p in kept:
        p.data = p.data.to(device)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the streamed parameters held goes back for the pool

    order, outside = _record(module, args, kwargs, leaves, host, placeholders, names, device)
    for p in outside:  # read outside their module: resident from now on
        p.data = host[names[id(p)]].to(device)
        for leaf in leaves:
            leaf.params.pop(names[id(p)], None)
    ran = [leaf for leaf in leaves if leaf.name in set(order.kernels)]

    budget = budget_bytes(budget_mb)
    copied = None
    if eviction == "auto":
        eviction, copied = fewest_bytes_eviction(order, budget, lookahead)
    executor = WeightExecutor(order, {w: host[w] for w in order.sizes}, budget_bytes=budget,
                              eviction=eviction, lookahead=lookahead, backend=backend)
    hooks = _install(module, executor, ran, [leaf for leaf in leaves if leaf not in ran], placeholders)
    resident = [names[id(p)] for p in kept] + [names[id(p)] for p in outside]
    resident_bytes = sum(p.numel() * p.element_size() for p in [*kept, *outside])
    if resident_bytes:
        warnings.warn(f"offload keeps {len(resident)} parameters ({resident_bytes / MB:.1f} MB) resident outside "
                      "the budget: read by modules with children or outside their own module "
                      "(handle.resident_params lists them)", stacklevel=3)
    module.__dict__[_OFFLOADED] = True
    handle = OffloadHandle(module, executor, order, restore, hooks, resident)
    handle.eviction_bytes = copied
    return handle


def _leaves(module: nn.Module, names: dict[int, str]) -> tuple[list[_Leaf], list[nn.Parameter]]:
    """Leaf modules with parameters, and the parameters kept resident (owned by a
    module with children, even if a leaf shares them)."""
    kept = {id(p): p for m in module.modules() if next(m.children(), None) is not None
            for p in m.parameters(recurse=False)}
    leaves = []
    for qual, m in module.named_modules():
        if next(m.children(), None) is not None:
            continue
        params = {names[id(p)]: p for p in m.parameters(recurse=False) if id(p) not in kept}
        if params:
            leaves.append(_Leaf(qual or type(m).__name__, m, params))
    return leaves, list(kept.values())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pageable(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _placeholder(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    fill = float("nan") if p.dtype.is_floating_point else 0
    return torch.full((), fill, dtype=p.dtype, device=device).expand(p.shape)


class _Recorder(TorchFunctionMode):
    """The recording forward: leaves in the order they run, parameters copied in on
    demand, and every parameter an op reads while its own module is not running."""

    def __init__(self, owned: dict[int, set[int]], streamed: dict[int, nn.Parameter]):
        super().__init__()
        self.owned = owned  # id(module) -> ids of the streamed parameters it owns
        self.streamed = streamed
        self.active: list[int] = []
        self.paused = False
        self.outside: dict[int, nn.Parameter] = {}
        self.on_outside = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and not _reads_metadata(func):
            mine = self.owned.get(self.active[-1], set()) if self.active else set()
            for a in _tensors(args, kwargs):
                key = id(a)
                if key in self.streamed and key not in mine and key not in self.outside:
                    self.outside[key] = a
                    self.on_outside(a)
        return func(*args, **kwargs)


def _reads_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return name == "__set__" or prop in _METADATA
    return name in _METADATA_METHODS


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    stack = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())


def _record(module: nn.Module, args: tuple, kwargs: dict, leaves: list[_Leaf], host: dict[str, torch.Tensor],
            placeholders: dict[int, torch.Tensor], names: dict[int, str],
            device: torch.device) -> tuple[AccessOrder, list[nn.Parameter]]:
    streamed = {id(p): p for leaf in leaves for p in leaf.params.values()}
    recorder = _Recorder({id(leaf.module): {id(p) for p in leaf.params.values()} for leaf in leaves}, streamed)
    kernels: list[tuple[str, _Leaf]] = []

    def bring(p: nn.Parameter) -> None:
        p.data = host[names[id(p)]].to(device, copy=True)

    recorder.on_outside = bring

    def pre(leaf: _Leaf):
        def hook(m, inputs):
            recorder.paused = True
            for p in leaf.params.values():
                if id(p) not in recorder.outside:
                    bring(p)
            recorder.active.append(id(m))
            kernels.append((leaf.name, leaf))
            recorder.paused = False
        return hook

    def post(leaf: _Leaf):
        def hook(m, inputs, output):
            recorder.paused = True
            recorder.active.pop()
            for p in leaf.params.values():
                if id(p) not in recorder.outside:
                    p.data = placeholders[id(p)]
            recorder.paused = False
        return hook

    handles = []
    for leaf in leaves:
        handles.append(leaf.module.register_forward_pre_hook(pre(leaf)))
        handles.append(leaf.module.register_forward_hook(post(leaf)))
    try:
        with torch.no_grad(), recorder:
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    outside = list(recorder.outside.values())
    out_names = {names[id(p)] for p in outside}
    reads = tuple(tuple(w for w in leaf.params if w not in out_names) for _, leaf in kernels)
    sizes = {w: host[w].numel() * host[w].element_size() for r in reads for w in r}
    if not kernels:
        raise ExecutorError("the recording forward ran no module that owns parameters; nothing to offload")
    return AccessOrder(tuple(k for k, _ in kernels), reads, sizes), outside


def _install(module: nn.Module, executor: WeightExecutor, ran: list[_Leaf], idle: list[_Leaf],
             placeholders: dict[int, torch.Tensor]) -> list:
    hooks = []
    for leaf in ran:
        def pre(m, inputs, leaf=leaf):
            weights = executor.fetch_next(leaf.name)
            for w, p in leaf.params.items():
                p.data = weights[w]

        def post(m, inputs, output, leaf=leaf):
            for p in leaf.params.values():
                p.data = placeholders[id(p)]

        hooks.append(leaf.module.register_forward_pre_hook(pre))
        hooks.append(leaf.module.register_forward_pre_hook(_inside(executor, leaf.name, module), prepend=True))
        hooks.append(leaf.module.register_forward_hook(post))
    for leaf in idle:
        def never(m, inputs, leaf=leaf):
            raise ExecutorError(f"schedule divergence: {leaf.name} ran but did not run in the recording "
                                "forward; handle.remove(), then offload() again with inputs that take this path")
        hooks.append(leaf.module.register_forward_pre_hook(never))

    inner = module.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            raise ExecutorError("an offloaded module runs inference only (its weights are freed after each "
                                "kernel, autograd would keep them); call it under torch.no_grad()")
        with executor.step():
            return inner(*args, **kwargs)

    module.forward = forward
    return hooks


def _inside(executor: WeightExecutor, name: str, root: nn.Module) -> Any:
    """A pre-hook refusing a leaf called on its own, outside the offloaded module's forward."""
    def hook(m: nn.Module, inputs: Any) -> None:
        if not executor.in_step:
            raise ExecutorError(f"{name} was called on its own; its weights stream only inside a forward of the "
                                f"offloaded {type(root).__name__}: call that module, or handle.remove() first")
    return hook
