"""What each kernel of a real module runs, counted op by op on any device.

A block of a diffusers or transformers model is dozens of torch ops: a few
matmul-bound cores (its linears, its attention) and many memory-bound ops
around them (norms written out as casts, powers and means; modulation; rotary
embeddings; residual adds). `OpCensus` watches one forward and, per kernel
position, keeps

    cores         the matmul-bound ops, (op, shape) each: "linear" (m, n, k) for a
                  matmul, a convolution (its implicit GEMM) or a grouped matmul (a
                  mixture's experts: one linear as wide as the groups it runs); "attention" or
                  "attention_masked" (batch x heads, query length, key length,
                  head dim) for scaled_dot_product_attention, without or with a mask
                  (torch runs another kernel with one), "attention_full_mask" where the
                  mask varies along the queries (every head's tiles read it);
                  "attention_causal" where it is causal without a mask (the flash
                  kernel skips the tiles above the diagonal);
    passes        every other op as a memory pass of engine/compute.py's PASSES
                  (`memory_pass`), its amount summed by kind: what the kernel
                  table's pass cost prices spec kernels' norms, modulation and
                  copies by, probed on the same GPU;
    ops           the ops that make a tensor, views aside: about one CUDA launch
                  each;
    dispatches    every op torch dispatches, views included: the host's work;
    backward_cores  in a backward's census (`OpCensus.backward`), attention's
                  backward, (op, shape) as its forward's core.

The kernel table prices the cores by shape, the passes at its pass cost and each
op's launch gap at its ModuleCost (engine/compute.py). A training step's backward is
counted the same way, op by op as autograd runs it (a linear's gradient by its input
and an adapter's by its weight are matmuls of their own shapes; a norm's backward its
own memory passes), each op under the kernel whose output's gradient autograd made
last (engine/modules/synthesize.py). On the meta device the census
costs nothing, so a model nobody recorded is counted from its config alone
(engine/modules/synthesize.py); the recorder counts its forward too, and
mode=calibrate fits the launch gap to what it timed.

A memory pass's kind follows how torch's kernel for it reads memory, in the layouts
the op sees (its tensors' strides, which the meta device keeps):
    rms_norm, layer_norm   the fused norms; an RMS norm at most HEAD_WIDTH wide (one
                  head's) is head_rms_norm; a reduction (a mean, a sum: the
                  output half the input or less) counts as the RMS norm of the
                  width it reduces, as a norm written out in ops runs its mean;
    pointwise     contiguous tensors of one dtype, or a cast that narrows: torch's
                  vectorized kernels, bound by bytes;
    broadcast     an input broadcast along some dimension, or dtypes mixed (a cast
                  that widens, bf16 times fp32): the unrolled kernels, which run
                  at a rate of elements whatever their size;
    head_copy     a tensor permuted with its last dimension contiguous (heads
                  moved past the tokens): whole rows of a head at a time;
    transposed, transposed_copy   a tensor whose consecutive elements lie a
                  memory sector or more apart (stored features-major), or a
                  concatenation of permuted tensors (torch's slow path), the
                  copy kinds where the op copies one tensor or concatenates.
The vectorized kinds' amount is the bytes the op moves; the other kinds' the bytes of
its elements at two bytes each (their pass cost is probed in bf16).

Work between two kernels (a model's own glue) counts with the kernel before,
as the recorder times it; work before the first kernel counts with the first.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.compute import PASSES

ATTENTION, ATTENTION_MASKED, ATTENTION_CAUSAL = "attention", "attention_masked", "attention_causal"
ATTENTION_FULL_MASK = "attention_full_mask"
_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm})
# The matmul-bound ops a census counts as cores, (m, n, k) each (OpCensus).
CORE_PACKETS = frozenset(MATMULS | {_aten._grouped_mm, _aten.convolution})
# Ops that launch nothing: allocation without a fill, views torch does not mark as views, and
# reads of a host scalar.
_NO_KERNEL = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.detach, _aten.alias, _aten.lift_fresh,
              _aten._local_scalar_dense, _aten.lift_fresh_copy, _aten._unsafe_view}
# Ops that read only the rows they write (a lookup), and ops that concatenate.
_ROWS = {_aten.embedding, _aten.index_select, _aten.gather, _aten.index}
_GATHERS = {_aten.cat, _aten.stack}
SECTOR = 32  # bytes of a DRAM sector: the unit a GPU reads memory in
HEAD_WIDTH = 256  # a norm at most this wide normalizes one head


def launches_kernel(func: Any) -> bool:
    """Whether the census counts aten op `func` as an op: it makes a tensor with a kernel of
    its own (not a view, an allocation without a fill or a host read)."""
    return not (func.is_view or func._overloadpacket in _NO_KERNEL)


def matmul_core(packet: Any, args: Sequence[torch.Tensor]) -> tuple[str, tuple[int, ...]]:
    """A MATMULS op's core, ("linear", (m, n, k)), from its tensor arguments in order."""
    a, b = (args[1], args[2]) if packet in (_aten.addmm, _aten.baddbmm) else (args[0], args[1])
    inner = a.shape[-1]
    return "linear", (max(1, a.numel() // max(1, inner)), b.shape[-1], inner)


def attention_core(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> tuple[str, tuple[int, ...]]:
    """Attention's core: (ATTENTION; with a `mask` ATTENTION_MASKED, or ATTENTION_FULL_MASK where
    it varies along the queries; is_causal without one, ATTENTION_CAUSAL; (batch x heads, query
    length, key length, head dim)) for queries `q` and keys `k` laid out (..., length, dim)."""
    heads = max(1, q.numel() // (q.shape[-1] * q.shape[-2]))
    if mask is not None:
        op = ATTENTION_FULL_MASK if mask.dim() >= 2 and mask.shape[-2] > 1 else ATTENTION_MASKED
    else:
        op = ATTENTION_CAUSAL if causal else ATTENTION
    return op, (heads, q.shape[-2], k.shape[-2], q.shape[-1])


@dataclass
class KernelCensus:
    """One kernel position's ops (module docstring)."""

    cores: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    passes: dict[str, int] = field(default_factory=dict)  # PASSES kind -> amount (module docstring)
    ops: int = 0
    dispatches: int = 0
    backward_cores: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def add_pass(self, kind: str, amount: int) -> None:
        self.passes[kind] = self.passes.get(kind, 0) + amount

    def pass_list(self) -> tuple[tuple[str, int], ...]:
        """The passes as a record carries them: (kind, amount) in PASSES order."""
        return tuple((k, self.passes[k]) for k in PASSES if self.passes.get(k))


def touched_elements(t: torch.Tensor) -> int:
    """The elements a kernel reads of `t`: a dimension broadcast by stride 0 counts once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)


def _norm_kind(x: torch.Tensor) -> str:
    """The RMS norm kind of normalizing (or reducing) `x`'s last dimension."""
    return "head_rms_norm" if x.shape[-1] <= HEAD_WIDTH else "rms_norm"


def _contiguous(t: torch.Tensor) -> bool:
    """Laid out row-major, dimensions of size 1 aside (their stride is free)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _scattered(t: torch.Tensor) -> bool:
    """Consecutive elements of the last dimension a memory sector or more apart."""
    dims = [st for size, st in zip(t.shape, t.stride()) if size != 1]
    return len(dims) >= 2 and dims[-1] * t.element_size() >= SECTOR


def memory_pass(packet: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> tuple[str, int]:
    """The PASSES kind and amount of a memory-bound op (module docstring) reading `inputs`
    and writing `outputs`."""
    touched = [(touched_elements(t), t.element_size()) for t in inputs + outputs]
    moved, elements = sum(n * size for n, size in touched), 2 * sum(n for n, _ in touched)
    if packet is _aten.native_layer_norm:
        return "layer_norm", moved
    if packet is _aten._fused_rms_norm:
        return _norm_kind(inputs[0]), moved
    if not outputs:
        return "pointwise", moved
    out = max(t.numel() for t in outputs)
    widest = max(inputs, key=lambda t: t.numel(), default=None)
    if packet in _ROWS:  # reads the rows it writes
        return "pointwise", 2 * sum(t.numel() * t.element_size() for t in outputs)
    gather = packet in _GATHERS
    if widest is not None and not gather and 2 * out <= widest.numel():
        return _norm_kind(widest), moved
    full = [t for t in inputs if gather or t.numel() >= out] + outputs
    if any(_scattered(t) for t in full):
        return ("transposed_copy" if gather or len(inputs) == 1 else "transposed"), elements
    if not all(_contiguous(t) for t in full):
        return ("transposed_copy" if gather else "head_copy"), elements
    widened = len({t.dtype for t in full}) > 1 and not (inputs and inputs[0].dtype == torch.float32)
    if widened or (not gather and any(1 < touched_elements(t) < out for t in inputs)):
        return "broadcast", elements
    return "pointwise", moved


class OpCensus(TorchDispatchMode):
    """Counts the ops of the forward run inside it, by kernel position (`start(i)`), into
    `kernels`. Enter `fused()` inside it too, so SDPA counts as one core and rms_norm as one
    op, as CUDA runs each, rather than as the ops a device without their fused kernels (the
    meta device, the CPU) decomposes them into: a census then reads alike on every device."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[KernelCensus] = [KernelCensus()]
        self.paused = False
        self._current = 0

    def start(self, position: int) -> None:
        """Ops from here on belong to kernel `position` (positions start in order)."""
        while len(self.kernels) <= position:
            self.kernels.append(KernelCensus())
        self._current = position

    @property
    def current(self) -> KernelCensus:
        return self.kernels[self._current]

    def fused(self) -> TorchFunctionMode:
        return _Fused(self)

    @contextmanager
    def backward(self) -> Iterator["OpCensus"]:
        """Count the backward run inside (a training step's, on the meta device under
        `meta_fused_kernels`): its ops as a forward's, and the fused attention's, which makes
        no op of its own, noted by it: its backward (and checkpointing's recompute of its
        forward) as a core."""
        _BACKWARDS.append(self)
        try:
            with self:
                yield self
        finally:
            _BACKWARDS.remove(self)

    def note_attention(self, core: tuple[str, tuple[int, ...]], backward: bool) -> None:
        k = self.current
        k.ops += 1
        k.dispatches += 1
        (k.backward_cores if backward else k.cores).append(core)

    def note_pass(self, memory: tuple[str, int]) -> None:
        """One fused op's memory pass (kind, amount), counted where it makes no op of its own."""
        k = self.current
        k.ops += 1
        k.dispatches += 1
        k.add_pass(*memory)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        k = self.current
        k.dispatches += 1
        if not launches_kernel(func):
            return out
        k.ops += 1
        packet = func._overloadpacket
        if packet in MATMULS:
            k.cores.append(matmul_core(packet, args))
        elif packet is _aten._grouped_mm:
            k.cores.append(grouped_core(args[0], args[1]))
        elif packet is _aten.convolution:
            weight, result = args[1], out
            per_output = max(1, weight[0].numel())
            k.cores.append(("linear", (max(1, result.numel() // weight.shape[0]), weight.shape[0], per_output)))
        else:
            k.add_pass(*memory_pass(packet, _tensors((args, kwargs)), _tensors(out)))
        return out


def grouped_core(a: torch.Tensor, b: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """A grouped matmul (torch._grouped_mm: each group's rows times its own weight; a mixture's
    experts) as the one linear of its FLOPs and weight bytes: the groups that run side by side
    as one wide weight, each group's share of the rows its m. Batched (`a` 3-D): every group
    runs its rows. Rows split by offsets (`a` 2-D, `b` 3-D, transformers' experts): the
    offsets are routing's, unknown on the meta device, so the rows spread evenly over as many
    groups as there are rows, at most all (top-k routing picks distinct experts a token).
    Split along k (`b` 2-D): the plain product."""
    n, inner = b.shape[-1], a.shape[-1]
    if a.dim() == 3:
        groups, rows = a.shape[0], max(1, a.shape[1]) * a.shape[0]
    elif b.dim() == 3:
        rows = max(1, a.shape[0])
        groups = max(1, min(b.shape[0], rows))
    else:
        groups, rows = 1, max(1, a.shape[0])
    return ("linear", (-(-rows // groups), n * groups, inner))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


_RMS_NORMS = (F.rms_norm, torch.rms_norm)


_BACKWARDS: list[OpCensus] = []  # the censuses counting a backward now (OpCensus.backward)


class _Fused(TorchFunctionMode):
    """scaled_dot_product_attention as one core of its census and rms_norm as one op (CUDA's
    fused kernel: it reads the input and the weight, writes the output and each row's
    reciprocal RMS in fp32); what runs inside either is not counted. On the meta device SDPA
    makes its output only, as the fused kernel does."""

    def __init__(self, census: OpCensus):
        super().__init__()
        self.census = census

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.census.paused:
            return func(*args, **kwargs)
        if func in _RMS_NORMS:
            return self._rms_norm(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = {**dict(zip(named, args)), **kwargs}
        q, key = given["query"], given["key"]
        k = self.census.current
        k.ops += 1
        k.dispatches += 1
        core = attention_core(q, key, given.get("attn_mask"), bool(given.get("is_causal")))
        k.cores.append(core)
        return self._uncounted(lambda: fused_attention(q, key, given["value"], core, given.get("attn_mask"))
                               if q.is_meta else func(*args, **kwargs))

    def _uncounted(self, run: Callable[[], Any]) -> Any:
        """`run()`'s ops left out of the census: they are the fused kernel already counted."""
        self.census.paused = True
        try:
            return run()
        finally:
            self.census.paused = False

    def _rms_norm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        given = {**dict(zip(("input", "normalized_shape", "weight", "eps"), args)), **kwargs}
        out, rstd = self._uncounted(lambda: fused_rms_norm(func, **given))
        k = self.census.current
        k.ops += 1
        k.dispatches += 1
        k.add_pass(*_rms_norm_pass(given["input"], given.get("weight"), out, rstd))
        return out


def _rms_norm_pass(x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[str, int]:
    """CUDA's fused RMS norm's pass: it reads the input and the weight, writes the output and
    each row's reciprocal RMS in fp32."""
    return memory_pass(_aten._fused_rms_norm, [x] + ([weight] if weight is not None else []), [out, rstd])


def fused_rms_norm(func: Any, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                   eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm (`func`) and each row's reciprocal RMS in fp32. On the meta device as CUDA's
    fused kernel runs it: with autograd on, it saves the input, the weight and the reciprocal
    RMS (not the float32 ops the meta device's decomposition would save), and its backward is
    one pass, noted in the censuses counting that backward."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not input.is_meta:
        out = func(input, shape, weight, eps)
        return out, torch.empty(out.numel() // max(1, math.prod(shape)), dtype=torch.float32, device="meta")
    counting = [c for c in _BACKWARDS if not c.paused]
    for c in counting:  # the decomposition the meta device runs is not the kernel
        c.paused = True
    try:
        with torch.no_grad():
            out = func(input, shape, weight, eps)
    finally:
        for c in counting:
            c.paused = False
    rstd = torch.empty(out.numel() // max(1, math.prod(shape)), dtype=torch.float32, device="meta")
    if torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)):
        out = _FusedRmsNorm.apply(input, weight, out, rstd)
    return out, rstd


class _FusedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                rstd: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, rstd)
        return out.clone() if out._base is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        for census in _BACKWARDS:
            census.note_pass(memory_pass(_aten._fused_rms_norm, [grad, x, rstd] + ([weight] if weight is not None
                                                                                  else []), [x]))
        weight_grad = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        return torch.empty_like(x), weight_grad, None, None


@contextmanager
def meta_fused_kernels() -> Iterator[None]:
    """scaled_dot_product_attention and rms_norm on the meta device as the census runs them in
    a forward (`fused_attention`, `fused_rms_norm`), for a training step's backward:
    checkpointing recomputes each block's forward there and must see the same tensors saved,
    and the censuses counting the backward count each as one op. Autograd runs the
    checkpoint's recompute where no torch function mode of the forward's applies, so the
    functions themselves are replaced for the while (callers look them up at each call, as
    diffusers', transformers' and torch.nn.RMSNorm do)."""
    original, original_norm = F.scaled_dot_product_attention, F.rms_norm

    def rms_norm(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not input.is_meta:
            return original_norm(input, *args, **kwargs)
        given = {**dict(zip(("normalized_shape", "weight", "eps"), args)), **kwargs}
        out, rstd = fused_rms_norm(original_norm, input, **given)
        for census in _BACKWARDS:  # checkpointing's recompute of the forward
            census.note_pass(_rms_norm_pass(input, given.get("weight"), out, rstd))
        return out

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not query.is_meta:
            return original(query, key, value, *args, **kwargs)
        given = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), args)), **kwargs}
        core = attention_core(query, key, given.get("attn_mask"), bool(given.get("is_causal")))
        for census in _BACKWARDS:  # checkpointing's recompute of the forward
            census.note_attention(core, backward=False)
        return fused_attention(query, key, value, core, given.get("attn_mask"))

    F.scaled_dot_product_attention, F.rms_norm = sdpa, rms_norm
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = original, original_norm


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    core: tuple[str, tuple[int, ...]] | None = None, mask: Any = None) -> torch.Tensor:
    """SDPA's output on the meta device: the fused kernel's only, not the scores a decomposition
    would make, laid out (batch, query, heads, dim) as the fused kernels write it, so a model's
    transpose(1, 2).contiguous() after it copies nothing, as on the GPU. A boolean `mask` is
    first made an additive one of its shape in the query's dtype, as torch does, held while the
    kernel runs. With autograd on, it saves what
    the fused kernel's backward reads (query, key, value, output, the scores' log-sum-exp), its
    gradients reach the inputs, and its backward notes `core` (its census core; unmasked
    attention if None) in the censuses counting that backward."""
    bias = torch.empty(mask.shape, dtype=q.dtype, device=q.device) \
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool else None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _FusedAttention.apply(q, k, v, core or attention_core(q, k, None))
    else:
        out = _fused_output(q, v)
    del bias
    return out


def _fused_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    shape = (*q.shape[:-1], v.shape[-1])
    if q.dim() != 4:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    b, h, lq, dv = shape
    return torch.empty(b, lq, h, dv, dtype=q.dtype, device=q.device).transpose(1, 2)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                core: tuple[str, tuple[int, ...]]) -> torch.Tensor:
        out = _fused_output(q, v)
        # The fused kernels' backward reads the row-wise log-sum-exp of the scores beside them.
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core = core
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        for census in _BACKWARDS:
            census.note_attention(ctx.core, backward=True)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
