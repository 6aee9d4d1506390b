"""The device modes for a real module (a model config with `module._target_`, engine/modules).

    materialize  random weights for the module, written as one .safetensors checkpoint
    record       the module on the device, kernel by kernel -> trace.jsonl (replay: trace=PATH)
    execute      the module streamed under the budget by the policy the config (or the
                 simulator, weights=auto) picks; the prediction from its recorded trace
                 (trace=PATH, else recorded now) beside the measurement; outputs compared
                 bitwise with the all-resident forward when it fits

The weights come from weights.file: a .safetensors file or a diffusers /
transformers model directory, mapped and registered, never copied whole. The
model config's `grouping` (block, the default, or leaf) and `blocks` (module
names) choose the kernels (engine/modules/kernels.py).
"""
from __future__ import annotations

import statistics
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from engine.config import WEIGHT_SOURCES, ActivationsConfig
from engine.errors import ConfigError
from engine.executor.setup import bitwise_equal, compute_device, device_name, fits_resident
from engine.job import Job, Outcome, config_summary
from engine.modules.build import build_module, example_inputs, first_output
from engine.modules.checkpoint import module_weights
from engine.modes.simulate import timeline_files
from engine.modules.offload import offload, predict, record
from engine.report import fmt_bytes, table
from engine.trace import Trace, write_trace
from engine.units import budget_bytes
from engine.weightfile import materialize

NO_CHECKPOINT = ("model {name} is a real module and weights.file is not set: point it at a .safetensors file "
                 "or a model directory, or write random weights with mode=materialize out=PATH")


def _checkpoint(job: Job) -> Path:
    if job.cfg.weights.file is None:
        raise ConfigError(NO_CHECKPOINT.format(name=job.cfg.model.name))
    return Path(job.cfg.weights.file).expanduser()


def _setup(job: Job) -> tuple[Any, dict, torch.device]:
    cfg = job.cfg
    device = compute_device(cfg.weights.backend, no_cuda=(
        f"mode={cfg.mode} runs model {cfg.model.name} on a CUDA GPU and none is visible; record its trace "
        "on a GPU machine and simulate it here with trace=PATH (weights.backend=cpu runs it on the CPU, "
        "timings not a GPU's)"))
    module = build_module(cfg.model)
    return module, example_inputs(cfg.model, module, cfg.workload, device, seed=cfg.seed), device


def _kernels(cfg: Any) -> dict:
    """The model config's kernel grouping: `grouping` (block | leaf) and `blocks` (names)."""
    blocks = cfg.model.get("blocks")
    return {"grouping": cfg.model.get("grouping", "block"),
            "blocks": None if blocks is None else list(blocks)}


def _record(job: Job, module: Any, inputs: dict) -> Trace:
    cfg = job.cfg
    return record(module, inputs, backend=cfg.weights.backend, checkpoint=_checkpoint(job),
                  source=cfg.weights.source, name=cfg.model.name,
                  workload=_workload(cfg), **_kernels(cfg))


def _workload(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.workload, resolve=True)


def materialize_module(job: Job) -> Outcome:
    cfg = job.cfg
    if cfg.out is None:
        raise ConfigError("mode=materialize needs out=PATH (the .safetensors file to write)")
    module = build_module(cfg.model)
    weights = module_weights(module, cfg.model.name)
    path = materialize(weights, Path(cfg.out).expanduser(), seed=cfg.seed, order=list(weights.weights))
    md = f"## Checkpoint: {cfg.model.name}\n\n" + table(["what", "value"], [
        ["file", str(path)], ["weights", f"{len(weights.weights):,}"], ["bytes", fmt_bytes(weights.model_bytes)]])
    return Outcome({"config": config_summary(job), "file": str(path), "bytes": weights.model_bytes},
                   md + f"\n\nuse it: weights.file={path}")


