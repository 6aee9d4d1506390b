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
steps all resident (within that run's own spread on a GPU, bitwise on the CPU).

The weights come from weights.file: a .safetensors file or a diffusers /
transformers model directory, mapped and registered, never copied whole. The
model config's `grouping` (block, the default, or leaf) and `blocks` (module
names) choose the kernels (engine/modules/kernels.py). `grouping: auto` (inference)
records each grouping (record writes trace-block.jsonl and trace-leaf.jsonl) and
execute keeps the one the simulator predicts fastest, as engine.offload(grouping="auto").
"""
from __future__ import annotations

import json
import logging
import statistics
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import OmegaConf, open_dict

from engine.config import WEIGHT_SOURCES, ActivationsConfig
from engine.errors import ConfigError
from engine.executor.setup import compute_device, device_name, end_of_step, fits_resident
from engine.executor.training import LEARNING_RATE, match_reference, max_abs_diff, to_host
from engine.gc_pause import paused_gc
from engine.measure.clocks import clock_for
from engine.models.lora import lora_sgd
from engine.job import Job, Outcome, config_summary, plan_keys
from engine.plan import make_plan
from engine.modules.adapters import ALL_LINEAR, TrainingLoss, add_lora, enable_checkpointing
from engine.modules.build import build_module, example_inputs, first_output
from engine.modules.checkpoint import load_resident, module_weights
from engine.modules.kernels import GROUPINGS
from engine.modes.simulate import timeline_files
from engine.modules.offload import fastest_grouping, offload, predict, record
from engine.modules.outcomes import Comparison
from engine.modules.training import sized_for
from engine.report import fmt_bytes, launches_cell, relocations_note, steps_cell, table
from engine.trace import Trace, write_trace
from engine.units import budget_bytes
from engine.weightfile import materialize

log = logging.getLogger(__name__)

STEPS_ROW = "measured steps after the first"
NO_CHECKPOINT = ("model {name} is a real module and weights.file is not set: point it at a .safetensors file "
                 "or a model directory, or write random weights with mode=materialize out=PATH")


def _checkpoint(job: Job) -> Path:
    if job.cfg.weights.file is None:
        raise ConfigError(NO_CHECKPOINT.format(name=job.cfg.model.name))
    return Path(job.cfg.weights.file).expanduser()


def _training(cfg: Any) -> bool:
    return cfg.workload.kind == "train_lora"


def _setup(job: Job) -> tuple[Any, dict, torch.device]:
    cfg = job.cfg
    device = compute_device(cfg.weights.backend, no_cuda=(
        f"mode={cfg.mode} runs model {cfg.model.name} on a CUDA GPU and none is visible; simulate it here "
        "with mode=simulate (from its config, or trace=PATH recorded on a GPU machine), or run it on the CPU "
        "with weights.backend=cpu (timings not a GPU's)"), replica=True)
    if _training(cfg) and device.type == "cuda" and not cfg.workload.cudnn_attention:
        # cuDNN's attention backward makes illegal memory accesses on some models (diffusers
        # FLUX.1-dev under torch 2.11, plain or streamed): this process's steps take the others.
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("attention runs without cuDNN's kernels in this training run (workload.cudnn_attention=true "
                 "allows them)")
    module = _built(cfg, device)
    return module, example_inputs(cfg.model, module, cfg.workload, device, seed=cfg.seed), device


def _built(cfg: Any, device: torch.device) -> Any:
    """The config's module on the meta device; for a LoRA step with its adapters (on `device`)
    and, where the workload says so, per-block activation checkpointing."""
    module = build_module(cfg.model)
    if _training(cfg):
        targets = cfg.model.get("lora_targets", ALL_LINEAR)
        add_lora(module, cfg.workload.lora_rank, targets if isinstance(targets, str) else list(targets),
                 device=device, seed=cfg.seed + 1)
        if cfg.workload.checkpointing:
            enable_checkpointing(module)
    return module


def _loss(cfg: Any) -> TrainingLoss | None:
    return TrainingLoss(seed=cfg.seed + 2) if _training(cfg) else None


def _kernels(cfg: Any) -> dict:
    """The model config's kernel grouping: `grouping` (block | leaf) and `blocks` (names)."""
    blocks = cfg.model.get("blocks")
    return {"grouping": cfg.model.get("grouping", "block"),
            "blocks": None if blocks is None else list(blocks)}


