"""Activation spill on the real clock: saved-tensor hooks that carry out the
activation policy (watermark or sync dict, engine/policy) with copies on side
streams. The simulator drives the same policy (sim/activations.py) and asks it
the same questions in the same order.

    off = ActivationOffloader(policy, cfg.activations, "cuda", weights=ResidentWeights(w))
    with off.step():                      # one training step: forward + backward
        out = forward(spec, KernelTracking(source, spec, off), inputs, lora)
        loss_of(out).backward()
    off.telemetry()[-1]                   # one dict per step
    off.close()

What autograd saves goes through the pack hook:
- a trainable leaf (nn.Parameter, a LoRA adapter: any leaf that requires grad)
  is held as it is: the optimizer holds it anyway, a spill would free nothing;
- a managed weight (`ManagedWeights.handle` answers) is held as a handle and
  fetched again on unpack: autograd must not hold memory the weight residency
  policy may evict;
- everything else is an activation. Saved tensors are grouped by storage: a
  view joins its base's group (q, k, v views of one qkv go out once, through
  the base, and come back as views), a tensor saved twice joins its own group.
  The policy is asked once per group (`on_save`), with the group's bytes and
  the layer the model is in, and its answers apply to whole groups.

The policy's answers, carried out:
- keep           hold the device tensor;
- spill / miss   book a slab of the size class (`detail`) / unpinned host
                 memory; watermark mode copies it out at once (D2H on the
                 spill stream, after the compute stream's work so far) and
                 drops the device tensor at once: it is recorded on the spill
                 stream, so the allocator reuses its memory only after the
                 copy has read it, as the simulator frees it when the D2H
                 ends (waiting for the copy on the host instead kept a
                 spilled tensor's memory as long as the host ran ahead of the
                 GPU: no peak reduction without a low max_inflight_d2h, whose
                 waits cost step time); sync mode waits for its layer's
                 offload_group;
- offload_group  D2H of the layer's booked groups;
- wait_offload   the compute stream waits for them (timed, as a stall), then
                 the device tensors go;
- restore        H2D on the restore stream into a new device tensor; the
                 compute stream waits for it when backward first uses it (the
                 wait is timed: stall_time_ms); at the max_inflight_h2d cap the
                 oldest restore is finalized inline. A restore of the tensor
                 being unpacked (on demand) goes on a stream of its own: the
                 restore stream may hold predictive restores still waiting for
                 their spills to land, and the compute stream waits now;
- reload_group   restore every group of the layer that is still off the device;
- release        the slab goes back to its class (a later spill into it waits
                 for this restore to have read it); the device tensor goes when
                 the group's last saved reference has been unpacked.

Layer boundaries reach the policy as in the simulator (on_layer_end of the
previous layer, then on_layer_start): in forward from `on_kernel` (spec-built
models, through KernelTracking) or `layer_boundary` / `layer_hooks` (any
model); in backward, which visits the forward's boundaries in reverse, from
the first unpack of a tensor saved under an earlier boundary, or from a
`layer_boundary` marker's backward, whichever comes first.

With device="cpu" the "device" is host memory: streams are no-ops and every
copy is a real, synchronous copy into the same slabs, so data paths, views,
duplicates, dtypes, checksums and pool accounting all run in CI.
"""
from __future__ import annotations

import time
import warnings
import weakref
import zlib
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from engine.errors import ConfigError, ExecutorError
from engine.executor.pinned_pool import SlabPool
from engine.gc_pause import paused_gc
from engine.policy import KEEP_STEPS, ActivationPolicy, Decision, keep_last_steps
from engine.policy.schedule import Question, ask
from engine.policy.activations import WatermarkPolicy
from engine.policy.saved import mb_to_bytes, validate_caps
from engine.policy.sync import SyncDictPolicy
from engine.spec import ModelSpec
from engine.units import MB

Tensor = torch.Tensor
# A compute-stream wait on a restore shorter than this is the two timing
# events' own cost, not a stall.
STALL_MIN_MS = 0.01

_POLICY_OF_MODE = {"watermark": WatermarkPolicy, "sync": SyncDictPolicy}

# ----- managed weights: the seam to the weight runtime


