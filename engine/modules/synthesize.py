"""A real module's trace without a GPU: its forward run on the meta device, each
kernel priced from its op census.

`python -m engine model=flux_diffusers budget=12000` on a CPU predicts the diffusers
FLUX.1-dev as the main command predicts a spec model. The module is built from the
model config with every parameter and buffer on the meta device (nothing allocated,
no checkpoint read), its kernels found as offload finds them
(engine/modules/kernels.py), its inputs made by the config's builder, and one
forward recorded as the recorder's first forward is (`record_order`): the access
order, and each position's op census (engine/modules/census.py). A record's
compute time is its cores by op and shape plus the rest at the kernel table's
ModuleCost, its host time its ops' (ExecutionTimePredictor.module_kernel_ns,
module_host_ns); its weight is the kernel's packed span, sized as offload packs it
(engine/modules/packing.py). The header carries the bytes the forward holds at its
peak beside the streamed weights (its inputs, the parameters kept resident, every
live tensor its ops made), traced in the same forward.

Inference only: a training step's backward is recorded (mode=record), not
synthesized.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from engine.compute import ExecutionTimePredictor, core_flops
from engine.errors import ConfigError, EngineError
from engine.modules.build import build_module, example_inputs, plain_config
from engine.modules.kernels import (GROUPINGS, Recording, forward_live_bytes, input_tensors, kv_cache_tensors,
                                   partition, record_order)
from engine.modules.packing import pack_kernels
from engine.policy import AccessOrder
from engine.trace import FORMAT, VERSION, KernelRecord, Trace, check_trace

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
    input_bytes: int
    params: int
    module_class: str
    grouping: str

    @property
    def traced_peak_bytes(self) -> int:
        """What the forward holds at its peak beside the streamed weights: its ops' live
        tensors, its inputs and the parameters kept resident."""
        return self.recording.live_peak + self.input_bytes + self.resident_bytes


def seen_forward(streamed: StreamedModule) -> SeenForward:
    """What offload's order forward on the device saw (engine/modules/streamed.py), as a meta
    forward's."""
    module = streamed.module
    cls = type(module)
    return SeenForward(streamed.recording, streamed.order, streamed.resident_bytes, streamed.input_bytes,
                       sum(p.numel() for p in module.parameters()), f"{cls.__module__}.{cls.__qualname__}",
                       streamed.grouping)


def on_meta(model_cfg: Any, workload: Any) -> tuple[nn.Module, dict]:
    """The module `model_cfg` builds, every parameter and buffer on the meta device, and
    its inputs for `workload` there."""
    module = nn.Module.to(build_module(model_cfg), META)
    inputs = example_inputs(model_cfg, module, workload, META)
    if any(not t.is_meta for t in input_tensors(inputs)):
        raise ConfigError(f"model.inputs ({plain_config(model_cfg)['inputs']['_target_']}) made tensors off the meta "
                          "device it was given: make every tensor with device=device")
    return module, inputs