def _groupings(cfg: Any) -> tuple[str, ...]:
    """The groupings a module mode records: the model config's, or each of GROUPINGS for
    `grouping: auto` (inference: execute keeps the one the simulator predicts fastest)."""
    grouping = _kernels(cfg)["grouping"]
    if grouping != "auto":
        return (grouping,)
    if _training(cfg):
        raise ConfigError("model.grouping=auto chooses by simulating inference steps; workload=train_lora takes "
                          f"one of {', '.join(GROUPINGS)}")
    return GROUPINGS


def _record(job: Job, module: Any, inputs: dict, grouping: str) -> Trace:
    cfg = job.cfg
    return record(module, inputs, backend=cfg.weights.backend, checkpoint=_checkpoint(job),
                  source=cfg.weights.source, name=cfg.model.name, workload=_workload(cfg), loss_fn=_loss(cfg),
                  **{**_kernels(cfg), "grouping": grouping})


def _trace_file(grouping: str, recorded: int) -> str:
    """Where a module mode writes its recording: trace.jsonl, or one per grouping."""
    return "trace.jsonl" if recorded == 1 else f"trace-{grouping}.jsonl"


def _predicted_from(job: Job, recorded: int = 1) -> str:
    """The report's line on what the prediction replays: trace=PATH, or the recording this run
    made first, of `recorded` groupings (the host's pace while it recorded is in it)."""
    if job.trace is not None:
        return f"predicted from trace={job.cfg.trace}"
    path = job.out_dir / _trace_file(job.cfg.model.grouping, recorded)
    return f"predicted from the recording this run made first ({path}; replay it with trace=PATH)"


def pace_note(trace: Trace, resident_ms: float | None) -> str | None:
    """The report's line setting the plain step measured here beside the all-resident step
    the recording measured (header "plain_step_ns" where the host bounded it, else
    "pipelined_step_ns", through the hooks; none in a synthesized trace): a step the host
    bounds moves with the host's pace, and a lent host's pace moves between a recording and
    a run (benchmarks/results/host-pace-h200-2026-11-29.md)."""
    h = trace.header
    key = "plain_step_ns" if h.get("plain_step_ns") else "pipelined_step_ns"
    if resident_ms is None or not h.get(key):
        return None
    ms, what = h[key] / 1e6, "the plain step" if key == "plain_step_ns" else "the step through the hooks"
    return (f"every weight resident, the plain module's step ran {resident_ms:.2f} ms here; the recording "
            f"measured {what} at {ms:.2f} ms ({resident_ms / ms - 1:+.1%}): where the host bounds the step, "
            "the prediction from that recording moves with the host's pace as it was then")


def _keep_grouping(cfg: Any, grouping: str) -> None:
    """Write the grouping an "auto" came to into the config, so the offloads and the report see it."""
    with open_dict(cfg.model):
        cfg.model.grouping = grouping


def _workload(cfg: Any) -> dict:
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
    groupings = _groupings(job.cfg)
    module, inputs, device = _setup(job)
    paths = []
    for grouping in groupings:
        trace = _record(job, module, inputs, grouping)
        paths.append(job.out_dir / _trace_file(grouping, len(groupings)))
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
    if _training(job.cfg):
        rows.insert(4, ["saved for backward", fmt_bytes(sum(s.nbytes for r in trace.records for s in r.saved))])
    md = f"## Recorded {h['model']} ({job.cfg.workload.name})\n\n" + table(["what", "value"], rows)
    report = {"config": config_summary(job), "trace": str(path), "records": len(trace.records),
              "step_ns": h["step_ns"], "device": h["device"]}
    return Outcome(report, md + f"\n\nreplay it: python -m engine model={job.model_arg} trace={path} budget=MB")


def _activations(cfg: Any, trace: Trace) -> Any:
    """The run's activations config: off for inference; for training the configured one,
    its pool sized from the trace when activations.pool.exact (as the job does for trace=)."""
    if not _training(cfg):
        return OmegaConf.structured(ActivationsConfig)
    return sized_for(cfg.activations, trace)


def _timeline(job: Job, trace: Trace, budget: int | None, pred: dict, measured: list) -> None:
    """The chosen policy simulated on the recorded trace, with the measured last step beside it."""
    from sim import simulate

    cfg = job.cfg
    weights = OmegaConf.merge(cfg.weights, {"eviction": pred["eviction"], "lookahead": pred["lookahead"]})
    result = simulate(trace, weights, _activations(cfg, trace), cfg.hardware, budget,
                      cfg.workload.steps, allow_below_floor=False, loop=cfg.workload.loop)
    timeline_files(job, result, measured)


