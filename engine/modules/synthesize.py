"""A real module's trace without a GPU: its forward run on the meta device, each
kernel priced from its op census.

`python -m engine model=flux_diffusers budget=12000` on a CPU predicts the diffusers
FLUX.1-dev as the main command predicts a spec model. The module is built from the
model config with every parameter and buffer on the meta device (nothing allocated,
no checkpoint read), its kernels found as offload finds them
(engine/modules/kernels.py), its inputs made by the config's builder, and one
forward recorded as the recorder's first forward is (`record_order`): the access
order, and each position's op census (engine/modules/census.py). A record's
compute time is its cores by op and shape, its memory passes at the kernel table's
pass cost and its ops' launch gaps at its ModuleCost, its host time its ops'
(ExecutionTimePredictor.module_kernel_ns, module_host_ns); its weight is the
kernel's packed span, sized as offload packs it (engine/modules/packing.py). The
header carries the bytes the forward holds at its peak beside the streamed weights
(its inputs, the parameters kept resident, its buffers, every live tensor its ops
made), traced in the same forward, and an inference's slowdown under sustained load: the PFLOP/s its
cores run at over its compute, at the ModuleCost's slowdown per PFLOP/s, as recorded
modules' inferences slow. A LoRA step takes the profile's compute_sustained_slowdown: the
fit is of inferences, and recorded LoRA steps slowed less than it says (docs/DESIGN.md).
Values the forward reads off its tensors are taken as the synthesized inputs' masks of ones
give them (engine/modules/meta_values.py: a truth test reads True, a mask selects every
element, its negation none), and an inference's header names where a selection by mask would
hold the host until the device caught up ("host_syncs", as the recorder finds them).

A LoRA training step (workload=train_lora) runs the forward with the adapters
injected (engine/modules/adapters.py; per-block checkpointing when
workload.checkpointing) and autograd on, and logs what each kernel saves as the
recorder does (engine/measure/timing.py SavedStorages); the loss is taken inside,
so what it saves counts with the last kernel, as recorded. Its host is priced per op at
a training step's costs (ModuleCost.host_ns_per_dispatch: the forward's, whose ops
autograd records, for the forward and a checkpointed block's recompute; the backward's
for the backward). Attention on the meta
device is the fused kernel's output and what its backward reads (census.py
`fused_attention`). The backward then runs on the meta device too, counted op by op
as the forward is (census.py `OpCensus.backward`): each op under the kernel whose
output's gradient autograd made last (a kernel's backward starts there, as a
recording's starts at the first tensor of its own that autograd unpacks), so a
kernel's backward record is the ops autograd runs for it, priced as a forward's:
the gradients by their inputs that carry one and the adapters' by their weights as
the matmuls they are, attention's backward at the table's backward rate, the
norms', activations' and casts' backward as the memory passes they make, and
checkpointing's recompute of a block's forward (a block that saved nothing once its
first op had run: the checkpoint holds only its input, saved before that). The
header's peak holds what that recompute and the gradients hold (less the saved
tensors, which the simulator counts), as a recording's does. Where the step runs attention
without cuDNN's kernels, as the CLI's training does unless workload.cudnn_attention
(engine/modes/module_setup.py), its attention forward and backward take the table's
training rates (engine/compute.py TRAINING).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.compute import BACKWARD_FLOPS_FACTOR, core_flops
from engine.kernel_time import ExecutionTimePredictor
from engine.errors import ConfigError, EngineError
from engine.measure.timing import NotedTensors, SavedStorages
from engine.modules.adapters import ALL_LINEAR, TrainingLoss, add_lora, enable_checkpointing
from engine.modules.build import build_module, example_inputs, plain_config
from engine.modules.census import KernelCensus, OpCensus, meta_fused_kernels
from engine.modules.kernels import (GROUPINGS, Recording, buffer_bytes, forward_live_bytes, input_tensors,
                                   kv_cache_tensors, partition, record_order)
from engine.modules.meta_values import MetaValues
from engine.modules.packing import pack_kernels
from engine.policy import AccessOrder
from engine.trace import BACKWARD_SUFFIX, FORMAT, VERSION, KernelRecord, Trace, check_trace, saved_tensors

if TYPE_CHECKING:
    from engine.modules.streamed import StreamedModule

log = logging.getLogger(__name__)

META = torch.device("meta")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class SeenForward:
    """What one forward of a module saw: on the meta device (`meta_forward`), or offload's
    order forward on the device (engine/modules/streamed.py)."""

    recording: Recording  # its access order (unpacked), layers, each position's census, live peak
    order: AccessOrder  # the order packed as offload packs it: one weight a kernel
    resident_bytes: int  # parameters kept resident (outside the kernels, or read outside their own)
    buffer_bytes: int  # the module's buffers, all on the device (kernels.buffer_bytes)
    input_bytes: int
    params: int
    module_class: str
    grouping: str
    saved: SavedStorages | None = None  # a training forward: what each kernel saved for backward
    recomputed: frozenset[int] = frozenset()  # a training forward's positions checkpointing runs again
    backward: tuple[KernelCensus, ...] = ()  # a training step: each position's backward, op by op
    step_live_peak: int = 0  # a training step: the most its forward and backward held live at once
    host_syncs: tuple[int, ...] = ()  # a meta inference: positions its host would wait at (MetaValues)

    @property
    def traced_peak_bytes(self) -> int:
        """What the forward holds at its peak beside the streamed weights: its ops' live
        tensors, its inputs, the parameters kept resident and the buffers. A training step's
        peak over its forward and backward, less the saved tensors (the simulator counts
        those, kept or spilled), as a recording's header counts it."""
        held = self.input_bytes + self.resident_bytes + self.buffer_bytes
        if self.saved is None:
            return self.recording.live_peak + held
        saved = sum(sum(v) for v in self.saved.saved.values())
        return max(0, self.step_live_peak + held - saved)


