"""A real module's kernels: which parameters each fetch brings in, and the order they run.

A kernel is the unit the weight policy sees: one fetch before it runs, its
weights released after. With `grouping="block"` each repeated block (a child of
a `ModuleList` of two or more modules with parameters: LTX-2's
`transformer_blocks`, Llama's `model.layers`) is one kernel reading every
parameter under it, and each leaf module with parameters outside the blocks is
one kernel. With `grouping="leaf"` every leaf module with parameters is one
kernel. Blocks keep the host ahead of the GPU: one hook pair per block instead
of one per linear.

Parameters owned by a module with children outside the blocks (a model's own
`scale_shift_table`, say) stay resident: that module's forward may read them
between its children's kernels.

`record_order` runs the module once with each kernel's parameters copied in on
demand and returns the access order, plus every parameter an op read while its
own kernel was not running (a tied weight used by a parent): those stay
resident too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch._C import DispatchKey
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from engine.errors import ConfigError, ExecutorError
from engine.models.liveness import LiveBytes
from engine.modules.census import KernelCensus, OpCensus
from engine.modules.checkpoint import state_dict_name
from engine.policy import AccessOrder

GROUPINGS = ("block", "leaf")

# Tensor properties that read metadata, not data: reading them outside the
# owning kernel does not need the weight on the device.
_METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "is_cuda", "is_leaf", "ndim",
                       "layout", "grad_fn", "names", "is_sparse", "is_meta", "is_quantized",
                       "itemsize", "nbytes", "grad", "_version", "is_cpu"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "element_size",
                               "nelement", "ndimension", "is_floating_point", "is_complex",
                               "data_ptr", "storage_offset", "__len__", "requires_grad_"})


@dataclass
class ModuleKernel:
    """One kernel: the module whose forward it is, the parameters it streams (by
    weight name), and its block index (-1 outside the blocks)."""

    name: str
    module: nn.Module
    params: dict[str, nn.Parameter]
    layer: int


@dataclass(frozen=True)
class Recording:
    """What the recording forward saw."""

    order: AccessOrder
    layers: tuple[int, ...]  # per position: its block's index in run order (`run_order`; -1 outside)
    flops: tuple[int, ...]  # per position: FLOPs torch's counter saw (matmuls, attention, convolutions)
    outside: tuple[nn.Parameter, ...]  # read while their kernel was not running: kept resident
    census: tuple[KernelCensus, ...]  # per position: its ops (engine/modules/census.py)
    live_peak: int = 0  # the most bytes the forward's ops held live at once (`forward_live_bytes`)


def weight_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name as the checkpoint holds it (`state_dict_name`); a tied
    parameter is one weight, named where first seen."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), state_dict_name(name))
    return names


def find_blocks(module: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks: the children of every outermost
    ModuleList with two or more children that own parameters."""
    found: list[str] = []
    taken: list[str] = []
    for qual, m in module.named_modules():
        if any(qual.startswith(t + ".") for t in taken):
            continue
        if isinstance(m, nn.ModuleList):
            children = [(n, c) for n, c in m.named_children() if next(c.parameters(), None) is not None]
            if len(children) >= 2:
                taken.append(qual)
                found.extend(f"{qual}.{n}" if qual else n for n, _ in children)
    return found