def execute_module(job: Job) -> Outcome:
    cfg = job.cfg
    if cfg.weights.source not in WEIGHT_SOURCES:
        raise ConfigError(f"weights.source={cfg.weights.source!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    groupings = _groupings(cfg)
    module, inputs, device = _setup(job)
    path = _checkpoint(job)
    budget = budget_bytes(cfg.budget)
    if job.trace is not None:
        recorded = job.trace.header.get("grouping")
        if len(groupings) > 1:  # the trace's kernels are the ones to run
            if recorded not in GROUPINGS:
                raise ConfigError("model.grouping=auto with trace=PATH: this recording does not name its grouping; "
                                  f"set model.grouping to the one it was recorded with ({', '.join(GROUPINGS)})")
            _keep_grouping(cfg, recorded)
        elif recorded is not None and recorded != groupings[0]:
            raise ConfigError(f"trace={cfg.trace} was recorded with grouping {recorded} and model.grouping is "
                              f"{groupings[0]}: set model.grouping={recorded} (or auto, which runs the trace's)")
        trace, pred = job.trace, _predict(cfg, job.trace, budget)
    else:
        trace, pred = _choose_recording(job, module, inputs, groupings, budget)
    # What an "auto" chose on the trace recorded just now (job.prepare chose on trace=PATH's).
    cfg.weights.eviction, cfg.weights.lookahead = pred["eviction"], pred["lookahead"]
    if _training(cfg):
        return _execute_training(job, module, inputs, device, trace, pred)
    comparison, resident_ms = None, []  # the plain module's steps, where it fits
    if fits_resident(sum(trace.weight_sizes.values()), device):  # the plain module, loaded as from_pretrained would
        plain = load_resident(build_module(cfg.model), path, device)
        outputs, resident_ms = plain_infer_run(cfg, plain, device, inputs)
        del plain
        comparison = Comparison(outputs)
        del outputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resident parameters are listed in the report instead
        h = offload(module, budget_mb=cfg.budget, example_inputs=inputs, eviction=pred["eviction"],
                    lookahead=cfg.weights.lookahead, checkpoint=path, backend=cfg.weights.backend,
                    source=cfg.weights.source, **_kernels(cfg))
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
    _timeline(job, trace, budget, pred, timeline)
    steady = rows[1:] or rows
    resident_steady = resident_ms[1:] or resident_ms
    measured = {"step_ms": statistics.median(r["step_ms"] for r in steady), "h2d_bytes": rows[-1]["h2d_bytes"],
                "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
                "steps_ms": [r["step_ms"] for r in rows],
                # The same steps of the plain module, every weight resident (where it fits).
                "resident_step_ms": statistics.median(resident_steady) if resident_steady else None,
                "resident_steps_ms": resident_ms}
    if cuda:  # the whole device less the context: the weights' held peak plus torch's allocator's,
        # less the plain outputs kept to compare with (no part of the run)
        measured["peak_pool_torch_bytes"] = (max(r["held_device_bytes"] for r in rows)
                                             + torch.cuda.max_memory_allocated(device)
                                             - (0 if comparison is None else comparison.held_bytes))
    report = {"config": config_summary(job), **_plan(job, trace), "prediction": pred, "measurement": measured,
              "bitwise": None if verdict is None else verdict.bitwise,
              "outcomes": None if verdict is None else verdict.summary(),
              "device": device_name(device), "resident_params": h.resident_params}
    md = (f"## Executed {cfg.model.name} at budget {cfg.budget} MB ({pred['eviction']})\n\n"
          + table(["", "predicted", "measured"], [
              ["step time", f"{pred['step_ms']:.2f} ms", f"{measured['step_ms']:.2f} ms"],
              [STEPS_ROW, "", steps_cell([r["step_ms"] for r in steady])],
              ["H2D bytes / step", fmt_bytes(pred["h2d_bytes"]), fmt_bytes(measured["h2d_bytes"])],
              ["peak pool bytes", fmt_bytes(pred["peak_device_bytes"]), fmt_bytes(measured["peak_device_bytes"])],
              ["peak pool + torch bytes", fmt_bytes(pred["peak_pool_torch_bytes"]),
               fmt_bytes(measured["peak_pool_torch_bytes"]) if cuda else "not measured (cpu)"],
              *([["step of the plain module, every weight resident", "", f"{measured['resident_step_ms']:.2f} ms"],
                 [f"{STEPS_ROW}, plain module", "", steps_cell(resident_steady)]]
                if resident_ms else [])])
          + ("" if "groupings_ms" not in pred else "\n\nmodel.grouping=auto kept " + pred["grouping"] + ", predicted "
             + ", ".join(f"{g} {ms:.2f} ms" for g, ms in pred["groupings_ms"].items()))
          + f"\n\n{_predicted_from(job, len(groupings))}"
          + "\n\noutputs bitwise equal to the plain module's (loaded from weights.file, every weight resident): "
          + ("not compared (the model does not fit)" if verdict is None else verdict.text())
          + (f"\n\n{pace}" if (pace := pace_note(trace, measured["resident_step_ms"])) else ""))
    return Outcome(report, md, exit_code=0 if verdict is None or verdict.passed else 1)


def _predict(cfg: Any, trace: Trace, budget: int | None) -> dict:
    return predict(trace, cfg.hardware, budget, cfg.weights.lookahead, cfg.weights.eviction, cfg.weights.source,
                   cfg.weights.backend, _activations(cfg, trace), cfg.workload.loop)


def _choose_recording(job: Job, module: Any, inputs: dict, groupings: tuple[str, ...],
                      budget: int | None) -> tuple[Trace, dict]:
    """Record `groupings` (each written beside the report: replay it with trace=PATH) and
    predict it; for several, keep the one the simulator predicts fastest, as
    engine.offload(grouping="auto") does (engine.modules.offload.fastest_grouping)."""
    cfg = job.cfg

    def attempt(grouping: str) -> tuple[Trace, dict]:
        trace = _record(job, module, inputs, grouping)
        write_trace(job.out_dir / _trace_file(grouping, len(groupings)), trace)
        return trace, _predict(cfg, trace, budget)

    if len(groupings) == 1:
        return attempt(groupings[0])
    best, tried = fastest_grouping(attempt)
    _keep_grouping(cfg, best)
    return tried[best]


def _plan(job: Job, trace: Trace) -> dict:
    """The plan's keys a report (and a sweep's summary) carries: the job's, or the trace's just recorded."""
    from sim.simulator import backend_granule

    cfg = job.cfg
    plan = job.plan or make_plan(
        model=cfg.model.name, workload=cfg.workload.name,
        param_count=trace.header.get("params") or sum(trace.weight_sizes.values()) // 2,
        order=trace.access_order(), budget_mb=cfg.budget, lookahead=cfg.weights.lookahead,
        granule=backend_granule(cfg.weights, cfg.hardware))
    return plan_keys(plan.as_dict())


Steps = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]  # per step: the loss, the adapters' gradients