def seen_forward(streamed: StreamedModule) -> SeenForward:
    """What offload's order forward on the device saw (engine/modules/streamed.py), as a meta
    forward's."""
    module = streamed.module
    cls = type(module)
    return SeenForward(streamed.recording, streamed.order, streamed.resident_bytes, streamed.buffer_bytes,
                       streamed.input_bytes, sum(p.numel() for p in module.parameters()),
                       f"{cls.__module__}.{cls.__qualname__}", streamed.grouping)


def on_meta(model_cfg: Any, workload: Any) -> tuple[nn.Module, dict]:
    """The module `model_cfg` builds, every parameter and buffer on the meta device, and
    its inputs for `workload` there."""
    module = nn.Module.to(build_module(model_cfg), META)
    inputs = example_inputs(model_cfg, module, workload, META)
    if any(not t.is_meta for t in input_tensors(inputs)):
        raise ConfigError(f"model.inputs ({plain_config(model_cfg)['inputs']['_target_']}) made tensors off the meta "
                          "device it was given: make every tensor with device=device")
    return module, inputs


class _Position(TorchDispatchMode):
    """The kernel whose ops run now, counted as the recorder's stamps count it: the last
    kernel entered (-1 before the first); and the tensors saved while each kernel's own
    ops ran. A checkpointed block's ops save none: the checkpoint keeps only the block's
    input, saved before its first op (before the block is entered where the checkpoint
    wraps the module's call, as diffusers' does; after, where it wraps its forward, as
    transformers' does). With a `backward` census, each kernel's outputs that carry a
    gradient start its position there when autograd makes their gradient."""

    def __init__(self, kernels: Sequence[Any], backward: OpCensus | None = None):
        super().__init__()
        self.backward = backward
        self.current = -1
        self.inside = False
        self.op_ran = False
        self.own_saves: dict[int, int] = {}
        self._handles = [h for k in kernels for h in (k.module.register_forward_pre_hook(self._enter),
                                                       k.module.register_forward_hook(self._leave))]

    def _enter(self, module: nn.Module, inputs: Any) -> None:
        self.current += 1
        self.inside, self.op_ran = True, False

    def _leave(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.inside = False
        if self.backward is None:
            return
        position, census = self.current, self.backward
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: census.start(position))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.op_ran = self.op_ran or self.inside
        return func(*args, **(kwargs or {}))

    def saving(self) -> int:
        """The kernel a tensor saved now belongs to."""
        if self.inside and self.op_ran:
            self.own_saves[self.current] = self.own_saves.get(self.current, 0) + 1
        return self.current

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def meta_forward(module: nn.Module, inputs: Any, grouping: str = "block",
                 blocks: Sequence[str] | None = None, training: bool = False) -> SeenForward:
    """One forward of `module` (on the meta device) on `inputs` (a dict of keyword
    arguments, or a tuple of positional ones), its kernels grouped as offload groups them.
    `training`: with autograd on, the trainable parameters (the adapters) kept resident
    and what each kernel saves for backward logged."""
    if grouping not in GROUPINGS:
        raise ConfigError(f"grouping={grouping} picks between recordings of each grouping (mode=record); a "
                          f"synthesized trace takes one: set it (model.grouping) to one of {', '.join(GROUPINGS)}")
    if not all(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise ConfigError(f"this {type(module).__name__} holds tensors off the meta device; a synthesized trace "
                          "reads shapes only: build it under `with torch.device('meta'):` (or "
                          "engine.modules.build.parameters_on_meta()) and move its buffers with .to('meta')")
    if training and not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"this {type(module).__name__} has no trainable parameters: a training step's trace "
                          "needs the adapters (peft's inject_adapter_in_model or get_peft_model) added first")
    kernels, kept = partition(module, grouping, blocks, keep_trainable=training)
    if any(not t.is_meta for t in input_tensors(inputs) + kv_cache_tensors(inputs)):
        raise ConfigError("example_inputs hold tensors off the meta device; make them with device='meta'")
    live, input_bytes = forward_live_bytes(module, inputs)
    saved = SavedStorages({p.untyped_storage()._cdata for p in module.parameters()}, META, by_address=False) \
        if training else None

    outputs = []

    def run() -> Any:
        outputs.append(module(**inputs) if isinstance(inputs, dict) else module(*inputs))
        return outputs[-1]

    cls = type(module)
    backward = OpCensus() if training else None
    position = _Position(kernels, backward)  # inference: only its count of the kernels entered (host syncs)
    truth = MetaValues(lambda: position.current)
    try:
        if training:
            noted = NotedTensors(saved, position.saving)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(noted.pack, noted.unpack), \
                    truth, position:
                loss_fn = TrainingLoss()  # its targets stay on the device all step, as the CLI's do
                losses = []
                # The loss's ops, and what it saves, count with the last kernel, as recorded.
                rec = record_order(module, run, kernels, lambda w, p: None, lambda w, p: None, live,
                                   then=lambda: losses.append(loss_fn(outputs.pop())))
                loss = losses.pop()
            position.remove()  # the backward's recomputation is not a forward
            backward.start(position.current)  # the loss's backward, with the last kernel's
            # The backward: checkpointing recomputes a block and holds its activations.
            with live, meta_fused_kernels(), truth, backward.backward():
                loss.backward()
        else:
            with torch.no_grad(), truth:
                rec = record_order(module, run, kernels, lambda w, p: None, lambda w, p: None, live)
    except EngineError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as e:
        cause = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise ConfigError(
            f"{cls.__name__}'s forward failed on the meta device ({type(e).__name__}: {cause}); a forward "
            "that reads its tensors' values (.item(), .tolist(), nonzero, data-dependent shapes) cannot be "
            "synthesized: record it on a GPU (mode=record weights.file=CHECKPOINT, then trace=PATH), or check "
            "that model.inputs matches its forward") from e
    finally:
        position.remove()
    host = {w: p for k in kernels for w, p in k.params.items()}
    packed = pack_kernels(rec.order, host, None, lambda n: torch.empty(n, dtype=torch.uint8, device=META))
    recomputed = frozenset(i for i, layer in enumerate(rec.layers)
                           if training and layer >= 0 and not position.own_saves.get(i) and _checkpointed(module))
    return SeenForward(rec, packed.order, sum(_nbytes(p) for p in [*kept, *rec.outside]), buffer_bytes(module),
                       input_bytes, sum(p.numel() for p in module.parameters()), f"{cls.__module__}.{cls.__qualname__}",
                       grouping, saved, recomputed, tuple(backward.kernels) if backward is not None else (),
                       live.peak if training else 0,
                       () if training else tuple(sorted({s % len(packed.order) for s in truth.syncs})))


