"""mode=execute for workload=train_lora: LoRA training steps with the base
weights streamed through the weight executor and the saved activations spilled
by the activation offloader, both driven by the policies the simulator uses.

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

The base weights are frozen; the LoRA adapters (init_lora, seed cfg.seed + 1)
take a plain SGD update after each step. When the model and its saved
activations fit the device beside nothing else, the same steps run first with
every weight resident and no hooks, and every step's loss and gradients are
compared bitwise with that reference.
"""
from __future__ import annotations

import json
import os
import statistics
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Hashable, Iterator, Mapping

import torch

from engine.errors import ExecutorError
from engine.executor.model_hooks import KernelTracking
from engine.executor.offloader import ActivationOffloader
from engine.executor.execute import REFERENCE_FRACTION, _device, _weight_file
from engine.units import budget_bytes
from engine.executor.runtime import WeightExecutor, make_backend
from engine.executor.sources import host_weights
from engine.models import DictSource, forward, init_lora, make_inputs
from engine.policy import AccessOrder
from engine.policy.activations import build_activation_policy
from engine.policy.weights import WeightResidency
from engine.spec import ModelSpec
from engine.trace import BACKWARD_SUFFIX
from engine.weightfile import WeightFile
from engine.units import MB

Tensor = torch.Tensor
# The adapters move between steps (a real training loop), small enough that
# bf16 LoRA weights stay at sane scales over a few steps.
LEARNING_RATE = 1e-3
# The Stagehand telemetry schema; activations=off writes zeros for the counts.
ACTIVATION_FIELDS = ("activations_saved", "kept", "spilled", "restored", "spill_bytes", "restore_bytes",
                     "stall_time_ms", "stall_count", "pool_hits", "pool_misses")


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

    def start_step(self) -> None:
        self._position = -1
        self.handles = 0

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        """Forward: kernel `kernel_index`'s weights (executor position = kernel index)."""
        self._issue(kernel_index)
        return self._current

    def handle(self, tensor: Tensor) -> Hashable | None:
        """A saved tensor that views one of the running kernel's weights: (kernel, weight, geometry)."""
        ptr = tensor.data_ptr()
        for start, end, name in self._spans:
            if start <= ptr < end:
                w = self._current[name]
                if tensor.dtype != w.dtype:
                    raise ExecutorError(f"a saved tensor views weight {name} as {tensor.dtype} (the weight is "
                                        f"{w.dtype}); streamed weights rebuild views of the weight's own dtype only")
                self.handles += 1
                return (self._position, name, tuple(tensor.shape), tensor.stride(),
                        (ptr - start) // tensor.element_size())
        return None

    def fetch_handle(self, handle: Hashable) -> Tensor:
        """Backward: the saved view again, over the weight as the executor holds it at the mirror position."""
        kernel, name, size, stride, offset = handle
        position = 2 * self.forward_kernels - 1 - kernel
        if position < self._position:
            raise ExecutorError(
                f"schedule divergence: backward used weight {name} of forward kernel {kernel} after the weight "
                f"order moved past its backward (position {position}, now {self._position}); backward must "
                "visit kernels in reverse forward order")
        self._advance(position)
        w = self._current[name]
        return w.as_strided(size, stride, w.storage_offset() + offset)

    def finish(self) -> None:
        """Issue the rest of the backward: every position of the order runs once a step."""
        self._advance(2 * self.forward_kernels - 1)

    def _advance(self, position: int) -> None:
        self.executor.hand_over()  # autograd runs a CUDA backward on its own thread
        while self._position < position:
            self._issue(self._position + 1)

    def _issue(self, position: int) -> None:
        self._current = self.executor.fetch(position)
        self._position = position
        self._spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
                       for n, t in self._current.items()]


class _AsManaged:
    """ManagedWeights over StreamedWeights (its `fetch` is the forward's WeightSource.fetch)."""

    def __init__(self, weights: StreamedWeights):
        self.handle = weights.handle
        self.fetch = weights.fetch_handle


class _Handle:
    __slots__ = ("handle",)

    def __init__(self, handle: Hashable):
        self.handle = handle


@contextmanager
def weight_handles(weights: StreamedWeights) -> Iterator[None]:
    """activations=off with streamed weights: saved weight views become handles, activations stay."""
    def pack(t: Tensor) -> Any:
        h = weights.handle(t)
        return t if h is None else _Handle(h)

    def unpack(saved: Any) -> Tensor:
        return weights.fetch_handle(saved.handle) if isinstance(saved, _Handle) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


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


def lora_loss(out: Mapping[str, Tensor]) -> Tensor:
    return sum(o.float().pow(2).mean() for o in out.values())


