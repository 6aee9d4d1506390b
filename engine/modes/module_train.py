"""workload=train_lora's execute for a real module: the same LoRA steps on the plain module
(loaded as from_pretrained would, timed, run twice on a GPU for the spread the comparison
allows) and through engine.offload(training=True) under the budget and the activations
policy; losses and adapter gradients compared step by step, the prediction beside.
"""
from __future__ import annotations

import json
import statistics
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from omegaconf import OmegaConf

from engine.executor.setup import device_name, end_of_step, fits_resident
from engine.executor.training import LEARNING_RATE, match_reference, max_abs_diff, to_host
from engine.gc_pause import paused_gc
from engine.job import Job, Outcome, config_summary
from engine.measure.clocks import clock_for
from engine.measure.spread import typical_step_ms, warm_mean
from engine.measure.timing import KernelStamps
from engine.models.lora import lora_sgd
from engine.modes.module_setup import (STEPS_ROW, activations_config, built_module, checkpoint_path, kernel_options,
                                       pace_note, predicted_from, report_plan, training_loss, write_timeline)
from engine.modules.checkpoint import load_resident
from engine.modules.offload import offload
from engine.report import fmt_bytes, relocations_note, steps_cell, table, varying_steps_note
from engine.trace import Trace
from engine.units import budget_bytes

Steps = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]  # per step: the loss, the adapters' gradients