def _checkpointed(module: nn.Module) -> bool:
    """Whether `module` runs its blocks under activation checkpointing (diffusers' and
    transformers' switch)."""
    return bool(getattr(module, "is_gradient_checkpointing", False) or getattr(module, "gradient_checkpointing", False))


def priced_trace(seen: SeenForward, hardware: Any, name: str, workload: Mapping[str, Any]) -> Trace:
    """The one-step trace of what `seen` ran, priced for `hardware`: an inference, or where
    `seen` is a training forward the LoRA step, its backward as its census counted it (module
    docstring)."""
    predictor = ExecutionTimePredictor(hardware)
    if predictor.table is not None and predictor.module_cost is None:
        log.warning("hardware.kernel_table=%s prices no real module (fitted without module recordings): each "
                    "block's ops launch with no gap between them and each costs the host one CUDA launch's time "
                    "(the table's host time per launch); fit one with "
                    "python -m engine.calibrate ... --modules RECORDINGS", hardware.kernel_table)
    training = seen.saved is not None
    cost = predictor.module_cost
    if training and cost is not None and not (cost.train_host_ns_per_op and cost.backward_host_ns_per_op):
        log.warning("hardware.kernel_table=%s prices no training step's host (fitted without a recorded LoRA "
                    "step): its forward's and backward's ops at an inference's host cost, under what autograd "
                    "costs a training forward; add one to the fit (workload=train_lora mode=record into "
                    "--modules)", hardware.kernel_table)
    rec, order = seen.recording, seen.order
    for note in predictor.table_notes(core for c in rec.census for core in c.cores):
        log.warning(note)
    # The step's attention as it runs: without cuDNN's kernels where the CLI's training turns them off.
    attention = training and not workload.get("cudnn_attention", torch.backends.cuda.cudnn_sdp_enabled())
    saved, needs = saved_tensors(order.kernels, rec.layers, seen.saved.saved, seen.saved.last_saver) \
        if training else ([()] * len(order), {})
    phase = "train" if training else "infer"  # the forward's host: autograd records its graph in training
    forward = []
    for i, (kernel, reads) in enumerate(zip(order.kernels, order.reads)):
        c = rec.census[i]
        forward.append(KernelRecord(
            name=kernel, layer=rec.layers[i], phase="fwd", weights=reads,
            compute_ns=predictor.module_kernel_ns(c.cores, c.pass_list(), c.ops, training=attention),
            flops=sum(core_flops(op, shape) for op, shape in c.cores),
            io_bytes=sum(order.sizes[w] for w in reads), host_ns=predictor.module_host_ns(c.ops, c.dispatches,
                                                                                          phase=phase),
            saved=saved[i], launches=c.ops, packs=seen.saved.packs.get(i, 0) if training else 0,
            cores=tuple(c.cores), passes=c.pass_list(), ops=c.ops, dispatches=c.dispatches))
    backward = [] if not training else [_backward(predictor, seen, f, i, needs.get(i, ()), attention)
                                        for i, f in reversed(list(enumerate(forward)))]
    records = tuple(forward + backward)
    header = {
        "format": FORMAT, "version": VERSION, "records": len(records), "source": "synthesized",
        "model": name, "num_layers": max(rec.layers, default=-1) + 1, "params": seen.params,
        "workload": dict(workload), "module": seen.module_class, "grouping": seen.grouping,
        "hardware": plain_config(hardware), "torch": metadata.version("torch"), "cuda": None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # As a recording's: what torch holds beside the pool at the forward's peak, its workspaces too.
        "traced_peak_bytes": seen.traced_peak_bytes,
        "activation_peak_bytes": seen.traced_peak_bytes + round(cost.workspace_bytes if cost else 0),
        # An inference's own pace under sustained load, by its cores' FLOP rate (ModuleCost); a LoRA
        # step's, or one whose table fitted none, is the profile's (module docstring).
        **({"compute_sustained_slowdown": round(cost.sustained_slowdown(sum(r.flops for r in records),
                                                                        sum(r.compute_ns for r in records)), 4)}
           if cost and cost.sustained_slowdown_per_pflops and not training else {}),
        # Where the forward reads a value off the device (a nonzero), as a recording's: the host waits there.
        **({"host_syncs": list(seen.host_syncs)} if seen.host_syncs else {}),
        "block_records": True, "resident_bytes": seen.resident_bytes, "buffer_bytes": seen.buffer_bytes,
        # Every weight resident, offload binds them and drops the hooks (engine/modules/offload.py,
        # training.py): the whole step's host without each record's hook work, as a recording's factor.
        "plain_host_factor": round(_plain_host_factor(records, cost.host_ns_per_kernel if cost else 0.0), 6),
    }
    trace = Trace(header=header, weight_sizes=dict(order.sizes), records=records)
    check_trace(trace)
    return trace


