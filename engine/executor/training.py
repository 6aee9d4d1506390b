"""LoRA training steps over streamed weights: the library under mode=execute's
workload=train_lora (engine/modes/spec_run.py) and the training benchmarks.

One step, inside `executor.step()` (the weight order of a train_lora trace is
the forward's kernels, then the backward's in reverse, reading the same weights):

    forward     StreamedWeights.fetch(i) -> executor positions 0 .. F-1
    pack        a saved view of a base weight becomes a handle (kernel i, name,
                geometry): autograd never holds pool memory the weight policy
                may evict; everything else goes to the activation offloader
                (activations=watermark | sync) or stays (activations=off;
                with budget=null nothing is evicted and no hook runs)
    backward    the first unpack of kernel i's weight issues the executor up to
                position 2F-1-i (the mirror of i), then rebuilds the view over
                the weight as it is resident now
    finish      the backward kernels nobody unpacked (their weights needed no
                gradient path) are issued too, so the step is the whole order

The base weights are frozen; the LoRA adapters take a plain SGD update after
each step (`train_step`). `reference_steps` runs the same steps with every
weight resident and no hooks, for a bitwise comparison.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Hashable, Iterator, Mapping

import torch

from engine.errors import ExecutorError
from engine.executor.model_hooks import KernelTracking
from engine.executor.offloader import ActivationOffloader
from engine.executor.saved_groups import HOOKS
from engine.executor.runtime import WeightExecutor
from engine.executor.setup import bitwise_equal
from engine.models.lora import lora_backward, lora_sgd
from engine.models.run import DictSource
from engine.models.spec import ModelSpec
from engine.policy import AccessOrder
from engine.trace import BACKWARD_SUFFIX
from engine.units import MB

Tensor = torch.Tensor
# The adapters move between steps (a real training loop), small enough that
# bf16 LoRA weights stay at sane scales over a few steps.
LEARNING_RATE = 1e-3
# The Stagehand telemetry schema; activations=off writes zeros for the counts.
ACTIVATION_FIELDS = ("activations_saved", "activations_kept", "activations_spilled", "activations_restored",
                     "spill_bytes", "restore_bytes",
                     "stall_time_ms", "stall_count", "pool_hits", "pool_misses")


HOOK_FIELDS = tuple(f"{hook}_hook_{what}" for hook in HOOKS for what in ("calls", "us"))

# Reduction-order noise on a tensor's scale: bf16's epsilon (match_reference).
NOISE_RTOL = 2.0 ** -7
RECOMPUTE = "the recompute of"  # how a recompute names itself to `StreamedWeights.mirror`


class StreamedWeights:
    """The WeightSource of the forward and the ManagedWeights of autograd, over
    one WeightExecutor whose order is a train_lora step (module docstring)."""

    def __init__(self, executor: WeightExecutor, forward_kernels: int):
        self.executor = executor
        self.forward_kernels = forward_kernels
        self.handles = 0  # saved weight views held as handles, this step
        self._position = -1
        self._current: Mapping[str, Tensor] = {}
        self._spans: list[tuple[int, int, str]] = []  # the current kernel's weights: [start, end) addresses
        self._through: Any = None  # what fetches go through instead of the executor (fetches_through)

    def start_step(self) -> None:
        self._position = -1
        self.handles = 0

    @contextmanager
    def fetches_through(self, source: Any) -> Iterator[None]:
        """Fetches inside, forward and backward, go through `source`, a wrapper of the executor
        (a timer such as engine.measure.timing.KernelStamps); None: the executor itself."""
        self._through = source
        try:
            yield
        finally:
            self._through = None

    def release(self) -> None:
        """Drop the last fetched weights (on the cpu backend they may be the host's own)."""
        self._current, self._spans = {}, []

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        """Forward: kernel `kernel_index`'s weights (executor position = kernel index)."""
        self._issue(kernel_index)
        return self._current

    def handle(self, tensor: Tensor) -> Hashable | None:
        """A saved tensor that views one of the running kernel's weights: (kernel, weight,
        dtype, geometry). A weight held as bytes (a packed span, engine/modules/packing.py)
        is viewed at any dtype; any other only at its own."""
        ptr = tensor.data_ptr()
        for start, end, name in self._spans:
            if start <= ptr < end:
                w = self._current[name]
                if tensor.dtype != w.dtype and w.dtype != torch.uint8:
                    raise ExecutorError(f"a saved tensor views weight {name} as {tensor.dtype} (the weight is "
                                        f"{w.dtype}); streamed weights rebuild views of the weight's own dtype only")
                self.handles += 1
                return (self._position, name, tensor.dtype, tuple(tensor.shape), tensor.stride(),
                        (ptr - start) // tensor.element_size())
        return None

    def fetch_handle(self, handle: Hashable) -> Tensor:
        """Backward: the saved view again, over the weight as the executor holds it at the mirror position."""
        kernel, name, dtype, size, stride, offset = handle
        w = self.mirror(kernel, name)[name]
        if w.dtype != dtype:
            w = w.view(dtype)
        return w.as_strided(size, stride, w.storage_offset() + offset)

    def mirror(self, kernel: int, what: str) -> Mapping[str, Tensor]:
        """Backward: forward kernel `kernel`'s weights at its mirror position (for a saved
        view, or for activation checkpointing's recompute of the kernel); `what` names
        the reader in a divergence error."""
        position = 2 * self.forward_kernels - 1 - kernel
        if position < self._position:
            hint = ("; activation checkpointing recomputes a region's kernels in forward order: make each "
                    "checkpointed module one kernel (grouping=block, or blocks=[...] naming them)"
                    if what.startswith(RECOMPUTE) else "")
            raise ExecutorError(
                f"schedule divergence: backward used {what} of forward kernel {kernel} after the weight "
                f"order moved past its backward (position {position}, now {self._position}); backward must "
                f"visit kernels in reverse forward order{hint}")
        self._advance(position)
        return self._current

    def finish(self) -> None:
        """Issue the rest of the backward: every position of the order runs once a step."""
        self._advance(2 * self.forward_kernels - 1)

    def _advance(self, position: int) -> None:
        self.executor.hand_over()  # autograd runs a CUDA backward on its own thread
        while self._position < position:
            self._issue(self._position + 1)

    def _issue(self, position: int) -> None:
        self._current = (self._through if self._through is not None else self.executor).fetch(position)
        self._position = position
        self._spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
                       for n, t in self._current.items()]


class AsManaged:
    """ManagedWeights over StreamedWeights (its `fetch` is the forward's WeightSource.fetch)."""

    def __init__(self, weights: StreamedWeights):
        self.handle = weights.handle
        self.fetch = weights.fetch_handle


class _Handle:
    __slots__ = ("handle",)

    def __init__(self, handle: Hashable):
        self.handle = handle


@contextmanager
def weight_handles(weights: StreamedWeights, others: Any = None) -> Iterator[None]:
    """Saved weight views become handles (fetched again at their mirror); every other
    saved tensor stays as it is, or goes through `others`' pack / unpack (a recorder's log)."""
    def pack(t: Tensor) -> Any:
        h = weights.handle(t)
        if h is not None:
            return _Handle(h)
        return t if others is None else others.pack(t)

    def unpack(saved: Any) -> Tensor:
        if isinstance(saved, _Handle):
            return weights.fetch_handle(saved.handle)
        return saved if others is None else others.unpack(saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def train_order(forward: AccessOrder) -> AccessOrder:
    """A training step's weight order: the forward's kernels, then their mirror (backward)."""
    return AccessOrder(forward.kernels + tuple(k + BACKWARD_SUFFIX for k in reversed(forward.kernels)),
                       forward.reads + tuple(reversed(forward.reads)), dict(forward.sizes))


def check_train_order(order: AccessOrder, spec: ModelSpec) -> None:
    """The trace must be this spec's training step: its forward kernels, then their mirror."""
    kernels = spec.kernels
    n = len(kernels)
    if len(order) != 2 * n:
        raise ExecutorError(f"the trace has {len(order)} kernels but a train_lora step of model {spec.name} runs "
                            f"{2 * n} (forward and backward); use a trace of workload=train_lora for this model")
    for i in range(2 * n):
        k = kernels[i] if i < n else kernels[2 * n - 1 - i]
        name = k.name if i < n else k.name + BACKWARD_SUFFIX
        if order.kernels[i] != name or tuple(order.reads[i]) != tuple(k.weights):
            raise ExecutorError(f"schedule divergence at kernel position {i}: the trace has {order.kernels[i]}, "
                                f"the model runs {name}; record or synthesize the trace for this model and workload")


def lora_step(spec: ModelSpec, source: Any, inputs: Mapping[str, Tensor], lora: Mapping[str, Tensor],
              offloader: ActivationOffloader | None = None) -> Tensor:
    """One LoRA step's forward and backward over `source`'s weights (lora_backward);
    with an offloader, KernelTracking tells it where layers start and end."""
    if offloader is not None:
        source = KernelTracking(source, spec, offloader)
    return lora_backward(spec, source, inputs, lora)


def reference_steps(spec: ModelSpec, host: Mapping[str, Tensor], inputs: Mapping[str, Tensor],
                    lora: Mapping[str, Tensor], steps: int, device: torch.device) -> list[tuple[Tensor, dict]]:
    """`steps` plain training steps, every weight resident, no hooks: (loss, grads) per step."""
    weights = {n: t.to(device, copy=True) for n, t in host.items()}
    lora = {k: t.detach().clone().requires_grad_(True) for k, t in lora.items()}
    out = []
    for _ in range(steps):
        loss = lora_step(spec, DictSource(spec, weights), inputs, lora)
        out.append(to_host((loss.detach(), lora_sgd(lora, LEARNING_RATE))))
    del weights
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the weight pool is not torch's: give the reference's memory back
    return out


def to_host(result: tuple[Tensor, dict]) -> tuple[Tensor, dict]:
    """A step's (loss, grads) copied to host memory (from CUDA: pinned, the host not
    waiting; read them after a synchronize), so a run that keeps every step's result
    to compare holds none of them on the device and its peak is the steps' own."""
    loss, grads = result
    return loss.to("cpu", non_blocking=True), {k: g.to("cpu", non_blocking=True) for k, g in grads.items()}


def match_reference(run: list[tuple[Tensor, dict]], reference: list[tuple[Tensor, dict]],
                    spread: float | None) -> tuple[bool, bool]:
    """Whether every step's loss, and every gradient, equals the reference's: bitwise, or
    (`spread`, measured between two reference runs) within twice it, the run and the
    reference being two draws of the same non-determinism, one pair of which measured it.
    One pair is one draw: a scalar loss of a third run lands past twice its spread about
    a time in three, so a tensor also passes within NOISE_RTOL of its own magnitude (the
    noise of summing in another order; a wrong weight moves a result by its whole size)."""
    def near(a: Tensor, b: Tensor) -> bool:
        b = b.float()
        return (a.float() - b).abs().max().item() <= max(2 * spread, NOISE_RTOL * b.abs().max().item())

    ok = bitwise_equal if not spread else near
    losses = all(ok(loss, ref_loss) for (loss, _), (ref_loss, _) in zip(run, reference))
    grads = all(ok(g[k], ref_g[k]) for (_, g), (_, ref_g) in zip(run, reference) for k in ref_g)
    return losses, grads


def max_abs_diff(a: list[tuple[Tensor, dict]], b: list[tuple[Tensor, dict]]) -> float:
    """The largest |difference| between two runs' losses and gradients."""
    diffs = [(la.float() - lb.float()).abs().max().item() for (la, _), (lb, _) in zip(a, b)]
    diffs += [(ga[k].float() - gb[k].float()).abs().max().item() for (_, ga), (_, gb) in zip(a, b) for k in ga]
    return max(diffs, default=0.0)


def train_step(spec: ModelSpec, executor: WeightExecutor, streamed: StreamedWeights,
               offloader: ActivationOffloader | None, inputs: Mapping[str, Tensor], lora: Mapping[str, Tensor],
               device: torch.device) -> tuple[Tensor, dict]:
    """One training step through the executor (module docstring): (loss, the adapters' gradients)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    hooks: Callable[[], ContextManager]
    if offloader is not None:
        hooks = offloader.step
    elif executor.budget_bytes is None:
        hooks = nullcontext  # every weight stays resident: autograd may hold them, no hook is needed
    else:
        hooks = lambda: weight_handles(streamed)  # noqa: E731
    with executor.step():
        streamed.start_step()
        with hooks():
            loss = lora_step(spec, streamed, inputs, lora, offloader)
        streamed.finish()
    return loss.detach(), lora_sgd(lora, LEARNING_RATE)


def telemetry_row(weights: dict, acts: dict | None, cuda_peak: int | None) -> dict:
    """One step's line. vram_peak_mb: device bytes outside the weight pool at most
    (CUDA: the allocator's high-water mark; cpu backend: the offloader's saved
    bytes, unknown with activations=off); peak_device_bytes adds the weight pool's."""
    activation_peak = cuda_peak
    if activation_peak is None and acts is not None:
        activation_peak = round(acts["saved_peak_mb"] * MB)
    row = {"step": weights["step"], "step_ms": weights["step_ms"]}
    row.update({k: (acts[k] if acts is not None else 0) for k in ACTIVATION_FIELDS})
    row["vram_peak_mb"] = None if activation_peak is None else activation_peak / MB
    if acts is not None:
        row.update({k: acts[k] for k in ("saved_peak_mb", "weight_handles", "held", "d2h_bytes", "h2d_bytes",
                                         "finalize_wait_ms", *HOOK_FIELDS)})
        row["activation_h2d_bytes"] = row.pop("h2d_bytes")
    row.update({f"weight_{k}": weights[k] for k in ("h2d_bytes", "fetches", "prefetches", "hits", "evictions",
                                                   "peak_device_bytes", "held_device_bytes", "peak_resident_bytes",
                                                   "reserve_releases", "relocations", "relocated_bytes")})
    row["peak_device_bytes"] = weights["peak_device_bytes"] + (activation_peak or 0)
    row["held_device_bytes"] = weights["held_device_bytes"] + (activation_peak or 0)
    return row