def _train_run(job: Job, module: Any, inputs: dict, initial: dict[str, torch.Tensor], budget_mb: float | None,
               activations: Any, eviction: str, timed: bool) -> tuple[Steps, list[dict], list | None]:
    """workload.steps training steps through engine.offload(training=True), the adapters
    starting from `initial` and taking a plain SGD update after each step: the steps,
    the telemetry rows (with torch's peak of each step), and (`timed`) the last step's
    measured timeline."""
    cfg = job.cfg
    h = offload(module, budget_mb=budget_mb, example_inputs=inputs, training=True, activations=activations,
                eviction=eviction, lookahead=cfg.weights.lookahead, checkpoint=_checkpoint(job),
                backend=cfg.weights.backend, source=cfg.weights.source, **_kernels(cfg))
    try:
        def step(i: int) -> Any:
            h.executor.time_steps = timed and i == cfg.workload.steps - 1
            return h.step()
        steps, peaks = _train_steps(cfg, module, inputs, initial, step)
        rows = [{**row, "torch_peak_bytes": peak} for row, peak in zip(h.telemetry(), peaks)]
        timeline = h.executor.step_timeline() if timed else None
    finally:
        h.remove()
    return steps, rows, timeline


def _train_steps(cfg: Any, module: Any, inputs: dict, initial: dict[str, torch.Tensor],
                 step: Callable[[int], Any]) -> tuple[Steps, list[int | None]]:
    """workload.steps training steps of `module`, each's forward and backward inside `step(i)`
    (a context manager), the adapters starting from `initial` and taking a plain SGD update
    after each: the steps, and torch's peak of each."""
    adapters = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in adapters.items():
            p.copy_(initial[n])
    loss_fn = _loss(cfg)
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