def _plain_host_factor(records: Sequence[KernelRecord], hook_ns: float) -> float:
    """The share of `records`' host time left without offload's hooks, `hook_ns` a record
    (ModuleCost.host_ns_per_kernel: every forward and backward record is priced with it)."""
    total = sum(r.host_ns for r in records)
    return max(0.0, total - hook_ns * len(records)) / max(1, total)


def _backward(predictor: ExecutionTimePredictor, seen: SeenForward, f: KernelRecord, i: int,
              needs: Sequence[str], attention: bool) -> KernelRecord:
    """The backward record of forward position `i` (`f`), priced from its census (module
    docstring); `attention`: at a training step's rates (ExecutionTimePredictor.module_kernel_ns).
    Its host is its forward's ops' at the backward's cost per op, and its forward's again where
    checkpointing recomputes it (ModuleCost.host_ns_per_dispatch)."""
    c = seen.recording.census[i]
    b = seen.backward[i] if i < len(seen.backward) else KernelCensus()
    recomputed = i in seen.recomputed
    compute = predictor.module_kernel_ns(b.cores, b.pass_list(), b.ops, training=attention,
                                         backward_cores=b.backward_cores)
    if seen.saved.packs.get(i, 0) or recomputed:
        host = predictor.module_host_ns(c.ops, c.dispatches, phase="bwd")
    else:  # no gradient reaches it
        host = predictor.module_host_ns(0, 0)
    if recomputed:
        host += predictor.module_host_ns(c.ops, c.dispatches, hooked=False, phase="train")
    return KernelRecord(
        name=f.name + BACKWARD_SUFFIX, layer=f.layer, phase="bwd", weights=f.weights, compute_ns=compute,
        flops=BACKWARD_FLOPS_FACTOR * f.flops, io_bytes=f.io_bytes, host_ns=host, needs=tuple(needs),
        launches=b.ops)


