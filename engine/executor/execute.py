"""Entry points for the CLI: `run_execute` (mode=execute) and `run_materialize`.

run_execute runs `workload.steps` forwards of the spec-built model with its
weights streamed from the weight file through the executor, compares every
step's outputs bitwise with the all-resident forward when the model fits, and
returns the measurement (the counterpart of the simulator's prediction).
"""
from __future__ import annotations

import json
import logging
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from engine.errors import ExecutorError
from engine.executor.runtime import WeightExecutor, make_backend
from engine.executor.sources import host_weights
from engine.policy import AccessOrder
from engine.policy.weights import WeightResidency
from engine.models.spec import ModelSpec
from engine.weightfile import WeightFile, materialize
from engine.units import budget_bytes

log = logging.getLogger(__name__)

TEMP_FILE_MAX_BYTES = 2_000_000_000  # models up to this size get a temporary weight file
REFERENCE_FRACTION = 0.6  # the reference runs all resident when the model takes under this much free memory



def run_materialize(cfg: Any, spec: ModelSpec, out_path: str | Path) -> dict:
    """Write random weights for `spec` (seed cfg.seed) to `out_path`; the GPU generates when there is one."""
    path = materialize(spec, out_path, seed=cfg.seed)
    return {"weights_file": str(path), "model": spec.name, "model_bytes": spec.model_bytes,
            "weights": len(spec.weights), "seed": cfg.seed}


def _device(backend: str) -> torch.device:
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise ExecutorError("no CUDA device; use mode=simulate (or weights.backend=host to exercise "
                                "the executor on the CPU)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_order(order: AccessOrder, spec: ModelSpec) -> None:
    """The trace must be this spec's forward: same kernels, same weights."""
    if len(order) != len(spec.kernels):
        raise ExecutorError(f"the trace has {len(order)} kernels but model {spec.name} runs {len(spec.kernels)} "
                            "per forward; execute runs inference: use workload=infer and a matching trace")
    for i, k in enumerate(spec.kernels):
        if order.kernels[i] != k.name or tuple(order.reads[i]) != tuple(k.weights):
            raise ExecutorError(f"schedule divergence at kernel position {i}: the trace has {order.kernels[i]}, "
                                f"the model runs {k.name}; record or synthesize the trace for this model")


def _weight_file(cfg: Any, spec: ModelSpec, stack: ExitStack) -> Path:
    if cfg.weights.file is not None:
        return Path(cfg.weights.file)
    if spec.model_bytes > TEMP_FILE_MAX_BYTES:
        raise ExecutorError(
            f"weights.file is not set and model {spec.name} is {spec.model_bytes / 1e9:.2f} GB; write its "
            f"weights once with mode=materialize out=PATH, then pass weights.file=PATH")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offload-weights-")))
    log.info("weights.file is not set: materializing %s (%d bytes) into a temporary file", spec.name,
             spec.model_bytes)
    return materialize(spec, tmp / f"{spec.name}.ptd", seed=cfg.seed)


def _reference(spec: ModelSpec, host: dict[str, torch.Tensor], inputs: dict, device: torch.device) -> dict | None:
    """The all-resident forward's outputs, or None when the model does not fit beside the pool."""
    from engine.models import forward
    from engine.models.run import DictSource

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if spec.model_bytes > REFERENCE_FRACTION * free:
            log.info("the model does not fit on the device all resident: no bitwise reference")
            return None
    weights = {n: t.to(device, copy=True) for n, t in host.items()}
    with torch.no_grad():
        out = forward(spec, DictSource(spec, weights), inputs)
    del weights
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the pool is not torch's: give the reference's memory back
    return out


def run_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps forwards through the executor; write telemetry.jsonl; return the measurement."""
    from engine.models import forward, make_inputs

    w = cfg.weights
    device = _device(w.backend)
    order = trace.access_order()
    _check_order(order, spec)
    budget = budget_bytes(cfg.budget)
    # The floor first: a budget under it fails before any file or device memory is touched.
    floor_bytes = WeightResidency(order, budget, w.eviction, w.lookahead).floor.bytes
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        wf = WeightFile(_weight_file(cfg, spec, stack), spec)
        stack.callback(wf.close)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        reference = _reference(spec, wf.tensors(), inputs, device)
        capacity = budget if budget is not None else spec.model_bytes
        backend = make_backend(w.backend, capacity, max(order.sizes.values(), default=0))
        stack.callback(backend.close)
        host = host_weights(wf, w.source, backend)
        stack.callback(host.close)
        executor = WeightExecutor(order, host.tensors, budget_bytes=budget, eviction=w.eviction,
                                  lookahead=w.lookahead, backend=backend, keep_steps=None)
        stack.callback(executor.close)
        outputs = []
        with torch.no_grad():
            for _ in range(cfg.workload.steps):
                with executor.step():
                    outputs.append(forward(spec, executor, inputs))
        telemetry = executor.telemetry()  # waits for the last step
        match = None if reference is None else all(
            torch.equal(out[k], reference[k]) for out in outputs for k in reference)
        pool_cap = backend.cap_bytes
        reserved_peak = backend.reserved_peak_bytes()
    with open(out_dir / "telemetry.jsonl", "w") as f:
        for row in telemetry:
            f.write(json.dumps(row) + "\n")
    return _measurement(telemetry, cfg, budget, floor_bytes, pool_cap, reserved_peak, match)


def _measurement(telemetry: list[dict], cfg: Any, budget: int | None, floor_bytes: int, pool_cap: int,
                 reserved_peak: int, match: bool | None) -> dict:
    # Times are noisy: the median of the steps after the first (which fills the
    # pool). Counts are deterministic but settle over a few steps, so they come
    # from the last step, the simulator's steady state too.
    steady = telemetry[1:] or telemetry
    last = telemetry[-1]
    return {
        "backend": cfg.weights.backend,
        "source": cfg.weights.source,
        "eviction": cfg.weights.eviction,
        "lookahead": cfg.weights.lookahead,
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        "pool_cap_bytes": pool_cap,
        "pool_reserved_peak_bytes": reserved_peak,
        "steps": len(telemetry),
        "step_ms": statistics.median(row["step_ms"] for row in steady),
        "first_step_ms": telemetry[0]["step_ms"],
        "h2d_bytes": last["h2d_bytes"],
        "weight_copies": last["fetches"] + last["prefetches"],
        "weight_hits": last["hits"],  # reads that found the weight resident
        "weight_misses": last["fetches"],  # reads that had to fetch on demand
        "evictions": last["evictions"],
        # Pool refusals under the budget (fragmentation), each answered by copying the
        # resident weights in again; the simulator does not model them.
        "relocations": sum(row["relocations"] for row in telemetry),
        "peak_device_bytes": max(row["peak_device_bytes"] for row in telemetry),
        "peak_resident_bytes": max(row["peak_resident_bytes"] for row in telemetry),
        "outputs_match_reference": match,
        "weights_file": cfg.weights.file,  # None: a temporary file, gone now
    }
