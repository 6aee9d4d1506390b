"""mode=validate's measured side for a real module (a model config with `module._target_`):
each grid row (engine/validation/grid.py `grid`) run on the device from weights.file.

Inference rows run on one engine.offload set-up (the checkpoint mapped and registered
once, the order recorded once), `OffloadHandle.reconfigure` moving it from row to row;
their steps are timed as a spec model's rows are (validation's batches until settled, each
later batch's first step left out, STALL_STEPS steps with their fetches stamped for the
stall). Training rows (a LoRA step, every frozen weight resident under each activation
policy, or its frozen weights streamed at a budget) run through engine.offload(training=True),
one set-up a row, their steps synced (as the grid predicts them) and timed until settled, as
an inference row's; a streamed one's stall stamped around its fetches, forward and backward,
in STALL_STEPS steps after (validation's `stamped_stall_ms`). Peak device
bytes are the weight pool's and torch's allocator's high-water beside each other on a GPU
("pool_torch"), the pool's on the CPU backend ("pool").
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import asdict
from typing import Any, Sequence

import torch

from engine.errors import ConfigError
from engine.job import Job
from engine.measure.clocks import clock_for
from engine.modes.module_setup import checkpoint_path, is_training, kernel_options, setup_module, training_loss
from engine.modules.build import first_output
from engine.modules.offload import OffloadHandle, offload
from engine.trace import Trace
from engine import validation as v


def measure_module(job: Job, trace: Trace, rows: Sequence[dict]) -> dict:
    """Every grid row that fits the device, measured (the module docstring); the
    measurements file's content (engine/validation/)."""
    cfg = job.cfg
    if is_training(cfg) != v.training(trace):
        raise ConfigError(f"trace={cfg.trace} is {'a training step' if v.training(trace) else 'an inference'} "
                          f"and workload={cfg.workload.name} {'trains' if is_training(cfg) else 'infers'}: "
                          "give the workload the trace was recorded with")
    module, inputs, device = setup_module(job)
    rows, skipped = v.fitting(rows, trace, device)
    cuda = device.type == "cuda"
    out = []
    infer = [row for row in rows if row["kind"] == "infer"]
    if infer:
        first = infer[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parameters kept resident: the prediction's trace has them too
            h = offload(module, budget_mb=first["budget_mb"], example_inputs=inputs, eviction=first["eviction"],
                        lookahead=first["lookahead"], checkpoint=checkpoint_path(job), backend=cfg.weights.backend,
                        source=cfg.weights.source, **kernel_options(cfg))
        try:
            for row in infer:
                h.reconfigure(budget_mb=row["budget_mb"], eviction=row["eviction"], lookahead=row["lookahead"])
                out.append(v.measured_row(row, _measure_inference(h, inputs, device)))
        finally:
            h.remove()
    for row in (row for row in rows if row["kind"] == "train_lora"):
        act = v.activations_config(row["activations"], trace)
        out.append(v.measured_row(row, _measure_training(job, module, inputs, row,
                                                         None if act is None else asdict(act), device)))
    return {**v.measurements_header(cfg.model.name, trace.header.get("num_layers"), trace, device,
                                    cfg.weights, "pool_torch" if cuda else "pool"),
            "rows": out, "skipped": skipped}


def _measure_inference(h: OffloadHandle, inputs: dict, device: torch.device) -> dict:
    """The handle's configuration timed by validation's rule (`time_inference_row`)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step(source: Any) -> None:
        with h.fetches_through(source):
            first_output(h.module(**inputs))
    steps, stalls = v.time_inference_row(step, h.executor, clock_for(device))
    pool = max(t["held_device_bytes"] if cuda else t["peak_device_bytes"] for t in steps)
    return v.inference_measurement(steps, stalls, pool + torch.cuda.max_memory_allocated(device) if cuda else pool)


def _measure_training(job: Job, module: Any, inputs: dict, row: dict, activations: dict | None,
                      device: torch.device) -> dict:
    """A training row on its own set-up: LoRA steps (the forward, the loss, the backward; the
    adapters not updated), each waited for, until timed enough after one warm-up."""
    cfg = job.cfg
    cuda = device.type == "cuda"
    loss_fn = training_loss(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = offload(module, budget_mb=row["budget_mb"], example_inputs=inputs, training=True,
                    activations=activations, eviction=row["eviction"], lookahead=row["lookahead"],
                    checkpoint=checkpoint_path(job), backend=cfg.weights.backend, source=cfg.weights.source,
                    **kernel_options(cfg))
    adapters = [p for p in module.parameters() if p.requires_grad]

    def step(through: Any = None) -> tuple[float, int]:
        for p in adapters:
            p.grad = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with h.fetches_through(through), h.step():
            loss_fn(module(**inputs)).backward()
        # reading the step's row waits for its end: the steps run synced, as the grid predicts them
        return h.telemetry()[-1]["weight_step_ms"], torch.cuda.max_memory_allocated(device) if cuda else 0

    try:
        times, torch_peak = v.time_synced_steps(step)
        rows = h.telemetry()
        streamed = row["budget_mb"] is not None
        stall = v.stamped_stall_ms(step, h.executor, clock_for(device)) if streamed else \
            statistics.median(r.get("stall_time_ms", 0.0) for r in rows[1:])
    finally:
        h.remove()
        for p in adapters:
            p.grad = None
    if cuda:
        torch.cuda.empty_cache()
    pool = max(r.get("weight_held_device_bytes", 0) for r in rows)
    return {"step_ms": statistics.median(times[1:]), "first_step_ms": times[0], "stall_ms": stall,
            "peak_device_bytes": pool + max(torch_peak[1:]), "steps_ms": times,
            **({"h2d_bytes": rows[-1]["weight_h2d_bytes"], **{k: sum(r[f"weight_{k}"] for r in rows[1:])
                                                              for k in v.POOL_EVENTS}} if streamed else {})}