class ManagedWeights(Protocol):
    """Weights that autograd saves are held as handles, never as tensors.

    The pack hook asks `handle(t)` for every saved tensor first; a non-None
    answer (the weight, or a view of it, is managed) is stored instead of the
    tensor, and the unpack hook calls `fetch(handle)` in backward, on
    autograd's thread. `fetch` returns the saved tensor again, on the device:
    same dtype, size, stride and values (a view over the re-fetched weight);
    it must stay valid until the backward node that asked has run.
    """

    def handle(self, tensor: Tensor) -> Hashable | None: ...

    def fetch(self, handle: Hashable) -> Tensor: ...


class ResidentWeights:
    """ManagedWeights for weights that stay on the device (a DictSource): the
    handle is the weight's name and the view's geometry over it."""

    def __init__(self, weights: Mapping[str, Tensor]):
        self.weights = weights
        self._by_storage = {t.untyped_storage().data_ptr(): name for name, t in weights.items()}

    def handle(self, tensor: Tensor) -> Hashable | None:
        if tensor.requires_grad:
            return None  # a frozen weight's view never requires grad: an activation (the common case)
        name = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if name is None:
            return None
        w = self.weights[name]
        if tensor.dtype != w.dtype:
            raise ExecutorError(f"a saved tensor views weight {name} as {tensor.dtype} (the weight is {w.dtype}); "
                                "ResidentWeights rebuilds views of the weight's own dtype only")
        return name, tuple(tensor.shape), tensor.stride(), tensor.storage_offset() - w.storage_offset()

    def fetch(self, handle: Hashable) -> Tensor:
        name, size, stride, offset = handle
        w = self.weights[name]
        return w.as_strided(size, stride, w.storage_offset() + offset)


# ----- copies: CUDA streams, or synchronous host copies for CI