def plain_infer_run(cfg: Any, plain: Any, device: torch.device,
                    inputs: dict) -> tuple[list[torch.Tensor], list[float]]:
    """workload.steps forwards of the plain module (loaded as from_pretrained would), looped as
    the offloaded ones (workload.loop), each with cyclic GC paused as they run: each step's
    output (what the offloaded outputs are compared with) and time (ms; CUDA events, else the
    host's clock)."""
    clock = clock_for(device)
    stamps: list[tuple[Any, Any]] = []
    outputs = []
    with torch.no_grad():
        for i in range(cfg.workload.steps):
            with paused_gc():
                start = clock.stamp()
                out = first_output(plain(**inputs))
                stamps.append((start, clock.stamp()))
            outputs.append(out.clone())  # a module may hand back a buffer it writes again
            end_of_step(cfg.workload.loop, device, i)
    clock.synchronize()
    return outputs, [clock.ns(a, b) / 1e6 for a, b in stamps]


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


def _plain(job: Job, device: torch.device) -> Any:
    """The module built again with its adapters, its base loaded from weights.file onto the
    device (load_resident): what a training script without offloading runs."""
    return load_resident(_built(job.cfg, device), _checkpoint(job), device, frozen_only=True)


def _execute_training(job: Job, module: Any, inputs: dict, device: torch.device, trace: Trace,
                      pred: dict) -> Outcome:
    """workload=train_lora: the reference steps all resident (when the weights and the saved
    tensors fit), then the same steps under the budget and the activations policy."""
    cfg = job.cfg
    # On the host: each run starts its adapters from these, and the device's peak is the run's own.
    initial = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters() if p.requires_grad}
    act = None if cfg.activations.mode == "off" else OmegaConf.to_container(_activations(cfg, trace), resolve=True)
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
        steps, rows, timeline = _train_run(job, module, inputs, initial, cfg.budget, act, pred["eviction"],
                                           timed=True)
    _timeline(job, trace, budget_bytes(cfg.budget), pred, timeline)
    steady = rows[1:] or rows
    torch_peak = [r["torch_peak_bytes"] for r in rows]
    measured = {"step_ms": statistics.median(r["weight_step_ms"] for r in steady),
                "steps_ms": [r["weight_step_ms"] for r in rows],
                "h2d_bytes": rows[-1]["weight_h2d_bytes"] + rows[-1].get("restore_bytes", 0),
                "d2h_bytes": rows[-1].get("spill_bytes", 0),
                "pool_peak_bytes": max(r["weight_held_device_bytes"] for r in rows),
                "torch_peak_bytes": None if None in torch_peak else max(torch_peak),
                "activations_spilled": rows[-1].get("activations_spilled", 0),
                "pool_misses": rows[-1].get("pool_misses", 0),
                "stall_ms": statistics.median(r.get("stall_time_ms", 0) for r in steady),
                "reserve_releases": sum(r.get("weight_reserve_releases", 0) for r in rows),
                "relocations": sum(r.get("weight_relocations", 0) for r in rows),
                "warm_relocations": sum(r.get("weight_relocations", 0) for r in steady),
                "resident_step_ms": resident_ms,  # the same steps of the plain module, every weight resident
                "resident_steps_ms": resident_runs}
    if measured["torch_peak_bytes"] is not None:
        measured["peak_pool_torch_bytes"] = measured["pool_peak_bytes"] + measured["torch_peak_bytes"]
    losses, grads = (None, None) if reference is None else match_reference(steps, reference, spread)
    (job.out_dir / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = {"config": config_summary(job), **_plan(job, trace), "prediction": pred, "measurement": measured,
              "reference_spread": spread,
              "loss_match_reference": losses, "grads_match_reference": grads, "device": device_name(device)}
    table_rows = [
        ["step time", f"{pred['step_ms']:.2f} ms", f"{measured['step_ms']:.2f} ms"],
        [STEPS_ROW, "", steps_cell([r["weight_step_ms"] for r in steady])],
        ["H2D bytes / step (weights, restores)", fmt_bytes(pred["h2d_bytes"]), fmt_bytes(measured["h2d_bytes"])],
        ["D2H bytes / step (spills)", fmt_bytes(pred["d2h_bytes"]), fmt_bytes(measured["d2h_bytes"])],
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
          + f"\n\n{_predicted_from(job)}\n\nagainst the same steps of the plain module: {compared}"
          + (f"\n\n{pace}" if (pace := pace_note(trace, resident_ms)) else "")
          + f"\n\ntelemetry: {job.out_dir / 'telemetry.jsonl'}"
          + (f"\n\n{note}" if (note := relocations_note(measured)) else ""))
    wrong = losses is False or grads is False
    return Outcome(report, md, exit_code=1 if wrong else 0)