def meta_forward(module: nn.Module, inputs: Any, grouping: str = "block",
                 blocks: Sequence[str] | None = None) -> SeenForward:
    """One forward of `module` (on the meta device) on `inputs` (a dict of keyword
    arguments, or a tuple of positional ones), its kernels grouped as offload groups them."""
    if grouping not in GROUPINGS:
        raise ConfigError(f"grouping={grouping} picks between recordings of each grouping (mode=record); a "
                          f"synthesized trace takes one: set it (model.grouping) to one of {', '.join(GROUPINGS)}")
    if not all(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise ConfigError(f"this {type(module).__name__} holds tensors off the meta device; a synthesized trace "
                          "reads shapes only: build it under `with torch.device('meta'):` (or "
                          "engine.modules.build.parameters_on_meta()) and move its buffers with .to('meta')")
    kernels, kept = partition(module, grouping, blocks)
    if any(not t.is_meta for t in input_tensors(inputs) + kv_cache_tensors(inputs)):
        raise ConfigError("example_inputs hold tensors off the meta device; make them with device='meta'")
    live, input_bytes = forward_live_bytes(module, inputs)

    def run() -> Any:
        return module(**inputs) if isinstance(inputs, dict) else module(*inputs)

    cls = type(module)
    try:
        with torch.no_grad():
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
    host = {w: p for k in kernels for w, p in k.params.items()}
    packed = pack_kernels(rec.order, host, None, lambda n: torch.empty(n, dtype=torch.uint8, device=META))
    return SeenForward(rec, packed.order, sum(_nbytes(p) for p in [*kept, *rec.outside]), input_bytes,
                       sum(p.numel() for p in module.parameters()), f"{cls.__module__}.{cls.__qualname__}", grouping)


def priced_trace(seen: SeenForward, hardware: Any, name: str, workload: Mapping[str, Any]) -> Trace:
    """The one-step inference trace of what `seen` ran, priced for `hardware` (module docstring)."""
    predictor = ExecutionTimePredictor(hardware)
    if predictor.table is not None and predictor.module_cost is None:
        log.warning("hardware.kernel_table=%s prices no real module (fitted without module recordings): each "
                    "block's memory-bound ops run at hbm_gbps and launch at kernel_launch_us; fit one with "
                    "python -m engine.calibrate ... --modules RECORDINGS", hardware.kernel_table)
    rec, order = seen.recording, seen.order
    records = []
    for i, (kernel, reads) in enumerate(zip(order.kernels, order.reads)):
        c = rec.census[i]
        records.append(KernelRecord(
            name=kernel, layer=rec.layers[i], phase="fwd", weights=reads,
            compute_ns=predictor.module_kernel_ns(c.cores, c.memory_elements, c.ops),
            flops=sum(core_flops(op, shape) for op, shape in c.cores),
            io_bytes=sum(order.sizes[w] for w in reads), host_ns=predictor.module_host_ns(c.ops, c.dispatches),
            launches=c.ops, cores=tuple(c.cores), memory_elements=c.memory_elements, ops=c.ops,
            dispatches=c.dispatches))
    header = {
        "format": FORMAT, "version": VERSION, "records": len(records), "source": "synthesized",
        "model": name, "num_layers": max(rec.layers, default=-1) + 1, "params": seen.params,
        "workload": dict(workload), "module": seen.module_class, "grouping": seen.grouping,
        "hardware": plain_config(hardware), "torch": metadata.version("torch"), "cuda": None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # As a recording's: what torch holds beside the pool at the forward's peak, its workspaces too.
        "traced_peak_bytes": seen.traced_peak_bytes,
        "activation_peak_bytes": seen.traced_peak_bytes + round(predictor.module_cost.workspace_bytes
                                                                if predictor.module_cost else 0),
        "block_records": True, "resident_bytes": seen.resident_bytes,
        # Every weight resident, offload drops the hooks (engine/modules/offload.py): the host's share then.
        "plain_host_factor": round(sum(predictor.module_host_ns(c.ops, c.dispatches, hooked=False)
                                       for c in rec.census) / max(1, sum(r.host_ns for r in records)), 6),
    }
    trace = Trace(header=header, weight_sizes=dict(order.sizes), records=tuple(records))
    check_trace(trace)
    return trace


def synthesize_module(model_cfg: Any, workload: Any, hardware: Any) -> Trace:
    """The one-step inference trace of the real module `model_cfg` builds, on `workload`'s
    inputs, priced for `hardware` (module docstring)."""
    if workload.kind == "train_lora":
        raise ConfigError(f"model {model_cfg.name} is a real module: a LoRA step is recorded, not synthesized "
                          "(mode=record weights.file=CHECKPOINT, then trace=PATH)")
    module, inputs = on_meta(model_cfg, workload)
    blocks = model_cfg.get("blocks")
    seen = meta_forward(module, inputs, model_cfg.get("grouping", "block"), None if blocks is None else list(blocks))
    return priced_trace(seen, hardware, model_cfg.name, plain_config(workload))


def synthesize(module: nn.Module, example_inputs: Any, *, hardware: str | Any = "h100_pcie5",
               grouping: str = "block", blocks: Sequence[str] | None = None, name: str | None = None,
               workload: Mapping[str, Any] | None = None) -> Trace:
    """The trace of one inference forward of `module` on `example_inputs` (a dict of keyword
    arguments or a tuple of positional ones), both on the meta device, priced for
    `hardware` (a conf/hardware name, a yaml path or a profile): engine.record's trace
    without a GPU or a checkpoint (module docstring). Write it with
    engine.trace.write_trace and replay it with `python -m engine trace=PATH`."""
    from engine.config import load_hardware

    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    seen = meta_forward(module, example_inputs, grouping, blocks)
    return priced_trace(seen, hw, name or type(module).__name__, workload or {})
