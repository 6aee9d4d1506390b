"""The device modes for a real module (a model config with `module._target_`, engine/modules).

    materialize  random weights for the module, written as one .safetensors checkpoint
    record       the module on the device, kernel by kernel -> trace.jsonl (replay: trace=PATH)
    execute      the module streamed under the budget by the policy the config (or the
                 simulator, weights=auto) picks; the prediction from its recorded trace
                 (trace=PATH, else recorded now) beside the measurement; outputs compared
                 bitwise with the all-resident forward when it fits

workload=train_lora trains peft LoRA adapters (rank workload.lora_rank, on the model
config's `lora_targets`, default every linear; engine/modules/adapters.py) on the
frozen module, with per-block activation checkpointing when workload.checkpointing:
record then times a training step (forward, a mean-square loss, backward), and
execute runs workload.steps of them through engine.offload(training=True) with the
configured activations policy, losses and adapter gradients compared with the same
steps all resident (within that run's own spread on a GPU, bitwise on the CPU;
engine/modes/module_train.py). What the modes share is in engine/modes/module_setup.py.

The weights come from weights.file: a .safetensors file or a diffusers /
transformers model directory, mapped and registered, never copied whole. The
model config's `grouping` (block, the default, or leaf) and `blocks` (module
names) choose the kernels (engine/modules/kernels.py). `grouping: auto` (inference)
records each grouping (record writes trace-block.jsonl and trace-leaf.jsonl) and
execute keeps the one the simulator predicts fastest, as engine.offload(grouping="auto").
"""
from __future__ import annotations

import statistics
import warnings
from pathlib import Path
from typing import Any

import torch

from engine.config import WEIGHT_SOURCES
from engine.errors import ConfigError
from engine.executor.setup import device_name, end_of_step, fits_resident
from engine.gc_pause import paused_gc
from engine.job import Job, Outcome, config_summary
from engine.measure.clocks import clock_for
from engine.measure.spread import typical_step_ms, warm_mean
from engine.modes.module_setup import (STEPS_ROW, checkpoint_path, groupings_to_record, is_training, keep_grouping,
                                       kernel_options, pace_note, predict_run, predicted_from, record_trace,
                                       report_plan, setup_module, trace_file, write_timeline)
from engine.modes.module_train import execute_training
from engine.modules.build import build_module, first_output
from engine.modules.checkpoint import load_resident, module_weights
from engine.modules.kernels import GROUPINGS
from engine.modules.offload import fastest_grouping, offload
from engine.modules.outcomes import Comparison, distinct
from engine.report import fmt_bytes, launches_cell, steps_cell, table, varying_steps_note
from engine.trace import Trace, write_trace
from engine.units import budget_bytes
from engine.weightfile import materialize


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
    groupings = groupings_to_record(job.cfg)
    module, inputs, device = setup_module(job)
    paths = []
    for grouping in groupings:
        trace = record_trace(job, module, inputs, grouping)
        paths.append(job.out_dir / trace_file(grouping, len(groupings)))
        write_trace(paths[-1], trace)
    if len(paths) > 1:  # grouping: auto
        md = f"## Recorded {job.cfg.model.name} ({job.cfg.workload.name}), each grouping\n\n" + table(
            ["grouping", "trace"], [[g, str(p)] for g, p in zip(groupings, paths)])
        return Outcome({"config": config_summary(job), "traces": {g: str(p) for g, p in zip(groupings, paths)}},
                       md + f"\n\nrank them: python -m engine -m model={job.model_arg} budget=MB "
                       f"trace={','.join(str(p) for p in paths)}")
    path = paths[0]
    h = trace.header
    rows = [["trace", str(path)], ["kernels", f"{len(trace.records):,}"],
            ["kernel compute, sum", f"{sum(r.compute_ns for r in trace.records) / 1e6:.3f} ms"],
            ["host launch, sum", f"{sum(r.host_ns for r in trace.records) / 1e6:.3f} ms"],
            ["streamed bytes", fmt_bytes(sum(trace.weight_sizes.values()))],
            ["CUDA launches a step", launches_cell([r.launches for r in trace.records])],
            ["device", f"{h['device']} (torch {h['torch']})"]]
    if is_training(job.cfg):
        rows.insert(4, ["saved for backward", fmt_bytes(sum(s.nbytes for r in trace.records for s in r.saved))])
    md = f"## Recorded {h['model']} ({job.cfg.workload.name})\n\n" + table(["what", "value"], rows)
    report = {"config": config_summary(job), "trace": str(path), "records": len(trace.records),
              "step_ns": h["step_ns"], "device": h["device"]}
    return Outcome(report, md + f"\n\nreplay it: python -m engine model={job.model_arg} trace={path} budget=MB")