def _sgd(lora: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Take the step's gradients (returned, detached) and update the adapters."""
    grads = {}
    with torch.no_grad():
        for k, p in lora.items():
            grads[k] = p.grad
            p.sub_(p.grad, alpha=LEARNING_RATE)
            p.grad = None
    return grads


def _fits_resident(spec: ModelSpec, saved_bytes: int, device: torch.device) -> bool:
    need = spec.model_bytes + saved_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need <= REFERENCE_FRACTION * free


def _reference(spec: ModelSpec, host: Mapping[str, Tensor], inputs: Mapping[str, Tensor],
               lora: Mapping[str, Tensor], steps: int, device: torch.device) -> list[tuple[Tensor, dict]]:
    """`steps` plain training steps, every weight resident, no hooks: (loss, grads) per step."""
    weights = {n: t.to(device, copy=True) for n, t in host.items()}
    lora = {k: t.detach().clone().requires_grad_(True) for k, t in lora.items()}
    out = []
    for _ in range(steps):
        loss = lora_loss(forward(spec, DictSource(spec, weights), inputs, lora))
        loss.backward()
        out.append((loss.detach(), _sgd(lora)))
    del weights
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the weight pool is not torch's: give the reference's memory back
    return out


@contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """A bitwise comparison needs kernels that sum in a fixed order (cuBLAS
    workspaces, attention backward); the timed steps then run those kernels too."""
    if not on:
        yield
        return
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def run_train_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps LoRA training steps; write telemetry.jsonl; return the measurement."""
    w, act = cfg.weights, cfg.activations
    if cfg.workload.kind != "train_lora" or cfg.workload.lora_rank < 1:
        raise ExecutorError(f"training execute needs workload.kind=train_lora with lora_rank >= 1 (got "
                            f"{cfg.workload.kind}, rank {cfg.workload.lora_rank}); use workload=train_lora")
    device = _device(w.backend)
    order = trace.access_order()
    check_train_order(order, spec)
    budget = budget_bytes(cfg.budget)
    # The floor first: a budget under it fails before any file or device memory is touched.
    floor_bytes = WeightResidency(order, budget, w.eviction, w.lookahead).floor.bytes
    policy = build_activation_policy(act, spec.num_layers)  # a bad activations config fails here too
    saved_bytes = sum(s.nbytes for r in trace.records for s in r.saved)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = cfg.workload.steps
    with ExitStack() as stack:
        wf = WeightFile(_weight_file(cfg, spec, stack), spec)
        stack.callback(wf.close)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
        compare = _fits_resident(spec, saved_bytes, device)
        stack.enter_context(_deterministic(compare and device.type == "cuda"))
        reference = _reference(spec, wf.tensors(), inputs, lora, steps, device) if compare else None
        spread = None
        if reference is not None and device.type == "cuda":
            # Some CUDA kernels (cuDNN's attention backward at long sequences) stay
            # non-deterministic even in deterministic mode: a second reference run
            # measures that spread, so a difference within it is not called wrong.
            spread = _max_abs_diff(reference, _reference(spec, wf.tensors(), inputs, lora, steps, device))
        capacity = budget if budget is not None else spec.model_bytes
        backend = make_backend(w.backend, capacity, max(order.sizes.values(), default=0))
        stack.callback(backend.close)
        host = host_weights(wf, w.source, backend)
        stack.callback(host.close)
        executor = WeightExecutor(order, host.tensors, budget_bytes=budget, eviction=w.eviction,
                                  lookahead=w.lookahead, backend=backend, keep_steps=None,
                                  relocate=False)  # backward holds weight views across fetches
        stack.callback(executor.close)
        streamed = StreamedWeights(executor, len(spec.kernels))
        offloader = None
        if policy is not None:
            offloader = ActivationOffloader(policy, act, device, weights=_AsManaged(streamed), keep_steps=None)
            stack.callback(offloader.close)
        results, peaks = [], []
        for _ in range(steps):
            results.append(_step(spec, executor, streamed, offloader, inputs, lora, device))
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        weight_rows = executor.telemetry()  # waits for the last step
        act_rows = offloader.telemetry() if offloader is not None else [None] * steps
    rows = [_telemetry_row(wr, ar, peak) for wr, ar, peak in zip(weight_rows, act_rows, peaks)]
    with open(out_dir / "telemetry.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    losses = grads = None
    if reference is not None:
        # Within twice the spread: the offloaded run and the reference are two draws of
        # the same non-determinism, one pair of which measured the spread.
        ok = (lambda a, b: torch.equal(a, b)) if not spread else \
            (lambda a, b: (a.float() - b.float()).abs().max().item() <= 2 * spread)
        losses = all(ok(loss, ref_loss) for (loss, _), (ref_loss, _) in zip(results, reference))
        grads = all(ok(g[k], ref_g[k]) for (_, g), (_, ref_g) in zip(results, reference) for k in ref_g)
    meas = _measurement(rows, cfg, budget, floor_bytes, losses, grads)
    meas["reference_spread"] = spread  # 0 or None: compared bitwise
    return meas


def _max_abs_diff(a: list[tuple[Tensor, dict]], b: list[tuple[Tensor, dict]]) -> float:
    """The largest |difference| between two runs' losses and gradients."""
    diffs = [(la.float() - lb.float()).abs().max().item() for (la, _), (lb, _) in zip(a, b)]
    diffs += [(ga[k].float() - gb[k].float()).abs().max().item() for (_, ga), (_, gb) in zip(a, b) for k in ga]
    return max(diffs, default=0.0)


def _step(spec: ModelSpec, executor: WeightExecutor, streamed: StreamedWeights,
          offloader: ActivationOffloader | None, inputs: Mapping[str, Tensor], lora: Mapping[str, Tensor],
          device: torch.device) -> tuple[Tensor, dict]:
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
            source = KernelTracking(streamed, spec, offloader) if offloader is not None else streamed
            loss = lora_loss(forward(spec, source, inputs, lora))
            loss.backward()
        streamed.finish()
    return loss.detach(), _sgd(lora)


def _telemetry_row(weights: dict, acts: dict | None, cuda_peak: int | None) -> dict:
    """One step's line. vram_peak_mb: device bytes outside the weight pool at most
    (CUDA: the allocator's high-water mark; host backend: the offloader's saved
    bytes, unknown with activations=off); peak_device_bytes adds the weight pool's."""
    activation_peak = cuda_peak
    if activation_peak is None and acts is not None:
        activation_peak = round(acts["saved_peak_mb"] * MB)
    row = {"step": weights["step"], "step_ms": weights["step_ms"]}
    row.update({k: (acts[k] if acts is not None else 0) for k in ACTIVATION_FIELDS})
    row["vram_peak_mb"] = None if activation_peak is None else activation_peak / MB
    if acts is not None:
        row.update({k: acts[k] for k in ("saved_peak_mb", "weight_handles", "held", "d2h_bytes", "h2d_bytes",
                                         "finalize_wait_ms")})
        row["activation_h2d_bytes"] = row.pop("h2d_bytes")
    row.update({f"weight_{k}": weights[k] for k in ("h2d_bytes", "fetches", "prefetches", "hits", "evictions",
                                                   "peak_device_bytes", "peak_resident_bytes",
                                                   "relocations", "relocated_bytes")})
    row["peak_device_bytes"] = weights["peak_device_bytes"] + (activation_peak or 0)
    return row


def _measurement(rows: list[dict], cfg: Any, budget: int | None, floor_bytes: int, losses: bool | None,
                 grads: bool | None) -> dict:
    # Times: the median of the steps after the first (which fills the pool and
    # the caches). Counts: the last step's, the simulator's steady state too.
    steady = rows[1:] or rows
    last = rows[-1]
    return {
        "backend": cfg.weights.backend,
        "source": cfg.weights.source,
        "eviction": cfg.weights.eviction,
        "lookahead": cfg.weights.lookahead,
        "activations": cfg.activations.mode,
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        "steps": len(rows),
        "step_ms": statistics.median(r["step_ms"] for r in steady),
        "first_step_ms": rows[0]["step_ms"],
        # The simulator's h2d_bytes counts every host-to-device copy: weights and activation restores.
        "h2d_bytes": last["weight_h2d_bytes"] + last["restore_bytes"],
        "weight_h2d_bytes": last["weight_h2d_bytes"],
        "relocations": sum(r["weight_relocations"] for r in rows),
        "weight_copies": last["weight_fetches"] + last["weight_prefetches"],
        "weight_hits": last["weight_hits"],
        "weight_misses": last["weight_fetches"],
        "evictions": last["weight_evictions"],
        "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
        "spill_bytes": last["spill_bytes"],
        "restore_bytes": last["restore_bytes"],
        "pool_hits": last["pool_hits"],
        "pool_misses": last["pool_misses"],
        "stall_ms": statistics.median(r["stall_time_ms"] for r in steady),
        "loss_match_reference": losses,
        "grads_match_reference": grads,
        "weights_file": cfg.weights.file,  # None: a temporary file, gone now
    }