def partition(module: nn.Module, grouping: str = "block", blocks: Sequence[str] | None = None,
              keep_trainable: bool = False) -> tuple[list[ModuleKernel], list[nn.Parameter]]:
    """The module's kernels (in module order) and the parameters kept resident.
    `keep_trainable` (training): parameters that require grad (the adapters) stay
    resident, as the optimizer needs them; only frozen ones stream.

    `blocks` overrides the blocks `find_blocks` finds (qualified module names)."""
    if grouping not in GROUPINGS:
        raise ConfigError(f"grouping={grouping!r} is not one of {', '.join(GROUPINGS)}; pick one of those")
    names = weight_names(module)
    modules = dict(module.named_modules())
    block_names = list(find_blocks(module) if blocks is None else blocks) if grouping == "block" else []
    for b in block_names:
        if b not in modules:
            raise ConfigError(f"blocks names {b!r}, which is not a submodule of this "
                              f"{type(module).__name__}; name submodules as named_modules() does")
    inside_block = {id(m) for b in block_names for m in modules[b].modules()}
    kernels: list[ModuleKernel] = []
    for layer, b in enumerate(block_names):
        params = {names[id(p)]: p for p in modules[b].parameters()}
        if params:
            kernels.append(ModuleKernel(b, modules[b], params, layer))
    kept: dict[int, nn.Parameter] = {}
    for qual, m in module.named_modules():
        if id(m) in inside_block:
            continue
        own = {names[id(p)]: p for p in m.parameters(recurse=False)}
        if next(m.children(), None) is not None:
            kept.update({id(p): p for p in own.values()})
        elif own:
            kernels.append(ModuleKernel(qual or type(m).__name__, m, own, -1))
    # A parameter shared by two kernels, or by a kernel and a parent, is kept resident.
    seen: dict[int, int] = {}
    for k in kernels:
        for p in k.params.values():
            seen[id(p)] = seen.get(id(p), 0) + 1
    for k in kernels:
        for w, p in list(k.params.items()):
            if seen[id(p)] > 1 or id(p) in kept or (keep_trainable and p.requires_grad):
                kept[id(p)] = p
                del k.params[w]
    return [k for k in kernels if k.params], list(kept.values())


class _OutsideReads(TorchFunctionMode):
    """Every streamed parameter an op reads while its own kernel is not running."""

    def __init__(self, owner: Mapping[int, int], on_outside: Callable[[nn.Parameter], None]):
        super().__init__()
        self.owner = owner  # id(parameter) -> index of the kernel that streams it
        self.on_outside = on_outside
        self.active: list[int] = []
        self.paused = False
        self.outside: dict[int, nn.Parameter] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and not _reads_metadata(func):
            active = self.active[-1] if self.active else None
            for a in _tensors(args, kwargs):
                key = id(a)
                if key in self.owner and self.owner[key] != active and key not in self.outside:
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


def _uncounted_on_error(formula: Callable) -> Callable:
    """A flop formula that counts 0 where torch's own refuses the shapes (grouped-query
    attention, say) instead of failing the recording forward."""
    def count(*args: Any, **kwargs: Any) -> int:
        try:
            return formula(*args, **kwargs)
        except (AssertionError, RuntimeError, ValueError, TypeError, IndexError):
            return 0
    return count