def execute_module(job: Job) -> Outcome:
    cfg = job.cfg
    if cfg.weights.source not in WEIGHT_SOURCES:
        raise ConfigError(f"weights.source={cfg.weights.source!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    groupings = groupings_to_record(cfg)
    module, inputs, device = setup_module(job)
    path = checkpoint_path(job)
    budget = budget_bytes(cfg.budget)
    if job.trace is not None:
        recorded = job.trace.header.get("grouping")
        if len(groupings) > 1:  # the trace's kernels are the ones to run
            if recorded not in GROUPINGS:
                raise ConfigError("model.grouping=auto with trace=PATH: this recording does not name its grouping; "
                                  f"set model.grouping to the one it was recorded with ({', '.join(GROUPINGS)})")
            keep_grouping(cfg, recorded)
        elif recorded is not None and recorded != groupings[0]:
            raise ConfigError(f"trace={cfg.trace} was recorded with grouping {recorded} and model.grouping is "
                              f"{groupings[0]}: set model.grouping={recorded} (or auto, which runs the trace's)")
        trace, pred = job.trace, predict_run(cfg, job.trace, budget)
    else:
        trace, pred = _choose_recording(job, module, inputs, groupings, budget)
    # What an "auto" chose on the trace recorded just now (job.prepare chose on trace=PATH's).
    cfg.weights.eviction, cfg.weights.lookahead = pred["eviction"], pred["lookahead"]
    if is_training(cfg):
        return execute_training(job, module, inputs, device, trace, pred)
    comparison, resident_ms = None, []  # the plain module's steps, where it fits
    if fits_resident(sum(trace.weight_sizes.values()), device):  # the plain module, loaded as from_pretrained would
        plain = load_resident(build_module(cfg.model), path, device)
        outputs, resident_ms = plain_infer_run(cfg, plain, device, inputs)
        del plain
        comparison = Comparison(outputs, cfg.workload.steps)
        del outputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resident parameters are listed in the report instead
        h = offload(module, budget_mb=cfg.budget, example_inputs=inputs, eviction=pred["eviction"],
                    lookahead=cfg.weights.lookahead, checkpoint=path, backend=cfg.weights.backend,
                    source=cfg.weights.source, **kernel_options(cfg))
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            for i in range(cfg.workload.steps):
                h.executor.time_steps = i == cfg.workload.steps - 1  # the steady state, on the timeline
                out = first_output(module(**inputs))
                if comparison is not None:
                    comparison.add(out)  # on the device: the host reading it would sync a free loop
                del out
                end_of_step(cfg.workload.loop, device, i)
        verdict = None if comparison is None else comparison.verdict()
        rows = h.telemetry()
        timeline = h.executor.step_timeline()
    finally:
        h.remove()
    write_timeline(job, trace, budget, pred, timeline)
    times = [r["step_ms"] for r in rows]
    resident_steady = resident_ms[1:] or resident_ms
    measured = {"step_ms": typical_step_ms(times, cfg.workload.steps, pred["steps_vary"]),
                "h2d_bytes": warm_mean([r["h2d_bytes"] for r in rows], cfg.workload.steps),
                "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
                "steps_ms": times,
                # The same steps of the plain module, every weight resident (where it fits).
                "resident_step_ms": statistics.median(resident_steady) if resident_steady else None,
                "resident_steps_ms": resident_ms}
    if cuda:  # the whole device less the context: the weights' held peak plus torch's allocator's,
        # less the plain outputs kept to compare with (no part of the run)
        measured["peak_pool_torch_bytes"] = (max(r["held_device_bytes"] for r in rows)
                                             + torch.cuda.max_memory_allocated(device)
                                             - (0 if comparison is None else comparison.held_bytes))
    report = {"config": config_summary(job), **report_plan(job, trace), "prediction": pred, "measurement": measured,
              "bitwise": None if verdict is None else verdict.bitwise,
              "outcomes": None if verdict is None else verdict.summary(),
              "device": device_name(device), "resident_params": h.resident_params}
    md = (f"## Executed {cfg.model.name} at budget {cfg.budget} MB ({pred['eviction']})\n\n"
          + table(["", "predicted", "measured"], [
              ["step time", f"{pred['step_ms']:.2f} ms", f"{measured['step_ms']:.2f} ms"],
              [STEPS_ROW, "", steps_cell(times[1:] or times)],
              ["H2D bytes / step", fmt_bytes(pred["h2d_bytes"]), fmt_bytes(measured["h2d_bytes"])],
              ["peak pool bytes", fmt_bytes(pred["peak_device_bytes"]), fmt_bytes(measured["peak_device_bytes"])],
              ["peak pool + torch bytes", fmt_bytes(pred["peak_pool_torch_bytes"]),
               fmt_bytes(measured["peak_pool_torch_bytes"]) if cuda else "not measured (cpu)"],
              *([["step of the plain module, every weight resident", "", f"{measured['resident_step_ms']:.2f} ms"],
                 [f"{STEPS_ROW}, plain module", "", steps_cell(resident_steady)]]
                if resident_ms else [])])
          + ("" if "groupings_ms" not in pred else "\n\nmodel.grouping=auto kept " + pred["grouping"] + ", predicted "
             + ", ".join(f"{g} {ms:.2f} ms" for g, ms in pred["groupings_ms"].items()))
          + f"\n\n{predicted_from(job, len(groupings))}"
          + "\n\noutputs bitwise equal to the plain module's (loaded from weights.file, every weight resident): "
          + ("not compared (the model does not fit)" if verdict is None else verdict.text())
          + (f"\n\n{pace}" if (pace := pace_note(trace, measured["resident_step_ms"])) else "")
          + (f"\n\n{varying_steps_note(pred['step_ms_range'])}" if pred["steps_vary"] else ""))
    return Outcome(report, md, exit_code=0 if verdict is None or verdict.passed else 1)


def _choose_recording(job: Job, module: Any, inputs: dict, groupings: tuple[str, ...],
                      budget: int | None) -> tuple[Trace, dict]:
    """Record `groupings` (each written beside the report: replay it with trace=PATH) and
    predict it; for several, keep the one the simulator predicts fastest, as
    engine.offload(grouping="auto") does (engine.modules.offload.fastest_grouping)."""
    cfg = job.cfg

    def attempt(grouping: str) -> tuple[Trace, dict]:
        trace = record_trace(job, module, inputs, grouping)
        write_trace(job.out_dir / trace_file(grouping, len(groupings)), trace)
        return trace, predict_run(cfg, trace, budget)

    if len(groupings) == 1:
        return attempt(groupings[0])
    best, tried = fastest_grouping(attempt)
    keep_grouping(cfg, best)
    return tried[best]


# The plain module's outputs kept on the device before they are made distinct: beyond it, a
# step's output is compared with those kept as it ends, the host waiting for it.
PLAIN_OUTPUT_BYTES = 1 << 30


def plain_infer_run(cfg: Any, plain: Any, device: torch.device,
                    inputs: dict) -> tuple[list[torch.Tensor], list[float]]:
    """workload.steps forwards of the plain module (loaded as from_pretrained would), looped as
    the offloaded ones (workload.loop), each with cyclic GC paused as they run: the distinct
    outputs of its steps (what the offloaded outputs are compared with) and each step's time
    (ms; CUDA events, else the host's clock). Outputs past PLAIN_OUTPUT_BYTES together (an LM
    prefill's logits) are made distinct after each step, which waits for it."""
    clock = clock_for(device)
    stamps: list[tuple[Any, Any]] = []
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(cfg.workload.steps):
            with paused_gc():
                start = clock.stamp()
                out = first_output(plain(**inputs))
                stamps.append((start, clock.stamp()))
            outputs.append(out.clone())  # a module may hand back a buffer it writes again
            del out
            if sum(o.numel() * o.element_size() for o in outputs) > PLAIN_OUTPUT_BYTES:
                outputs = distinct(outputs)
            end_of_step(cfg.workload.loop, device, i)
    clock.synchronize()
    return outputs, [clock.ns(a, b) / 1e6 for a, b in stamps]
