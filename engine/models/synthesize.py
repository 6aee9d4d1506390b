"""A spec model's trace, synthesized: one step of its kernels on a hardware profile, each
kernel's time predicted by the kernel table (engine.kernel_time.ExecutionTimePredictor), the
format engine/trace.py describes (source "synthesized")."""
from __future__ import annotations

import logging
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.compute import BACKWARD_FLOPS_FACTOR
from engine.kernel_time import ExecutionTimePredictor
from engine.models.spec import Kernel, ModelSpec, SavedTensor
from engine.trace import BACKWARD_SUFFIX, FORMAT, VERSION, KernelRecord, Trace, check_trace

log = logging.getLogger(__name__)


def _plain(cfg: Any) -> Any:
    """A config (OmegaConf node, dataclass or mapping) as plain JSON-able data."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if is_dataclass(cfg):
        return asdict(cfg)
    return dict(cfg)


def _torch_version() -> str | None:
    # Read the installed version without importing torch (seconds of import time).
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _saved_name(kernel: Kernel, saved: SavedTensor, taken: set[str]) -> str:
    # The activation policies key saved tensors by name, so names must be unique.
    # Spec names are tensor identities, the names the executor's hooks see too:
    # keep them, and prefix the kernel only where two would collide.
    name = saved.name if saved.name not in taken else f"{kernel.name}:{saved.name}"
    taken.add(name)
    return name


def synthesize(spec: ModelSpec, workload: Any, hardware: Any) -> Trace:
    """A one-step trace of `spec` on `hardware`, compute times predicted.

    Training (workload.kind == "train_lora") appends the backward: one record
    per forward kernel in reverse order, reading the same weights again at
    twice the FLOPs and unpacking the forward kernel's saved tensors.
    An inference of a spec built from a model config carries the activation bytes
    its forward holds at its peak (header "activation_peak_bytes", traced on the
    meta device: engine/models/liveness.py), as a recorded module's header does.
    """
    predictor = ExecutionTimePredictor(hardware)
    for note in predictor.table_notes((k.op, k.shape) for k in spec.kernels if k.op):
        log.warning(note)
    training = workload.kind == "train_lora"
    forward = []
    taken: set[str] = set()
    for k in spec.kernels:
        saved = tuple(SavedTensor(_saved_name(k, s, taken), s.nbytes, s.layer) for s in k.saved) if training else ()
        forward.append(KernelRecord(
            name=k.name, layer=k.layer, phase="fwd", weights=tuple(k.weights),
            compute_ns=predictor.kernel_ns(k.op, k.flops, k.io_bytes, k.shape, passes=k.passes),
            flops=k.flops, io_bytes=k.io_bytes, saved=saved, host_ns=predictor.host_ns(k.op, "fwd", training), op=k.op,
            shape=k.shape, passes=k.passes, launches=predictor.launches(k.op, "fwd", training),
            packs=predictor.packs(k.op, len(saved)) if training else 0))
    backward = []
    if training:
        for k, f in zip(reversed(spec.kernels), reversed(forward)):
            flops = BACKWARD_FLOPS_FACTOR * k.flops
            io_bytes = BACKWARD_FLOPS_FACTOR * k.io_bytes
            backward.append(KernelRecord(
                name=k.name + BACKWARD_SUFFIX, layer=k.layer, phase="bwd", weights=tuple(k.weights),
                compute_ns=predictor.kernel_ns(k.op, flops, io_bytes, k.shape, backward=True),
                flops=flops, io_bytes=io_bytes, needs=tuple(s.name for s in f.saved),
                host_ns=predictor.host_ns(k.op, "bwd", training), op=k.op, shape=k.shape,
                launches=predictor.launches(k.op, "bwd", training)))
    records = tuple(forward + backward)
    header = {
        "format": FORMAT, "version": VERSION, "records": len(records), "source": "synthesized",
        "model": spec.name, "workload": _plain(workload), "hardware": _plain(hardware),
        "torch": _torch_version(), "cuda": None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if not training and "config" in spec.meta:
        from engine.models.liveness import activation_peak_bytes

        header["activation_peak_bytes"] = activation_peak_bytes(spec, workload)
    sizes = {name: w.nbytes for name, w in spec.weights.items()}
    trace = Trace(header=header, weight_sizes=sizes, records=records)
    check_trace(trace)
    return trace