def synthesize_module(model_cfg: Any, workload: Any, hardware: Any) -> Trace:
    """The one-step trace of the real module `model_cfg` builds, on `workload`'s inputs,
    priced for `hardware`: an inference, or a LoRA step (module docstring)."""
    module, inputs = on_meta(model_cfg, workload)
    training = workload.kind == "train_lora"
    if training:
        targets = model_cfg.get("lora_targets", ALL_LINEAR)
        add_lora(module, workload.lora_rank, targets if isinstance(targets, str) else list(targets), device=META)
        if workload.checkpointing:
            enable_checkpointing(module)
    blocks = model_cfg.get("blocks")
    seen = meta_forward(module, inputs, model_cfg.get("grouping", "block"), None if blocks is None else list(blocks),
                        training=training)
    return priced_trace(seen, hardware, model_cfg.name, plain_config(workload))


def synthesize(module: nn.Module, example_inputs: Any, *, hardware: str | Any = "h100_pcie5",
               grouping: str = "block", blocks: Sequence[str] | None = None, name: str | None = None,
               workload: Mapping[str, Any] | None = None, training: bool = False) -> Trace:
    """The trace of one inference forward of `module` on `example_inputs` (a dict of keyword
    arguments or a tuple of positional ones), both on the meta device, priced for
    `hardware` (a conf/hardware name, a yaml path or a profile): engine.record's trace
    without a GPU or a checkpoint (module docstring). `training`: one LoRA step instead,
    `module` carrying its adapters (peft) and, if it is on, its own checkpointing, its attention
    priced for the backends this process allows (torch.backends.cuda.enable_cudnn_sdp) unless
    `workload` says `cudnn_attention`. Write it with engine.trace.write_trace and replay it with
    `python -m engine trace=PATH`."""
    from engine.config import load_hardware

    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    seen = meta_forward(module, example_inputs, grouping, blocks, training=training)
    return priced_trace(seen, hw, name or type(module).__name__, workload or {})