def execute_training(job: Job, module: Any, inputs: dict, device: torch.device, trace: Trace,
                      pred: dict) -> Outcome:
    """workload=train_lora: the reference steps all resident (when the weights and the saved
    tensors fit), then the same steps under the budget and the activations policy."""
    cfg = job.cfg
    # On the host: each run starts its adapters from these, and the device's peak is the run's own.
    initial = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters() if p.requires_grad}
    act = None if cfg.activations.mode == "off" else OmegaConf.to_container(activations_config(cfg, trace), resolve=True)
    saved = sum(s.nbytes for r in trace.records for s in r.saved)
    compare = fits_resident(sum(trace.weight_sizes.values()) + saved, device)
    reference = spread = resident_ms = None
    resident_runs: list[list[float]] = []  # each plain run's step times, ms
    resident_steady: list[float] = []
    # The kernels run as a training script runs them (no deterministic mode, whose kernels
    # differ in time and memory from what was recorded): on a GPU the backward's kernels sum
    # in no fixed order, so a second resident run measures the spread the comparison allows.
    if compare:  # the plain module, loaded as from_pretrained would: it shares none of offload's set-up
        plain = _plain(job, device)
        reference, ref_ms = plain_train_run(cfg, plain, device, inputs, initial)
        resident_runs.append(ref_ms)
        if device.type == "cuda":
            again, again_ms = plain_train_run(cfg, plain, device, inputs, initial)
            spread = max_abs_diff(reference, again)
            resident_runs.append(again_ms)
        resident_steady = [t for run in resident_runs for t in run[1:] or run]  # each run's first warms it
        resident_ms = statistics.median(resident_steady)
        del plain
        if device.type == "cuda":
            torch.cuda.empty_cache()  # its weights go back before the streamed run measures its peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resident parameters are listed by the handle instead
        steps, rows, timeline, weight_stall = _train_run(job, module, inputs, initial, cfg.budget, act,
                                                         pred["eviction"], timed=True)
    write_timeline(job, trace, budget_bytes(cfg.budget), pred, timeline)
    steady = rows[1:] or rows
    times = [r["weight_step_ms"] for r in rows]
    torch_peak = [r["torch_peak_bytes"] for r in rows]
    measured = {"step_ms": typical_step_ms(times, cfg.workload.steps, pred["steps_vary"]),
                "steps_ms": times,
                "h2d_bytes": warm_mean([r["weight_h2d_bytes"] + r.get("restore_bytes", 0) for r in rows],
                                       cfg.workload.steps),
                "d2h_bytes": rows[-1].get("spill_bytes", 0),
                "pool_peak_bytes": max(r["weight_held_device_bytes"] for r in rows),
                "torch_peak_bytes": None if None in torch_peak else max(torch_peak),
                "activations_spilled": rows[-1].get("activations_spilled", 0),
                "pool_misses": rows[-1].get("pool_misses", 0),
                # The compute stream's waits on copies, as the simulator's: the activation restores'
                # (the median of the steps after the first) and the streamed weights' (the last step's).
                "stall_ms": statistics.median(r.get("stall_time_ms", 0) for r in steady) + weight_stall,
                "weight_stall_ms": weight_stall,
                "reserve_releases": sum(r.get("weight_reserve_releases", 0) for r in rows),
                "relocations": sum(r.get("weight_relocations", 0) for r in rows),
                "warm_relocations": sum(r.get("weight_relocations", 0) for r in steady),
                "resident_step_ms": resident_ms,  # the same steps of the plain module, every weight resident
                "resident_steps_ms": resident_runs}
    if measured["torch_peak_bytes"] is not None:
        measured["peak_pool_torch_bytes"] = measured["pool_peak_bytes"] + measured["torch_peak_bytes"]
    losses, grads = (None, None) if reference is None else match_reference(steps, reference, spread)
    (job.out_dir / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = {"config": config_summary(job), **report_plan(job, trace), "prediction": pred, "measurement": measured,
              "reference_spread": spread,
              "loss_match_reference": losses, "grads_match_reference": grads, "device": device_name(device)}
    table_rows = [
        ["step time", f"{pred['step_ms']:.2f} ms", f"{measured['step_ms']:.2f} ms"],
        [STEPS_ROW, "", steps_cell(times[1:] or times)],
        ["H2D bytes / step (weights, restores)", fmt_bytes(pred["h2d_bytes"]), fmt_bytes(measured["h2d_bytes"])],
        ["D2H bytes / step (spills)", fmt_bytes(pred["d2h_bytes"]), fmt_bytes(measured["d2h_bytes"])],
        ["stall (waits on weights and restores)", f"{pred['stall_ms']:.2f} ms", f"{measured['stall_ms']:.2f} ms"],
        ["peak pool + torch bytes", fmt_bytes(pred["peak_pool_torch_bytes"]),
         fmt_bytes(measured["peak_pool_torch_bytes"]) if "peak_pool_torch_bytes" in measured
         else "not measured (cpu)"]]
    if resident_ms is not None:
        table_rows.append(["step of the plain module, every weight resident", "", f"{resident_ms:.2f} ms"])
        table_rows.append([f"{STEPS_ROW}, plain module", "", steps_cell(resident_steady)])
    compared = ("not compared (the weights and saved tensors do not fit all resident)" if reference is None else
                f"losses {losses}, gradients {grads}" + (f" (within twice the resident runs' own spread, "
                                                         f"{spread:.3g}, or 2^-7 of each tensor's magnitude)"
                                                         if spread else " (bitwise)"))
    md = (f"## Trained {cfg.model.name} at budget {cfg.budget} MB ({pred['eviction']}, activations "
          f"{cfg.activations.mode})\n\n" + table(["", "predicted", "measured"], table_rows)
          + f"\n\n{predicted_from(job)}\n\nagainst the same steps of the plain module: {compared}"
          + (f"\n\n{pace}" if (pace := pace_note(trace, resident_ms)) else "")
          + (f"\n\n{varying_steps_note(pred['step_ms_range'])}" if pred["steps_vary"] else "")
          + f"\n\ntelemetry: {job.out_dir / 'telemetry.jsonl'}"
          + (f"\n\n{note}" if (note := relocations_note(measured)) else ""))
    wrong = losses is False or grads is False
    return Outcome(report, md, exit_code=1 if wrong else 0)


def _plain(job: Job, device: torch.device) -> Any:
    """The module built again with its adapters, its base loaded from weights.file onto the
    device (load_resident): what a training script without offloading runs."""
    return load_resident(built_module(job.cfg, device), checkpoint_path(job), device, frozen_only=True)


def plain_train_run(cfg: Any, plain: Any, device: torch.device, inputs: dict,
                     initial: dict[str, torch.Tensor]) -> tuple[Steps, list[float]]:
    """The same steps on the plain module (`_plain`), its adapters from `initial`, no hooks:
    the steps and each step's time (ms; CUDA events, else the host's clock). Each step runs
    with cyclic GC paused, as the offloaded steps do (engine/gc_pause.py), so the two differ
    in the offloading alone."""
    clock = clock_for(device)
    stamps: list[tuple[Any, Any]] = []

    @contextmanager
    def step(i: int) -> Iterator[None]:
        with paused_gc():
            start = clock.stamp()
            yield
            stamps.append((start, clock.stamp()))
    steps, _ = _train_steps(cfg, plain, inputs, initial, step)  # ends synchronized
    return steps, [clock.ns(a, b) / 1e6 for a, b in stamps]


def _train_run(job: Job, module: Any, inputs: dict, initial: dict[str, torch.Tensor], budget_mb: float | None,
               activations: Any, eviction: str, timed: bool) -> tuple[Steps, list[dict], list | None, float]:
    """workload.steps training steps through engine.offload(training=True), the adapters
    starting from `initial` and taking a plain SGD update after each step: the steps,
    the telemetry rows (with torch's peak of each step), and (`timed`) the last step's
    measured timeline and its waits on streamed weights (ms; 0 untimed or all resident)."""
    cfg = job.cfg
    h = offload(module, budget_mb=budget_mb, example_inputs=inputs, training=True, activations=activations,
                eviction=eviction, lookahead=cfg.weights.lookahead, checkpoint=checkpoint_path(job),
                backend=cfg.weights.backend, source=cfg.weights.source, **kernel_options(cfg))
    # The timed step's waits on streamed weights, stamped around each fetch, forward and backward.
    stamps = KernelStamps(h.executor, clock_for(h.device)) if timed and budget_mb is not None else None
    try:
        @contextmanager
        def step(i: int) -> Iterator[None]:
            last = timed and i == cfg.workload.steps - 1
            h.executor.time_steps = last
            with h.fetches_through(stamps if last else None), h.step():
                yield
        steps, peaks = _train_steps(cfg, module, inputs, initial, step)
        rows = [{**row, "torch_peak_bytes": peak} for row, peak in zip(h.telemetry(), peaks)]
        timeline = h.executor.step_timeline() if timed else None
    finally:
        h.remove()
    weight_stall = stamps.stall_ms() if stamps is not None else 0.0  # read once the steps ended
    return steps, rows, timeline, weight_stall


def _train_steps(cfg: Any, module: Any, inputs: dict, initial: dict[str, torch.Tensor],
                 step: Callable[[int], Any]) -> tuple[Steps, list[int | None]]:
    """workload.steps training steps of `module`, each's forward and backward inside `step(i)`
    (a context manager), the adapters starting from `initial` and taking a plain SGD update
    after each: the steps, and torch's peak of each."""
    adapters = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in adapters.items():
            p.copy_(initial[n])
    loss_fn = training_loss(cfg)
    cuda = next(iter(adapters.values())).device.type == "cuda"
    steps: Steps = []
    peaks: list[int | None] = []
    for i in range(cfg.workload.steps):
        for p in adapters.values():
            p.grad = None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with step(i):
            loss = loss_fn(module(**inputs))
            loss.backward()
            loss = loss.detach()  # the graph's nodes keep the step's saved-tensor hooks alive
        grads = lora_sgd({n: p for n, p in adapters.items() if p.grad is not None}, LEARNING_RATE)
        # On the host: a run's device memory is what it measures. The device gradients go
        # now, else the next step's peak counts this step's too; the copies do not wait,
        # so the loop runs as workload.loop says.
        steps.append(to_host((loss, grads)))
        del grads
        peaks.append(torch.cuda.max_memory_allocated() if cuda else None)
        end_of_step(cfg.workload.loop, loss.device, i)
    if cuda:
        torch.cuda.synchronize()  # the steps' copies to the host have landed
    return steps, peaks
