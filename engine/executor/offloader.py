"""Activation spill on the real clock: saved-tensor hooks that carry out the
activation policy (watermark or sync dict, engine/policy) with copies beside
the compute stream (engine/executor/copies.py). It asks the policy through
engine/policy/schedule.py's StepSchedule, as the simulator's launcher does, so
both drivers put the same questions in the same order.

    off = ActivationOffloader(policy, cfg.activations, "cuda", weights=ResidentWeights(w))
    with off.step():                      # one training step: forward + backward
        out = forward(spec, KernelTracking(source, spec, off), inputs, lora)
        loss_of(out).backward()
    off.telemetry()[-1]                   # one dict per step
    off.close()

(ResidentWeights, KernelTracking and layer_boundary: engine/executor/model_hooks.py.)

What autograd saves goes through the pack hook:
- a trainable leaf (nn.Parameter, a LoRA adapter: any leaf that requires grad)
  is held as it is: the optimizer holds it anyway, a spill would free nothing;
- a managed weight (`ManagedWeights.handle` answers) is held as a handle and
  fetched again on unpack: autograd must not hold memory the weight residency
  policy may evict;
- a tensor under the policy's min_tensor_bytes (its base's bytes, when it
  moves through its base) is held as it is too, and the policy never hears of
  it (engine/policy/schedule.py): it would never spill, and asking costs;
- everything else is an activation. Saved tensors are grouped by storage: a
  view joins its base's group (q, k, v views of one qkv go out once, through
  the base, and come back as views), a tensor saved twice joins its own group.
  The policy is asked once per group (`on_save`), with the group's bytes and
  the layer the model is in, and its answers apply to whole groups.

The policy's answers, carried out (engine/executor/saved_groups.py):
- keep           hold the device tensor;
- spill / miss   book a slab of the size class (`detail`) / unpinned host
                 memory; watermark mode copies it out at once (D2H on the
                 spill stream, after the compute stream's work so far) and
                 drops the device tensor at once: it is recorded on the spill
                 stream, so the allocator reuses its memory only after the
                 copy has read it, as the simulator frees it when the D2H
                 ends, and the host never waits for the copy; sync mode waits
                 for its layer's offload_group;
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

Layer boundaries reach the policy as the schedule orders them (on_layer_end of
the previous layer, then on_layer_start): in forward from `on_kernel`
(spec-built models, through KernelTracking) or `enter_layer` (layer_boundary,
layer_hooks: any model); in backward, which visits the forward's boundaries in
reverse, from the first unpack of a tensor saved under an earlier boundary, or
from a `layer_boundary` marker's backward, whichever comes first.

The step's policy figures (saved, spilled, restored, pool hits ...) are the
policy's own counters (`policy.history`); the offloader adds what only it can
measure: stalls, copied bytes, inline waits, peaks, handles and held tensors.
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Mapping, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from engine.errors import ConfigError, ExecutorError
from engine.executor.copies import Copies, CpuCopies, CudaCopies
from engine.executor.pinned_pool import SlabPool
from engine.executor.saved_groups import SavedGroup, SavedGroups, StepMeasures
from engine.gc_pause import paused_gc
from engine.policy import KEEP_STEPS, ActivationPolicy, Decision, StepCounters, keep_last, keep_last_steps
from engine.policy.activations import WatermarkPolicy
from engine.policy.saved import mb_to_bytes, validate_caps
from engine.policy.schedule import Question, StepSchedule, ask
from engine.policy.sync import SyncDictPolicy
from engine.units import MB

Tensor = torch.Tensor
# A compute-stream wait on a restore shorter than this is the two timing
# events' own cost, not a stall.
STALL_MIN_MS = 0.01

_POLICY_OF_MODE = {"watermark": WatermarkPolicy, "sync": SyncDictPolicy}


def held_as_is(t: Tensor, root: Tensor, device: torch.device) -> bool:
    """A saved tensor that is not an activation to spill: a trainable leaf or a parameter
    (`root`: its base, or itself), or one not dense on the compute device."""
    # issubclass, not isinstance: Parameter's __instancecheck__ looks up an
    # attribute that plain tensors lack, and the raised AttributeError is slow.
    return ((root.is_leaf and (root.requires_grad or issubclass(type(root), nn.Parameter)))
            or t.device != device or t.layout != torch.strided)


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


@dataclass(eq=False, slots=True)
class _SavedRef:
    group: SavedGroup
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
class _StepRecord:
    step: int
    counters: StepCounters  # the policy's
    measures: StepMeasures
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
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ExecutorError("activation offload on cuda needs a CUDA device; use device='cpu' "
                                    "to exercise it on the host")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._copies: Copies = CudaCopies(self.device)
        elif self.device.type == "cpu":
            self._copies = CpuCopies()
        else:
            raise ExecutorError(f"activation offload runs on cuda or cpu, not {self.device.type}")
        self.weights = weights
        pool = act_cfg.pool
        self.slabs = SlabPool([mb_to_bytes(s) for s in pool.class_sizes_mb], list(pool.slabs_per_class),
                              pin=self.device.type == "cuda")
        self._saved = SavedGroups(self._copies, self.slabs, act_cfg)
        self._min_bytes = policy.min_tensor_bytes
        self.log: list[Decision] = []
        self.questions: list[Question] = []
        self._records: list[_StepRecord] = []
        self.keep_steps = keep_steps
        self._step = -1
        self._in_step = False
        self._broken: str | None = None
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
        # would set off collections that cost more than the step's own work.
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
        self._timed("kernel", self._enter_forward, layer)
        self._kernel = name
        self._kernel_saves = 0

    def enter_layer(self, layer: int) -> int:
        """Forward: the model enters `layer`; later saves are named `t{n}` and carry
        this layer. Returns the index of the boundary (for `layer_boundary`)."""
        self._timed("kernel", self._enter_forward, layer)
        self._kernel = None
        return len(self._path) - 1

    def _timed(self, hook: str, fn: Callable[[Any], Any], arg: Any) -> Any:
        """fn(arg), its host time less any finalize wait inside kept under `hook` (HOOKS):
        what the simulator charges the host per hook call (hardware offload_kernel_us,
        pack_hook_us, unpack_hook_us)."""
        m = self._saved.measures
        start, waited = time.perf_counter_ns(), m.finalize_wait_s
        try:
            return fn(arg)
        finally:
            cell = m.hooks[hook]
            cell[0] += 1
            cell[1] += time.perf_counter_ns() - start - round((m.finalize_wait_s - waited) * 1e9)

    def layer_hooks(self, layers: Mapping[nn.Module, int]) -> list[RemovableHandle]:
        """Forward pre-hooks that enter each module's layer; remove them when done.
        A layer run again in backward is activation checkpointing's recompute (its
        saves go through the checkpoint's own hooks): it enters no layer."""
        def hook_for(layer: int):
            def enter(_module: nn.Module, _args: Any) -> None:
                if not self._in_backward:
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
        c, m = r.counters, r.measures
        stalls = []
        for start, end in r.stalls:
            end.synchronize()
            stalls.append(start.elapsed_time(end))
        stalls = [ms for ms in stalls if ms >= STALL_MIN_MS]
        return {  # Activation Stagehand's fields first, in its order; then ours
            "activations_saved": c.saved,
            "activations_kept": c.kept,
            "activations_spilled": c.spilled,
            "activations_restored": c.restored,
            "spill_bytes": c.spill_bytes,
            "restore_bytes": c.restore_bytes,
            "stall_time_ms": sum(stalls),
            "stall_count": len(stalls),
            "pool_hits": c.pool_hits,
            "pool_misses": c.pool_misses,
            "vram_peak_mb": m.vram_peak_bytes / MB,
            "step": r.step,
            "saved_peak_mb": m.saved_peak_bytes / MB,
            "weight_handles": m.weight_handles,
            "held": m.held,
            "d2h_bytes": m.d2h_bytes,
            "h2d_bytes": m.h2d_bytes,
            "finalize_wait_ms": m.finalize_wait_s * 1e3,
            # The hooks' host time a call, finalize waits left out (hardware offload_kernel_us,
            # pack_hook_us, unpack_hook_us).
            **{f"{hook}_hook_calls": n for hook, (n, _) in m.hooks.items()},
            **{f"{hook}_hook_us": ns / n / 1e3 if n else 0.0 for hook, (n, ns) in m.hooks.items()},
        }

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes of this offloader's slab pool."""
        return self.slabs.pinned_bytes

    @property
    def device_bytes(self) -> int:
        """Logical bytes of saved activations on the device now (held by this offloader)."""
        return self._saved.device_bytes

    @property
    def off_device_bytes(self) -> int:
        """Logical bytes of saved activations that are off the device now."""
        return self._saved.off_device_bytes

    def host_copy(self, name: str) -> Tensor:
        """TEST HOOK: the host bytes (uint8) holding spilled group `name`, once its copy has
        landed; writing into them corrupts what backward gets back (debug_checksums catch it)."""
        return self._saved.host_copy(name)

    def close(self) -> None:
        """Wait for every copy and give the slab pool back."""
        if self._in_step:
            raise ExecutorError("close() inside a step; finish the step first")
        self._saved.synchronize()
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
            keep_last(self.policy.history, keep)
            keep_last(self._records, keep)
        self._clear_step_state()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _clear_step_state(self) -> None:
        self._saved.new_step()
        # storage key -> (the saved tensor's base, its group): a base saved again joins its group
        self._by_storage: dict[Hashable, tuple[weakref.ref, SavedGroup | None]] = {}  # None: held unasked
        self._path: list[int] = []  # layers of the forward's boundaries, in order
        self._schedule = StepSchedule(self._min_bytes)
        self._bwd_at = -1  # index into _path of the backward's current boundary
        self._in_backward = False
        self._kernel: str | None = None
        self._kernel_saves = 0
        self._saves = 0

    def _end_step(self) -> None:
        backward_ran = self._in_backward
        if self._path:
            self._begin_backward()
            self._backward_to(0)
        pending = [g for g in self._saved.by_name.values() if g.unpacked == 0]
        if pending and not backward_ran:
            names = ", ".join(f"{g.name} (layer {g.layer})" for g in pending[:3])
            raise ExecutorError(
                f"step {self._step} ended with {len(pending)} saved tensors that backward never used, and "
                f"no backward ran in it ({names}...); run loss.backward() inside `with offloader.step():`")
        for g in pending:  # saved for a branch the loss does not reach (an output the module drops)
            self._drop(g)
        *last_layer_end, step_end = self._schedule.end()
        for q in last_layer_end:
            self._ask(q)
        self._ask(step_end)
        m = self._saved.measures
        if self.device.type == "cuda":
            m.vram_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            m.vram_peak_bytes = m.saved_peak_bytes
        self._records.append(_StepRecord(self._step, self.policy.history[-1], m, self._saved.stalls))
        self._clear_step_state()

    def _drop(self, g: SavedGroup) -> None:
        """Backward is over and never used `g` (saved for a branch the loss does not reach:
        autograd freed it unused). The policy hears it unpacked, as a recorded trace has
        backward use every saved tensor, so its books and its slab are freed (a spill the
        policy restores on unpack is restored first); then its device copy goes."""
        self._ask(self._schedule.unpack(g.name))
        if g.device is not None:
            self._saved.use(g)
            self._saved.leave_device(g)

    def _break(self, reason: str) -> None:
        """After a failure: wait for the copies and drop the step's tensors; the
        policy's books no longer match, so the offloader refuses further steps."""
        self._broken = self._broken or reason
        self._saved.synchronize()
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
        if self._schedule.boundary == ("fwd", layer):
            return
        self._cross("fwd", layer)
        self._path.append(layer)

    def _cross(self, phase: str, layer: int) -> None:
        for q in self._schedule.enter(phase, layer):
            self._ask(q)

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
        return self._timed("pack", self._save, t)

    def _unpack(self, ref: Any) -> Tensor:
        return self._timed("unpack", self._use, ref)

    def _save(self, t: Tensor) -> Any:
        # Runs for every tensor autograd saves (thousands a step): kept lean.
        if self._broken:
            self._check_alive()
        if self._in_backward:
            raise ExecutorError("a tensor was saved during backward (double backward, or recomputation); "
                                "the activation offloader handles one forward then one backward per step")
        if self.weights is not None:
            h = self.weights.handle(t)
            if h is not None:
                self._saved.measures.weight_handles += 1
                return _WeightRef(h)
        root = t._base if t._base is not None else t
        if held_as_is(t, root, self.device):
            self._saved.measures.held += 1
            return _Held(t)
        ref = self._reference(t, root)
        self._saved.poll()
        return ref

    def _reference(self, t: Tensor, root: Tensor) -> _SavedRef | _Held:
        # The unit that moves: the base when it is dense and of the same dtype
        # (views then rebuild over it), else the saved tensor itself.
        through_base = root.dtype == t.dtype and _dense(root)
        size, stride = tuple(t.shape), t.stride()
        key: Hashable = id(root) if through_base else (id(root), size, stride, t.storage_offset(), t.dtype)
        entry = self._by_storage.get(key)
        if entry is not None and entry[0]() is root:
            g = entry[1]
        else:
            unit = root if through_base else t
            if self._schedule.asks(unit.numel() * unit.element_size()):
                g = self._new_group(unit.detach(), through_base or _dense(t))
            else:  # held unasked; it still takes its name, so later ones keep the names a trace gives them
                g = None
                self._next_name()
            self._by_storage[key] = (weakref.ref(root), g)
        if g is None:
            self._saved.measures.held += 1
            return _Held(t)
        g.refs += 1
        offset = t.storage_offset() - g.unit_offset
        return _SavedRef(g, size, stride, offset, len(self._path) - 1,
                         size == g.shape and stride == g.stride and not offset)

    def _next_name(self) -> str:
        if not self._path:
            self._enter_forward(0)  # a model that marks no layers: everything is layer 0
        if self._kernel is not None:
            name = f"{self._kernel}/t{self._kernel_saves}"
            self._kernel_saves += 1
        else:
            name = f"t{self._saves}"
        self._saves += 1
        return name

    def _new_group(self, unit: Tensor, dense: bool) -> SavedGroup:
        name = self._next_name()
        layer = self._schedule.boundary[1]
        g = SavedGroup(name, layer, unit.numel() * unit.element_size(), self._step,
                   unit, unit.storage_offset(), tuple(unit.shape), unit.stride(), unit.dtype, dense)
        self._saved.add(g)
        self._ask(self._schedule.save(name, g.nbytes, layer))
        return g

    def _use(self, ref: Any) -> Tensor:
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
                f"after leaving that layer's backward (now at layer {self._schedule.boundary[1]}); backward must visit "
                "layers in reverse forward order: mark layers with on_kernel / layer_boundary in the order "
                "the forward runs them")
        if ref.boundary < self._bwd_at:
            self._backward_to(ref.boundary)
        if g.unpacked == g.refs:
            raise ExecutorError(f"backward used {g.name} more often than it was saved: a second backward over "
                                "the same graph (retain_graph=True) is not supported under activation offload")
        if g.unpacked == 0:
            self._saved.unpacking = g
            self._ask(self._schedule.unpack(g.name))
            self._saved.unpacking = None
        g.unpacked += 1
        if g.device is None:
            raise ExecutorError(f"policy bug: {g.name} was released without a restore after its spill")
        # Group tensors are detached: nothing here records autograd history.
        self._saved.use(g)
        out = g.device
        if g.dense and not ref.whole:
            out = out.as_strided(ref.size, ref.stride, out.storage_offset() + ref.offset)
        if g.unpacked == g.refs:
            self._saved.leave_device(g)  # its last saved reference: the device copy goes with it
        self._saved.poll()
        return out

    # -- asking the policy ---------------------------------------------------------

    def _ask(self, question: Question) -> None:
        """Record `question`, put it to the policy, and carry out its answers in order."""
        self.questions.append(question)
        for d in ask(self.policy, question):
            self._saved.carry_out(d)
            self.log.append(d)