def _bytes(t: Tensor) -> Tensor:
    """The bytes of a dense tensor (uint8, over its own storage): copies move
    raw bytes, so every dtype (float8 included) travels the same way."""
    n = t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense: its elements fill one span of storage, in some dimension order."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda e: e[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class _HostCopies:
    """device="cpu": copies finish before they return, so there are no events (None)."""

    def spill(self, dst: Tensor, src: Tensor, after: Sequence[Any]) -> None:
        dst.copy_(src)

    def restore(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, src: Tensor,
                after: Any, on_demand: bool = False) -> tuple[Tensor, None]:
        out = torch.empty_strided(shape, stride, dtype=dtype)
        _bytes(out).copy_(src)
        return out, None

    def done(self, event: Any) -> bool:
        return True

    def wait_host(self, event: Any) -> None:
        pass

    def wait(self, event: Any) -> None:
        return None

    def use(self, tensor: Tensor, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        pass


class _CudaCopies:
    """A spill stream (D2H) and a restore stream (H2D) beside the compute stream.

    The compute stream is whatever stream is current when a hook runs (autograd
    runs backward nodes on their forward's stream). Restored tensors are
    allocated on the restore stream, so a restore never waits for compute work
    that freed the memory it lands in, and are recorded on the compute stream
    that uses them, so the allocator reuses them only after that use.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.spill_stream = torch.cuda.Stream(device)
        self.restore_stream = torch.cuda.Stream(device)
        # On-demand restores: behind the restore stream's queue they would wait for
        # predictive restores gated on spills still in flight (H100, LTX-2 8 blocks,
        # 16384 tokens, watermark at 0.8: the text context, saved in block 0 and
        # again in every block, was restored on demand at backward's start and
        # the compute stream sat 35-52 ms behind the spill stream's backlog).
        self.demand_stream = torch.cuda.Stream(device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def spill(self, dst: Tensor, src: Tensor, after: Sequence[torch.cuda.Event]) -> torch.cuda.Event:
        s = self.spill_stream
        s.wait_stream(self._compute())  # the tensor is produced by compute work issued so far
        for e in after:
            s.wait_event(e)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        src.record_stream(s)  # its memory may be freed before the copy has read it
        return s.record_event()

    def restore(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, src: Tensor,
                after: torch.cuda.Event | None, on_demand: bool = False) -> tuple[Tensor, torch.cuda.Event]:
        s = self.demand_stream if on_demand else self.restore_stream
        if after is not None:
            s.wait_event(after)
        with torch.cuda.stream(s):
            out = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
            _bytes(out).copy_(src, non_blocking=True)
        return out, s.record_event()

    def done(self, event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    def wait_host(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def wait(self, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The compute stream waits for a copy; timing events around the wait when it may stall."""
        if event.query():
            return None  # landed already: later compute work sees it
        compute = self._compute()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(event)
        end.record(compute)
        return start, end

    def use(self, tensor: Tensor, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The compute stream takes over a restored tensor (the allocator reuses it only after that use)."""
        tensor.record_stream(self._compute())
        return self.wait(event)

    def synchronize(self) -> None:
        self.spill_stream.synchronize()
        self.restore_stream.synchronize()
        self.demand_stream.synchronize()


# ----- saved tensors


@dataclass(eq=False, slots=True)
class _Group:
    """Saved tensors that share one storage span (the unit), asked about and moved as one."""

    name: str
    layer: int
    nbytes: int
    step: int
    device: Tensor | None  # the unit on the device (original or restored); None while off it
    unit_offset: int  # storage offset of the unit when it was saved (views are relative to it)
    shape: tuple[int, ...]  # the unit's, as it leaves the device (restores recreate it)
    stride: tuple[int, ...]
    dtype: torch.dtype
    dense: bool  # False: saved references get the unit itself (made contiguous if spilled)
    refs: int = 0
    unpacked: int = 0
    booked: bool = False  # the policy spilled it (a slab or, on a miss, host memory is booked)
    sent: bool = False  # its D2H is issued
    restored: bool = False
    released: bool = False
    waited: bool = True  # the compute stream has waited for its restore (or there was none)
    host: Tensor | None = None  # its bytes off the device: a slab's view, or unpinned memory
    slab: Any = None
    spill_done: Any = None
    restore_done: Any = None
    checksum: int | None = None


@dataclass(eq=False, slots=True)
class _SavedRef:
    group: _Group
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the unit's
    boundary: int  # index of the forward layer boundary it was saved under
    whole: bool  # the unit itself (its geometry): unpack returns the unit without a view


@dataclass(eq=False, slots=True)
class _Held:
    tensor: Tensor


@dataclass(eq=False, slots=True)
class _WeightRef:
    handle: Hashable


@dataclass
class _StepCounts:
    activations_saved: int = 0
    spilled: int = 0
    restored: int = 0
    spill_bytes: int = 0
    restore_bytes: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    weight_handles: int = 0
    held: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    finalize_wait_s: float = 0.0
    saved_peak_bytes: int = 0
    vram_peak_bytes: int = 0


@dataclass
class _StepRecord:
    step: int
    counts: _StepCounts
    stalls: list  # (start, end) timing events around compute-stream waits on copies
    summary: dict | None = None  # the telemetry dict, once read


class ActivationOffloader:
    """Saved-tensor hooks that carry out an activation policy (module docstring).

    `policy` must be the one `build_activation_policy(act_cfg, num_layers)`
    builds from the same `act_cfg`: the slabs here mirror its bookings.
    `log` is every decision carried out in the last `keep_steps` steps (None:
    all; the policy's log and history and `telemetry()` are kept as long);
    `questions` the current (or last) step's questions, which `replay` puts to
    a bare policy.
    """

    def __init__(self, policy: ActivationPolicy, act_cfg: Any, device: torch.device | str = "cuda", *,
                 weights: ManagedWeights | None = None, keep_steps: int | None = KEEP_STEPS):
        expected = _POLICY_OF_MODE.get(act_cfg.mode)
        if expected is None:
            raise ConfigError(f"activations.mode={act_cfg.mode!r}: the offloader carries out "
                              f"{' or '.join(_POLICY_OF_MODE)} mode; with mode off run without it")
        if not isinstance(policy, expected):
            raise ExecutorError(f"the policy is a {type(policy).__name__} but activations.mode={act_cfg.mode}; "
                                "build it with build_activation_policy(act_cfg, num_layers) from the same config")
        validate_caps(act_cfg)
        if keep_steps is not None and keep_steps < 1:
            raise ExecutorError(f"keep_steps={keep_steps}: keep at least 1 step of decisions (None keeps all)")
        self.policy = policy
        self._unpacking: _Group | None = None  # the group whose unpack the policy is answering
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ExecutorError("activation offload on cuda needs a CUDA device; use device='cpu' "
                                    "to exercise it on the host")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._copies: _HostCopies | _CudaCopies = _CudaCopies(self.device)
        elif self.device.type == "cpu":
            self._copies = _HostCopies()
        else:
            raise ExecutorError(f"activation offload runs on cuda or cpu, not {self.device.type}")
        self.weights = weights
        self.spill_by_group = act_cfg.mode == "sync"
        self.max_d2h = int(act_cfg.max_inflight_d2h)
        self.max_h2d = int(act_cfg.max_inflight_h2d)
        self.debug_checksums = bool(act_cfg.debug_checksums)
        pool = act_cfg.pool
        self.slabs = SlabPool([mb_to_bytes(s) for s in pool.class_sizes_mb], list(pool.slabs_per_class),
                              pin=self.device.type == "cuda")
        self.log: list[Decision] = []
        self.questions: list[Question] = []
        self._records: list[_StepRecord] = []
        self.keep_steps = keep_steps
        self._step = -1
        self._in_step = False
        self._broken: str | None = None
        self._warned_contiguous = False
        self._clear_step_state()

    # -- the public seams: steps and layer boundaries -----------------------------

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step: run its forward and its backward inside."""
        if self._in_step:
            raise ExecutorError("step() inside a step of the same offloader; run steps one after another")
        self._check_alive()
        self._start_step()
        # No cyclic GC inside the step (engine/gc_pause.py): the hooks' bookkeeping
        # set off collections costing 80 ms a CPU keep-all step where the plain
        # step spends 1 ms in GC (benchmarks/train_bench.py).
        try:
            with paused_gc():
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
                self._end_step()
        except BaseException as err:
            self._break(f"{type(err).__name__}: {err}")
            raise
        finally:
            self._in_step = False

    def on_kernel(self, name: str, layer: int) -> None:
        """Forward: spec kernel `name` of `layer` (-1 outside the blocks) runs next.
        Its saved tensors are named `{name}/t{n}`; a change of layer is a boundary."""
        self._enter_forward(layer)
        self._kernel = name
        self._kernel_saves = 0

    def enter_layer(self, layer: int) -> int:
        """Forward: the model enters `layer`; later saves are named `t{n}` and carry
        this layer. Returns the index of the boundary (for `layer_boundary`)."""
        self._enter_forward(layer)
        self._kernel = None
        return len(self._path) - 1

    def layer_hooks(self, layers: Mapping[nn.Module, int]) -> list[RemovableHandle]:
        """Forward pre-hooks that enter each module's layer; remove them when done."""
        def hook_for(layer: int):
            def enter(_module: nn.Module, _args: Any) -> None:
                self.enter_layer(layer)
            return enter

        return [m.register_forward_pre_hook(hook_for(layer)) for m, layer in layers.items()]

    def layer_backward_done(self, boundary: int) -> None:
        """Backward has finished everything under forward boundary `boundary`."""
        self._check_alive()
        self._begin_backward()
        self._backward_to(max(boundary - 1, 0))

    # -- telemetry and state -------------------------------------------------------

    def telemetry(self) -> list[dict]:
        """One dict per finished step (reading stall times waits for that step's copies)."""
        for r in self._records:
            if r.summary is None:
                r.summary = self._summary(r)
        return [r.summary for r in self._records]

    @staticmethod
    def _summary(r: _StepRecord) -> dict:
        c = r.counts
        stalls = []
        for start, end in r.stalls:
            end.synchronize()
            stalls.append(start.elapsed_time(end))
        stalls = [ms for ms in stalls if ms >= STALL_MIN_MS]
        return {
            "step": r.step,
            "activations_saved": c.activations_saved,
            "kept": c.activations_saved - c.spilled,
            "spilled": c.spilled,
            "restored": c.restored,
            "spill_bytes": c.spill_bytes,
            "restore_bytes": c.restore_bytes,
            "stall_time_ms": sum(stalls),
            "stall_count": len(stalls),
            "pool_hits": c.pool_hits,
            "pool_misses": c.pool_misses,
            "vram_peak_mb": c.vram_peak_bytes / MB,
            "saved_peak_mb": c.saved_peak_bytes / MB,
            "weight_handles": c.weight_handles,
            "held": c.held,
            "d2h_bytes": c.d2h_bytes,
            "h2d_bytes": c.h2d_bytes,
            "finalize_wait_ms": c.finalize_wait_s * 1e3,
        }

    @property
    def device_bytes(self) -> int:
        """Logical bytes of saved activations on the device now (held by this offloader)."""
        return self._device_bytes

    @property
    def off_device_bytes(self) -> int:
        """Logical bytes of saved activations that are off the device now."""
        return sum(g.nbytes for g in self._by_name.values() if g.device is None and not g.released)

    def host_copy(self, name: str) -> Tensor:
        """TEST HOOK: the host bytes (uint8) holding spilled group `name`, once its copy has
        landed; writing into them corrupts what backward gets back (debug_checksums catch it)."""
        g = self._by_name[name]
        if g.host is None or not g.sent:
            raise ExecutorError(f"{name} has no host copy (kept, not yet offloaded, or released)")
        self._copies.wait_host(g.spill_done)
        return g.host

    def close(self) -> None:
        """Wait for every copy and give the slab pool back."""
        if self._in_step:
            raise ExecutorError("close() inside a step; finish the step first")
        self._copies.synchronize()
        self.slabs.close()

    def __enter__(self) -> ActivationOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps ---------------------------------------------------------------------

    def _start_step(self) -> None:
        self._in_step = True
        self._step += 1
        self.questions = []
        if self.keep_steps is not None:
            keep = self.keep_steps - 1  # and the step starting now
            keep_last_steps(self.log, keep)
            if self.policy.log is not self.log:
                keep_last_steps(self.policy.log, keep)
            del self.policy.history[:len(self.policy.history) - keep]
            del self._records[:len(self._records) - keep]
        self._clear_step_state()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _clear_step_state(self) -> None:
        self._counts = _StepCounts()
        self._stalls: list = []
        self._groups: dict[Hashable, tuple[weakref.ref, _Group]] = {}
        self._by_name: dict[str, _Group] = {}
        self._booked: dict[int, list[_Group]] = {}  # sync mode: booked groups by layer
        self._d2h: deque[_Group] = deque()
        self._h2d: deque[_Group] = deque()
        self._device_bytes = 0
        self._path: list[int] = []  # layers of the forward's boundaries, in order
        self._boundary: tuple[str, int] | None = None
        self._bwd_at = -1  # index into _path of the backward's current boundary
        self._in_backward = False
        self._kernel: str | None = None
        self._kernel_saves = 0
        self._saves = 0

    def _end_step(self) -> None:
        if self._path:
            self._begin_backward()
            self._backward_to(0)
        if self._boundary is not None and self._boundary[1] >= 0:
            self._ask(("layer_end", *self._boundary))
        pending = [g for g in self._by_name.values() if g.unpacked == 0]
        if pending:
            names = ", ".join(f"{g.name} (layer {g.layer})" for g in pending[:3])
            raise ExecutorError(
                f"step {self._step} ended with {len(pending)} saved tensors that backward never used "
                f"({names}...); run loss.backward() inside `with offloader.step():`, on a loss that "
                "depends on every output saved for it")
        self._ask(("step_end",))
        c = self._counts
        if self.device.type == "cuda":
            c.vram_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            c.vram_peak_bytes = c.saved_peak_bytes
        self._records.append(_StepRecord(self._step, c, self._stalls))
        self._clear_step_state()

    def _break(self, reason: str) -> None:
        """After a failure: wait for the copies and drop the step's tensors; the
        policy's books no longer match, so the offloader refuses further steps."""
        self._broken = self._broken or reason
        self._copies.synchronize()
        self._clear_step_state()

    def _check_alive(self) -> None:
        if self._broken:
            raise ExecutorError(f"this activation offloader stopped after an earlier failure ({self._broken}); "
                                "create a new one (and a new policy)")

    # -- layer boundaries ----------------------------------------------------------

    def _enter_forward(self, layer: int) -> None:
        if not self._in_step:
            raise ExecutorError("a forward layer or kernel outside a step; run the forward inside "
                                "`with offloader.step():`")
        if self._in_backward:
            raise ExecutorError(f"forward entered layer {layer} after backward began in step {self._step}; "
                                "run one forward, then one backward, per step")
        if self._boundary == ("fwd", layer):
            return
        self._cross("fwd", layer)
        self._path.append(layer)

    def _cross(self, phase: str, layer: int) -> None:
        # As the simulator's host thread: end the previous layer, then start the new one.
        if self._boundary is not None and self._boundary[1] >= 0:
            self._ask(("layer_end", *self._boundary))
        if layer >= 0:
            self._ask(("layer_start", phase, layer))
        self._boundary = (phase, layer)

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._kernel = None
        if not self._path:
            return
        self._bwd_at = len(self._path) - 1
        self._cross("bwd", self._path[-1])

    def _backward_to(self, index: int) -> None:
        while self._bwd_at > index:
            self._bwd_at -= 1
            self._cross("bwd", self._path[self._bwd_at])

    # -- the hooks -----------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        # A LoRA step of 8 LTX-2 blocks saves ~2000 tensors: every microsecond
        # here is ~2 ms a step when the host is the bottleneck.
        if self._broken:
            self._check_alive()
        if self._in_backward:
            raise ExecutorError("a tensor was saved during backward (double backward, or recomputation); "
                                "the activation offloader handles one forward then one backward per step")
        if self.weights is not None:
            h = self.weights.handle(t)
            if h is not None:
                self._counts.weight_handles += 1
                return _WeightRef(h)
        root = t._base if t._base is not None else t
        # issubclass, not isinstance: Parameter's __instancecheck__ looks up an
        # attribute that plain tensors lack (a raised AttributeError, tens of us a save).
        if ((root.is_leaf and (root.requires_grad or issubclass(type(root), nn.Parameter)))
                or t.device != self.device or t.layout != torch.strided):
            self._counts.held += 1
            return _Held(t)
        ref = self._reference(t, root)
        if self._d2h or self._h2d:
            self._poll()
        return ref

    def _reference(self, t: Tensor, root: Tensor) -> _SavedRef:
        # The unit that moves: the base when it is dense and of the same dtype
        # (views then rebuild over it), else the saved tensor itself.
        through_base = root.dtype == t.dtype and _dense(root)
        size, stride = tuple(t.shape), t.stride()
        key: Hashable = id(root) if through_base else (id(root), size, stride, t.storage_offset(), t.dtype)
        entry = self._groups.get(key)
        if entry is not None and entry[0]() is root:
            g = entry[1]
        else:
            unit = root if through_base else t
            g = self._new_group(unit.detach(), through_base or _dense(t))
            self._groups[key] = (weakref.ref(root), g)
        g.refs += 1
        offset = t.storage_offset() - g.unit_offset
        return _SavedRef(g, size, stride, offset, len(self._path) - 1,
                         size == g.shape and stride == g.stride and not offset)

    def _new_group(self, unit: Tensor, dense: bool) -> _Group:
        if not self._path:
            self._enter_forward(0)  # a model that marks no layers: everything is layer 0
        if self._kernel is not None:
            name = f"{self._kernel}/t{self._kernel_saves}"
            self._kernel_saves += 1
        else:
            name = f"t{self._saves}"
        self._saves += 1
        layer = self._boundary[1]
        g = _Group(name, layer, unit.numel() * unit.element_size(), self._step,
                   unit, unit.storage_offset(), tuple(unit.shape), unit.stride(), unit.dtype, dense)
        self._by_name[name] = g
        self._counts.activations_saved += 1
        self._to_device(g.nbytes)
        self._answer(("save", name, g.nbytes, layer), self.policy.on_save(name, g.nbytes, layer))
        return g

    def _unpack(self, ref: Any) -> Tensor:
        if isinstance(ref, _Held):
            return ref.tensor
        if isinstance(ref, _WeightRef):
            return self.weights.fetch(ref.handle)
        if self._broken:
            self._check_alive()
        g = ref.group
        if g.step != self._step or not self._in_step:
            raise ExecutorError(f"backward used {g.name}, saved in step {g.step}, after that step ended; "
                                "run loss.backward() inside `with offloader.step():`")
        if not self._in_backward:
            self._begin_backward()
        if ref.boundary > self._bwd_at:
            raise ExecutorError(
                f"schedule divergence: backward used {g.name} (saved under layer {self._path[ref.boundary]}) "
                f"after leaving that layer's backward (now at layer {self._boundary[1]}); backward must visit "
                "layers in reverse forward order: mark layers with on_kernel / layer_boundary in the order "
                "the forward runs them")
        if ref.boundary < self._bwd_at:
            self._backward_to(ref.boundary)
        if g.unpacked == g.refs:
            raise ExecutorError(f"backward used {g.name} more often than it was saved: a second backward over "
                                "the same graph (retain_graph=True) is not supported under activation offload")
        if g.unpacked == 0:
            self._unpacking = g
            self._answer(("unpack", g.name), self.policy.on_unpack(g.name))
            self._unpacking = None
        g.unpacked += 1
        if g.device is None:
            raise ExecutorError(f"policy bug: {g.name} was released without a restore after its spill")
        # Group tensors are detached: nothing here records autograd history.
        if not g.waited:
            self._stalled(self._copies.use(g.device, g.restore_done))
            g.waited = True
            if self.debug_checksums:
                self._verify(g)
        out = g.device
        if g.dense and not ref.whole:
            out = out.as_strided(ref.size, ref.stride, out.storage_offset() + ref.offset)
        if g.unpacked == g.refs:
            self._leave_device(g)  # its last saved reference: the device copy goes with it
        if self._d2h or self._h2d:
            self._poll()
        return out

    # -- carrying out decisions ----------------------------------------------------

    def _ask(self, question: Question) -> None:
        self._answer(question, ask(self.policy, question))

    def _answer(self, question: Question, decisions: list[Decision]) -> None:
        """Record `question` and carry out the policy's `decisions` on it, in order."""
        self.questions.append(question)
        for d in decisions:
            self._carry_out(d)
            self.log.append(d)

    def _carry_out(self, d: Decision) -> None:
        a = d.action
        if a == "keep":
            return
        if a in ("spill", "miss"):
            g = self._by_name[d.target]
            self._book(g, d.detail if a == "spill" else None)
            if not self.spill_by_group:
                self._spill(g)
                self._leave_device(g)  # recorded on the spill stream: freed once the copy has read it
        elif a == "offload_group":
            for g in self._booked.get(d.detail, ()):
                if not g.sent and not g.released:
                    self._spill(g)
        elif a == "wait_offload":
            for g in self._booked.get(d.detail, ()):
                if not g.released and not g.restored and g.device is not None:
                    self._stalled(self._copies.wait(g.spill_done))  # later compute work runs after the D2H
                    self._leave_device(g)
        elif a == "restore":
            self._restore(self._by_name[d.target])
        elif a == "reload_group":
            for g in self._booked.get(d.detail, ()):
                if not g.released and not g.restored:
                    self._restore(g)
        elif a == "release":
            self._release(self._by_name[d.target])
        else:
            raise ExecutorError(f"activation decision {a!r} is not one the executor knows; "
                                "add it to engine/executor/activations.py")

    def _book(self, g: _Group, size_class: int | None) -> None:
        c = self._counts
        g.booked = True
        c.spilled += 1
        c.spill_bytes += g.nbytes
        if size_class is None:
            g.host = torch.empty(g.nbytes, dtype=torch.uint8)  # a miss: unpinned host memory
            c.pool_misses += 1
        else:
            g.slab = self.slabs.take(size_class)
            g.host = g.slab.data[:g.nbytes]
            c.pool_hits += 1
        if self.spill_by_group:
            self._booked.setdefault(g.layer, []).append(g)

    def _spill(self, g: _Group) -> None:
        if not g.dense:
            if not self._warned_contiguous:
                self._warned_contiguous = True
                warnings.warn(
                    f"saved tensor {g.name} (layer {g.layer}) has no base to spill through and is not dense "
                    f"(shape {tuple(g.device.shape)}, stride {g.device.stride()}); it is made contiguous on "
                    "the compute stream before its spill, and backward gets the contiguous copy "
                    "(shown once per offloader)", stacklevel=2)
            g.device = g.device.contiguous()
            g.stride = g.device.stride()
        self._make_room(self._d2h, self.max_d2h)
        src = _bytes(g.device)
        if self.debug_checksums:
            g.checksum = zlib.crc32(src.cpu().numpy())
        after = [g.slab.last_read] if g.slab is not None and g.slab.last_read is not None else []
        g.spill_done = self._copies.spill(g.host, src, after)
        g.sent = True
        self._counts.d2h_bytes += g.nbytes
        self._d2h.append(g)

    def _restore(self, g: _Group) -> None:
        c = self._counts
        g.restored = True
        c.restored += 1
        c.restore_bytes += g.nbytes
        if g.device is not None:
            # a sync group whose offload was not waited yet: it never left
            return
        self._make_room(self._h2d, self.max_h2d)
        g.device, g.restore_done = self._copies.restore(g.shape, g.stride, g.dtype, g.host, g.spill_done,
                                                        on_demand=g is self._unpacking)
        g.waited = False
        c.h2d_bytes += g.nbytes
        self._to_device(g.nbytes)
        self._h2d.append(g)

    def _release(self, g: _Group) -> None:
        g.released = True
        if g.slab is not None:
            self.slabs.give_back(g.slab, g.restore_done)
        g.slab = None
        g.host = None

    def _stalled(self, wait: tuple[Any, Any] | None) -> None:
        if wait is not None:
            self._stalls.append(wait)

    def _leave_device(self, g: _Group) -> None:
        g.device = None
        self._device_bytes -= g.nbytes

    def _to_device(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        c = self._counts
        c.saved_peak_bytes = max(c.saved_peak_bytes, self._device_bytes)

    def _poll(self) -> None:
        """Forget copies that have completed (they no longer count against the caps)."""
        while self._d2h and self._copies.done(self._d2h[0].spill_done):
            self._d2h.popleft()
        while self._h2d and self._copies.done(self._h2d[0].restore_done):
            self._h2d.popleft()

    def _make_room(self, queue: deque, cap: int) -> None:
        """At the in-flight cap, finalize the oldest copy inline (the host waits for it)."""
        self._poll()
        while len(queue) >= cap:
            g = queue.popleft()
            start = time.perf_counter()
            self._copies.wait_host(g.spill_done if queue is self._d2h else g.restore_done)
            self._counts.finalize_wait_s += time.perf_counter() - start

    def _verify(self, g: _Group) -> None:
        if g.checksum is None:
            return
        got = zlib.crc32(_bytes(g.device).cpu().numpy())
        if got != g.checksum:
            raise ExecutorError(
                f"checksum mismatch for saved tensor {g.name} (layer {g.layer}): CRC32 {g.checksum:#010x} at "
                f"spill, {got:#010x} after restore; its host copy was corrupted between the two "
                "(a slab reused too early, or memory errors); rerun with activations.debug_checksums=true "
                "and report this")


# ----- models: kernels and layer boundaries


class KernelTracking:
    """A WeightSource that tells the offloader which spec kernel runs next, so
    saved tensors carry the kernel's name and layer, and layer boundaries reach
    the policy where the simulator asks them (engine.models calls fetch(i) once
    per kernel, before its math)."""

    def __init__(self, source: Any, spec: ModelSpec, offloader: ActivationOffloader):
        self.source = source
        self.kernels = spec.kernels
        self.offloader = offloader

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        k = self.kernels[kernel_index]
        self.offloader.on_kernel(k.name, k.layer)
        return self.source.fetch(kernel_index)


class _LayerBoundary(torch.autograd.Function):
    """Identity whose forward enters a layer and whose backward says the layer's backward is done."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: int, offloader: ActivationOffloader) -> Tensor:
        ctx.offloader = offloader
        ctx.boundary = offloader.enter_layer(layer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.offloader.layer_backward_done(ctx.boundary)
        return grad, None, None


def layer_boundary(x: Tensor, layer: int, offloader: ActivationOffloader) -> Tensor:
    """Call on a layer's input as the layer starts: `x = layer_boundary(x, i, off)`.

    Forward: the following saves belong to `layer`. Backward: once the gradient
    of `x` is computed (the layer's backward is done), the policy hears
    on_layer_end("bwd", layer), which is when sync mode issues its reloads."""
    return _LayerBoundary.apply(x, layer, offloader)