def record_module_mode(job: Job) -> Outcome:
    module, inputs, device = _setup(job)
    trace = _record(job, module, inputs)
    path = job.out_dir / "trace.jsonl"
    write_trace(path, trace)
    h = trace.header
    rows = [["trace", str(path)], ["kernels", f"{len(trace.records):,}"],
            ["kernel compute, sum", f"{sum(r.compute_ns for r in trace.records) / 1e6:.3f} ms"],
            ["host launch, sum", f"{sum(r.host_ns for r in trace.records) / 1e6:.3f} ms"],
            ["streamed bytes", fmt_bytes(sum(trace.weight_sizes.values()))],
            ["device", f"{h['device']} (torch {h['torch']})"]]
    md = f"## Recorded {h['model']} ({job.cfg.workload.name})\n\n" + table(["what", "value"], rows)
    report = {"config": config_summary(job), "trace": str(path), "records": len(trace.records),
              "step_ns": h["step_ns"], "device": h["device"]}
    return Outcome(report, md + f"\n\nreplay it: python -m engine model=<this model> trace={path} budget=MB")


def _timeline(job: Job, trace: Trace, budget: int | None, pred: dict, measured: list) -> None:
    """The chosen policy simulated on the recorded trace, with the measured last step beside it."""
    from sim import simulate

    cfg = job.cfg
    weights = OmegaConf.merge(cfg.weights, {"eviction": pred["eviction"], "lookahead": pred["lookahead"]})
    result = simulate(trace, weights, OmegaConf.structured(ActivationsConfig), cfg.hardware, budget,
                      cfg.workload.steps, allow_below_floor=False)
    timeline_files(job, result, measured)


def execute_module(job: Job) -> Outcome:
    cfg = job.cfg
    if cfg.weights.source not in WEIGHT_SOURCES:
        raise ConfigError(f"weights.source={cfg.weights.source!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    module, inputs, device = _setup(job)
    path = _checkpoint(job)
    trace = job.trace if job.trace is not None else _record(job, module, inputs)
    budget = budget_bytes(cfg.budget)
    pred = predict(trace, cfg.hardware, budget, cfg.weights.lookahead, cfg.weights.eviction, cfg.weights.source,
                   cfg.weights.backend)
    reference = None
    if fits_resident(sum(trace.weight_sizes.values()), device):
        h = offload(module, budget_mb=None, example_inputs=inputs, eviction="priority", checkpoint=path,
                    backend=cfg.weights.backend, source=cfg.weights.source, **_kernels(cfg))
        with torch.no_grad():
            reference = first_output(module(**inputs)).clone()
        h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resident parameters are listed in the report instead
        h = offload(module, budget_mb=cfg.budget, example_inputs=inputs, eviction=pred["eviction"],
                    lookahead=cfg.weights.lookahead, checkpoint=path, backend=cfg.weights.backend,
                    source=cfg.weights.source, **_kernels(cfg))
    try:
        same = []
        with torch.no_grad():
            for i in range(cfg.workload.steps):
                h.executor.time_steps = i == cfg.workload.steps - 1  # the steady state, on the timeline
                out = first_output(module(**inputs))
                same.append(None if reference is None else bitwise_equal(out, reference))
        rows = h.telemetry()
        timeline = h.executor.step_timeline()
    finally:
        h.remove()
    _timeline(job, trace, budget, pred, timeline)
    steady = rows[1:] or rows
    measured = {"step_ms": statistics.median(r["step_ms"] for r in steady), "h2d_bytes": rows[-1]["h2d_bytes"],
                "peak_device_bytes": max(r["peak_device_bytes"] for r in rows)}
    report = {"config": config_summary(job), "prediction": pred, "measured": measured,
              "bitwise": same, "device": device_name(device), "resident_params": h.resident_params}
    md = (f"## Executed {cfg.model.name} at budget {cfg.budget} MB ({pred['eviction']})\n\n"
          + table(["", "predicted", "measured"], [
              ["step time", f"{pred['step_ms']:.2f} ms", f"{measured['step_ms']:.2f} ms"],
              ["H2D bytes / step", fmt_bytes(pred["h2d_bytes"]), fmt_bytes(measured["h2d_bytes"])],
              ["peak pool bytes", fmt_bytes(pred["peak_device_bytes"]), fmt_bytes(measured["peak_device_bytes"])]])
          + "\n\noutputs bitwise equal to the resident run: "
          + ("not compared (the model does not fit)" if reference is None else str(all(same))))
    return Outcome(report, md, exit_code=0 if reference is None or all(same) else 1)