class _FlopCount(TorchDispatchMode):
    """The FLOPs of the ops run inside it, by torch's formulas (flop_registry), counted as
    torch's FlopCounterMode counts them: an op that decomposes (CompositeImplicitAutograd)
    is counted by its parts. Only the total: FlopCounterMode's per-module tally puts hooks
    on every module and bookkeeping on every op of the recording forward."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self._formulas = {op: _uncounted_on_error(f) for op, f in flop_registry.items()}
        self._decomposes: dict[Any, bool] = {}  # op -> whether it has a composite decomposition

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._decomposable(func):
            with self:
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

    def _decomposable(self, func: Any) -> bool:
        known = self._decomposes.get(func)
        if known is None:
            key = DispatchKey.CompositeImplicitAutograd
            known = func is not torch.ops.prim.device.default and (
                key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
            self._decomposes[func] = known
        return known


def forward_live_bytes(module: nn.Module, inputs: Any) -> tuple[LiveBytes, int]:
    """A LiveBytes over one forward of `module` on `inputs` (a dict of keyword arguments or a
    tuple of positional ones), and the inputs' bytes: the parameters, buffers and input
    tensors are held all along; a transformers KV cache (no pytree) counts as live until the
    forward replaces it (each layer's keys and values concatenated anew)."""
    given = input_tensors(inputs)
    live = LiveBytes([*module.parameters(), *module.buffers(), *given])
    live.adopt(kv_cache_tensors(inputs))
    return live, sum(t.numel() * t.element_size() for t in given)


def buffer_bytes(module: nn.Module) -> int:
    """The bytes of `module`'s buffers (a learned positional table, rotary frequencies):
    offload moves every one to the device, where it stays beside the streamed weights."""
    return sum(b.numel() * b.element_size() for b in module.buffers())


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    """The tensors among a forward's arguments (a pytree)."""
    return [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]


def kv_cache_tensors(inputs: Any) -> list[torch.Tensor]:
    """The keys and values of a transformers KV cache among a forward's arguments."""
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return [t for v in values for layer in getattr(v, "layers", ())
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]


def record_order(module: nn.Module, run: Callable[[], Any], kernels: list[ModuleKernel],
                 bring: Callable[[str, nn.Parameter], None], release: Callable[[str, nn.Parameter], None],
                 live: LiveBytes | None = None, then: Callable[[], None] | None = None) -> Recording:
    """Run `run()` (one forward of `module`) once, each kernel's parameters brought in
    by `bring(name, p)` as it starts and `release(name, p)` after; returns the order
    the kernels ran in, what was read outside its kernel (brought in, and left
    in, on first read), each position's ops (OpCensus) and, with `live`
    (`forward_live_bytes`), the bytes the forward's ops held at their peak. `then()`
    runs after the forward, its ops counted with the last kernel's (a training step's
    loss, where a recording times it)."""
    owner = {id(p): i for i, k in enumerate(kernels) for p in k.params.values()}
    names = {id(p): w for k in kernels for w, p in k.params.items()}
    census = OpCensus()
    tracing = live is not None
    live = live if tracing else LiveBytes([])
    live.paused = not tracing

    def uncounted(fn: Callable[[], None]) -> None:
        """Run `fn` (bringing weights in or out) outside the census and the live bytes: the
        module's ops only."""
        was = census.paused, live.paused
        census.paused = live.paused = True
        try:
            fn()
        finally:
            census.paused, live.paused = was

    reads = _OutsideReads(owner, lambda p: uncounted(lambda: bring(names[id(p)], p)))
    counter = _FlopCount()
    ran: list[tuple[int, int]] = []  # (kernel index, FLOPs counted when it started)

    def pre(i: int) -> Callable:
        def hook(m: nn.Module, inputs: Any) -> None:
            reads.paused = True
            for w, p in kernels[i].params.items():
                if id(p) not in reads.outside:
                    uncounted(lambda: bring(w, p))
            reads.active.append(i)
            census.start(len(ran))
            ran.append((i, counter.total))
            reads.paused = False
        return hook

    def post(i: int) -> Callable:
        def hook(m: nn.Module, inputs: Any, output: Any) -> None:
            reads.paused = True
            reads.active.pop()
            for w, p in kernels[i].params.items():
                if id(p) not in reads.outside:
                    uncounted(lambda: release(w, p))
            reads.paused = False
        return hook

    handles = []
    for i, k in enumerate(kernels):
        handles.append(k.module.register_forward_pre_hook(pre(i)))
        handles.append(k.module.register_forward_hook(post(i)))
    try:
        with live, counter, census, census.fused(), reads:
            run()
            if then is not None:
                then()
    finally:
        for h in handles:
            h.remove()
    if not ran:
        raise ExecutorError("the recording forward ran no module that owns parameters; nothing to offload")
    total = counter.total
    starts = [f for _, f in ran] + [total]
    flops = tuple(starts[j + 1] - starts[j] for j in range(len(ran)))
    outside = tuple(reads.outside.values())
    out_names = {names[id(p)] for p in outside}
    order_reads = tuple(tuple(w for w in kernels[i].params if w not in out_names) for i, _ in ran)
    read = {w for r in order_reads for w in r}
    sizes = {w: p.numel() * p.element_size() for k in kernels for w, p in k.params.items() if w in read}
    order = AccessOrder(tuple(kernels[i].name for i, _ in ran), order_reads, sizes)
    blocks = run_order([k.name for k in kernels if k.layer >= 0], order.kernels)
    number = {name: layer for layer, name in enumerate(blocks)}
    return Recording(order, tuple(number.get(kernels[i].name, -1) for i, _ in ran), flops, outside,
                     tuple(census.kernels), live.peak if tracing else 0)


def run_order(blocks: Sequence[str], ran: Sequence[str]) -> list[str]:
    """`blocks` in the order the forward first ran them (`ran`: the kernels' names in run
    order), those it never ran after, as given. Layers are numbered so: an activation
    policy's layers run 0 to N-1 in forward, and a model may run a later ModuleList first
    (HiDream's caption projections before its blocks)."""
    first: dict[str, int] = {}
    for i, name in enumerate(ran):
        first.setdefault(name, i)
    return sorted(blocks, key=lambda b: first.get(b, len(ran)))
