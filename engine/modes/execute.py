"""The modes that touch real memory: execute (run on the device) and materialize.

execute runs the simulator first on the very same config and trace, then the
executor, and prints the two side by side: the prediction a user checked
before deploying is the thing the measurement is held against.

    run_execute         workload.steps forwards of the spec-built model, its weights
                        streamed from the weight file through the executor; every
                        step's outputs compared bitwise with the all-resident forward
                        when the model fits
    run_train_execute   workload=train_lora: LoRA training steps (engine/executor/training.py),
                        activations spilled by the activation offloader; losses and
                        gradients compared with all-resident steps when they fit
    run_materialize     mode=materialize: random weights written to a weight file
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from engine.errors import BelowFloorError, ConfigError, ExecutorError
from engine.executor.offloader import ActivationOffloader
from engine.config import profile_mismatch
from engine.executor.setup import (bitwise_equal, compute_device, device_name, end_of_step, fits_resident, open_weight_file,
                                   run_settings, step_times, streamed_executor, weight_counts)
from engine.executor.training import (HOOK_FIELDS, AsManaged, StreamedWeights, check_train_order, match_reference,
                                      max_abs_diff, reference_steps, telemetry_row, to_host, train_step)
from engine.job import Job, Outcome, plan_report
from engine.measure.spread import typical_step_ms
from engine.node import node_failures
from engine.models import forward, make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.modes.simulate import prediction_md, prediction_report, run_simulation, timeline_files
from engine.policy import AccessOrder
from engine.policy.activations import build_activation_policy
from engine.policy.weights import WeightResidency
from engine.report import fmt_bytes, plan_md, relocations_note, steps_cell, table, varying_steps_note
from engine.models.spec import ModelSpec
from engine.units import budget_bytes
from engine.weightfile import materialize

log = logging.getLogger(__name__)

CPU_BACKEND_NOTE = ("note: weights.backend=cpu is the test backend (device memory is a capped host arena, "
                    "copies run on the CPU): its control path is the real one, its timings are not a GPU's")

# Quantities both sides know, in the order a user reads them: (label, key, unit).
# Inference compares weight traffic; training adds the activation side, whose
# pool is the Stagehand size-class pool.
_INFER_ROWS = (
    ("step time", "step_ms", "ms"),
    ("first step", "first_step_ms", "ms"),
    ("H2D bytes / step", "h2d_bytes", "bytes"),
    ("weight copies / step", "weight_copies", "count"),
    ("weight pool hits / step", "weight_hits", "count"),
    ("weight pool misses (demand fetches) / step", "weight_misses", "count"),
    ("peak device bytes", "peak_device_bytes", "bytes"),
    # The whole device less the context: the pool's peak plus torch's (measured on CUDA only).
    ("peak pool + torch bytes", "peak_pool_torch_bytes", "bytes"),
    # The link as it ran: machines of one kind differ, and a profile carries one machine's.
    ("H2D weight copy rate (bytes / copy time, last step)", "h2d_copy_gbps", "GB/s"),
)
_TRAIN_ROWS = (
    ("stall", "stall_ms", "ms"),
    ("spilled bytes / step", "spill_bytes", "bytes"),
    ("activation pool hits / step", "pool_hits", "count"),
    ("activation pool misses / step", "pool_misses", "count"),
)


# All-resident forwards run again at most, to find the outcome a streamed step's outputs
# match when the first differs (resident_outcomes).
REFERENCE_RETRIES = 32
# The prediction's name for a measured quantity where they differ: the measured step is
# the one the warm steps stand for (typical_step_ms), as the prediction's is their mean;
# what spills is what the simulator copies device to host.
_PREDICTED_AS = {"step_ms": "mean_step_ms", "spill_bytes": "d2h_bytes"}


def _cell(value: object, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "bytes":
        return fmt_bytes(value)
    if unit == "GB/s":
        return f"{value:.1f} GB/s"
    return f"{value:,}"


def predicted_counts(result: Any) -> dict:
    """The simulator's last-step weight counts, from its decision log (the executor logs the same)."""
    last_step = max((d.step for d in result.decisions), default=0)
    last = [d for d in result.decisions if d.step == last_step]
    return {"weight_copies": sum(d.action in ("fetch", "prefetch") for d in last),
            "weight_misses": sum(d.action == "fetch" for d in last),
            "weight_hits": sum(d.action == "hit" for d in last)}


def copy_gbps(spans: Iterable[tuple[str, float, float]], sizes: Mapping[str, int]) -> float | None:
    """Weight copies' bytes over their copy-engine time, GB/s (bytes per ns), from (weight,
    start ns, end ns) spans; None without any."""
    nbytes, busy = 0, 0.0
    for name, start, end in spans:
        if name in sizes and end > start:
            nbytes += sizes[name]
            busy += end - start
    return nbytes / busy if busy else None


def simulated_copies(result: Any) -> list[tuple[str, float, float]]:
    """The simulated weight copies of the last step's window (from the previous step's end):
    (weight, start ns, end ns); one copy at a time per direction, so starts and ends pair up."""
    since = result.step_ends_ns[-2] if len(result.step_ends_ns) > 1 else 0
    spans, started = [], None
    for t, track, what in result.events:
        if track != "h2d":
            continue
        kind, name = what.split(" ", 1)
        if kind == "start":
            started = (name, t)
        elif kind == "end" and started is not None and started[0] == name:
            if started[1] >= since:
                spans.append((name, float(started[1]), float(t)))
            started = None
    return spans


def measured_copies(timeline: list | None) -> list[tuple[str, float, float]]:
    """The executor's timed step's copies (step_timeline: track, name, start ms, end ms) in ns."""
    return [(name, a * 1e6, b * 1e6) for track, name, a, b in timeline or () if track == "h2d"]


def comparison(pred: dict, meas: dict, training: bool) -> list[dict]:
    """Predicted against measured, one row per quantity; `pred` holds the simulator's figures.
    Times are compared only on a GPU: the test backend's are a CPU's (error None)."""
    rows = []
    for label, key, unit in _INFER_ROWS + (_TRAIN_ROWS if training else ()):
        p = pred.get(_PREDICTED_AS.get(key, key))
        m = meas.get(key)
        timed_elsewhere = unit in ("ms", "GB/s") and meas["backend"] != "cuda"
        err = None if p in (None, 0) or m is None or timed_elsewhere else (m - p) / p
        rows.append({"what": label, "key": key, "unit": unit, "predicted": p, "measured": m,
                     "relative_error": err})
    return rows


def comparison_md(rows: list[dict], meas: dict, step_ms_range: Sequence[float] | None = None) -> str:
    """The comparison table and what the run's notes say about it (`step_ms_range`: the
    predicted warm steps', named where the measurement says they vary)."""
    gpu = meas["backend"] != "cpu"
    body = [[r["what"], _cell(r["predicted"], r["unit"]), _cell(r["measured"], r["unit"]),
             "not a GPU's time" if r["unit"] in ("ms", "GB/s") and not gpu
             else "-" if r["relative_error"] is None else f"{r['relative_error']:+.1%}"] for r in rows]
    md = ["## Measured beside predicted", "", table(["what", "predicted", "measured", "error"], body), ""]
    if not gpu:
        md.append(f"- weights.backend={meas['backend']} is the test backend: its times are a CPU's, not a GPU's, "
                  "so they are shown but not compared; bytes, copies and pool counts are compared exactly")
    for key, what in (("outputs_match_reference", "outputs"), ("loss_match_reference", "loss"),
                      ("grads_match_reference", "gradients")):
        if key in meas:
            verdict = {True: "bitwise equal to", False: "DIFFER from", None: "not compared with (no room for)"}
            if meas.get("reference_spread") and meas[key] is not None:
                verdict = {True: "within the run-to-run spread of", False: "DIFFER beyond the run-to-run spread of"}
            if meas.get("reference_outcomes", 1) > 1 and meas[key] is not None:
                verdict = {True: "bitwise equal, step by step, to one of", False: "DIFFER beyond the spread of"}
                if meas[key] and meas.get("outputs_bitwise") is False:
                    verdict[True] = "within the spread (not bitwise equal to any) of"
                spread = meas.get("reference_outcomes_spread")
                md.append(f"- {what} {verdict[meas[key]]} the all-resident forward's {meas['reference_outcomes']} "
                          "different outputs (its own kernels are not deterministic"
                          + (f"; they differ by up to {spread:.3g})" if spread else ")"))
                continue
            md.append(f"- {what} {verdict[meas[key]]} the all-resident run")
    if meas.get("reference_spread"):
        md.append(f"- the all-resident run itself differs between two runs by up to {meas['reference_spread']:.3g} "
                  "(a non-deterministic CUDA kernel, e.g. cuDNN's attention backward), so training is "
                  "compared within twice that spread or 2^-7 of each tensor's magnitude, not bitwise")
    md.append(f"- backend {meas['backend']}, {meas['steps']} steps (the first fills the pool; the table shows "
              + ("the mean of the warm ones" if meas.get("steps_vary") else "the median of the rest")
              + f": {steps_cell(meas['steps_ms'][1:] or meas['steps_ms'])})")
    if meas.get("steps_vary") and step_ms_range is not None:
        md.append(f"- {varying_steps_note(step_ms_range)}")
    note = relocations_note(meas)
    if note:
        md.append(note)
    return "\n".join(md)


def execute_mode(job: Job) -> Outcome:
    outcome = _execute(job)
    w = job.cfg.weights
    other = profile_mismatch(job.cfg.hardware, device_name(compute_device(w.backend, replica=True)))
    if other is None:
        return outcome
    outcome.report["hardware_mismatch"] = other
    return replace(outcome, notes=(f"execute: {other}",) + outcome.notes)


def _execute(job: Job) -> Outcome:
    if job.spec is None:  # a real module (engine/modules)
        from engine.modes.module import execute_module

        return execute_module(job)
    cfg = job.cfg
    if job.plan.below_floor:
        # Execute never runs below the floor; the simulator can show why.
        floor = job.plan.floor
        raise BelowFloorError(job.plan.budget_bytes, floor.bytes, floor.pair_bytes, tuple(floor.kernels),
                              job.plan.resident_bytes)
    training = cfg.workload.kind == "train_lora"
    # Check first, write last: a refusal (no device, a bad weight file) leaves no timeline behind.
    result = run_simulation(job, allow_below_floor=False, write_timeline=False)
    pred = result.prediction
    report = prediction_report(job, pred, result)
    over = node_failures(report["node"]) if "node" in report else []
    if over:  # each replica runs this command: none starts when together they would break the node
        raise ConfigError(f"{over[0]}; lower the replicas' pinned memory (activations/pool, weights.source) "
                          "or raise the node's limit")
    run = run_train_execute if training else run_execute
    meas = run(cfg, job.spec, job.trace, job.out_dir)
    from sim.prediction import steps_vary

    meas["steps_vary"] = steps_vary(pred)
    meas["step_ms"] = typical_step_ms(meas["steps_ms"], cfg.workload.steps, meas["steps_vary"])
    measured = meas.pop("timeline", None)
    timeline_files(job, result, measured=measured)
    sizes = job.trace.weight_sizes
    meas["h2d_copy_gbps"] = copy_gbps(measured_copies(measured), sizes)
    rows = comparison({**pred, **predicted_counts(result),
                       "h2d_copy_gbps": copy_gbps(simulated_copies(result), sizes)}, meas, training)
    report.update(measurement=meas, comparison=rows)
    md = (plan_md(job.plan.as_dict()) + "\n\n" + prediction_md(pred, job) + "\n\n"
          + comparison_md(rows, meas, pred["step_ms_range"]) + f"\n\ntelemetry: {job.out_dir / 'telemetry.jsonl'}")
    wrong = [k for k in ("outputs_match_reference", "loss_match_reference", "grads_match_reference")
             if meas.get(k) is False]
    notes = ((CPU_BACKEND_NOTE,) if cfg.weights.backend == "cpu" else ()) + tuple(
        f"execute: {k.split('_')[0]} differ from the all-resident run" for k in wrong)
    return Outcome(report, md, exit_code=1 if wrong else 0, notes=notes)


def _materialize_target(out: str | None, model_bytes: int) -> Path:
    if out is None:
        raise ConfigError("mode=materialize needs out=PATH, the weight file to write (e.g. out=/data/ltx.ptd)")
    path = Path(out).expanduser()
    if path.exists():
        raise ConfigError(f"out={out} already exists; remove it or pick another path (materialize never "
                          "overwrites a weight file)")
    parent = path.parent if path.parent.exists() else next(p for p in path.parents if p.exists())
    free = shutil.disk_usage(parent).free
    if free < model_bytes:
        raise ConfigError(f"out={out} needs {fmt_bytes(model_bytes)} but {parent} has {fmt_bytes(free)} free; "
                          "pick a filesystem with room")
    return path


def materialize_mode(job: Job) -> Outcome:
    if job.spec is None:  # a real module (engine/modules)
        from engine.modes.module import materialize_module

        return materialize_module(job)
    path = _materialize_target(job.cfg.out, job.spec.model_bytes)
    info = run_materialize(job.cfg, job.spec, path)
    report = {**plan_report(job), "materialized": info}
    md = (f"## Weight file: {job.spec.name}\n\n" + table(["what", "value"], [
        ["file", info["weights_file"]],
        ["tensors", f"{info['weights']:,}"],
        ["bytes", f"{info['model_bytes']:,} ({fmt_bytes(info['model_bytes'])})"],
        ["seed", info["seed"]],
    ]) + f"\n\nrun it: python -m engine +model={job.model_arg} mode=execute weights.file={info['weights_file']}"
        + (f" budget={job.cfg.budget:g}" if job.cfg.budget is not None else ""))
    return Outcome(report, md)


def run_materialize(cfg: Any, spec: ModelSpec, out_path: str | Path) -> dict:
    """Write random weights for `spec` (seed cfg.seed) to `out_path`; the GPU generates when there is one."""
    path = materialize(spec, out_path, seed=cfg.seed)
    return {"weights_file": str(path), "model": spec.name, "model_bytes": spec.model_bytes,
            "weights": len(spec.weights), "seed": cfg.seed}


def _start_run(cfg: Any, order: AccessOrder, out_dir: str | Path) -> tuple[int | None, int, Path]:
    """The budget in bytes, the floor, and the output directory (made). The floor
    first: a budget under it fails before any file or device memory is touched."""
    w = cfg.weights
    budget = budget_bytes(cfg.budget)
    floor_bytes = WeightResidency(order, budget, w.eviction, w.lookahead).floor.bytes
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return budget, floor_bytes, out_dir


def _write_telemetry(out_dir: Path, rows: list[dict]) -> None:
    with open(out_dir / "telemetry.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _check_order(order: AccessOrder, spec: ModelSpec) -> None:
    """The trace must be this spec's forward: same kernels, same weights."""
    if len(order) != len(spec.kernels):
        raise ExecutorError(f"the trace has {len(order)} kernels but model {spec.name} runs {len(spec.kernels)} "
                            "per forward; execute runs inference: use workload=infer and a matching trace")
    for i, k in enumerate(spec.kernels):
        if order.kernels[i] != k.name or tuple(order.reads[i]) != tuple(k.weights):
            raise ExecutorError(f"schedule divergence at kernel position {i}: the trace has {order.kernels[i]}, "
                                f"the model runs {k.name}; record or synthesize the trace for this model")


def _reference(spec: ModelSpec, host: dict, inputs: dict, device: torch.device) -> dict | None:
    """The all-resident forward's outputs, or None when the model does not fit beside the pool."""
    if device.type == "cuda" and not fits_resident(spec.model_bytes, device):
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


@dataclass(frozen=True)
class ResidentOutcomes:
    """How a run's outputs compare with the all-resident forward's: `match` (each bitwise one of
    its outcomes, or, where it has several, within their `spread`), `bitwise`, and how many
    different outcomes it gave."""

    match: bool
    bitwise: bool
    count: int
    spread: float


def allocated(device: torch.device) -> int:
    """The bytes torch's allocator holds for tensors on `device` (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def outputs_max_diff(a: dict, b: dict) -> float:
    """The largest elementwise |a - b| over two forwards' outputs (inf where a shape differs)."""
    diffs = [(a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else math.inf for k in b]
    return max(diffs, default=0.0)


def resident_outcomes(spec: ModelSpec, host: dict, inputs: dict, device: torch.device, reference: dict,
                      outputs: list[dict], tries: int) -> ResidentOutcomes:
    """Compare `outputs` with the all-resident forward. A forward whose own kernels are not
    deterministic (spec Llama decode's logits: two to four outcomes) is run again, up to
    `tries` times, only while some output matches none seen yet; an output still unmatched
    then passes when it lies within the outcomes' own spread (their largest difference),
    since a finite sample of a non-deterministic forward need not hold every outcome."""
    outcomes = [reference]

    def seen(out: dict) -> bool:
        return any(all(bitwise_equal(out[k], ref[k]) for k in ref) for ref in outcomes)

    pending = [o for o in outputs if not seen(o)]
    if pending:
        weights = {n: t.to(device, copy=True) for n, t in host.items()}
        with torch.no_grad():
            for _ in range(tries):
                out = forward(spec, DictSource(spec, weights), inputs)
                if not seen(out):
                    outcomes.append(out)
                    pending = [o for o in pending if not seen(o)]
                if not pending:
                    break
        del weights
    spread = max((outputs_max_diff(x, y) for i, x in enumerate(outcomes) for y in outcomes[:i]), default=0.0)
    within = all(min(outputs_max_diff(o, ref) for ref in outcomes) <= spread for o in pending) if spread > 0 else False
    return ResidentOutcomes(match=not pending or within, bitwise=not pending, count=len(outcomes), spread=spread)


def run_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps forwards through the executor; write telemetry.jsonl; return the measurement."""
    w = cfg.weights
    device = compute_device(w.backend, replica=True)
    order = trace.access_order()
    _check_order(order, spec)
    budget, floor_bytes, out_dir = _start_run(cfg, order, out_dir)
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        cuda = device.type == "cuda"
        # Torch's peak within each step, less what the run keeps to compare (the reference's
        # outputs, the earlier steps'), which a deployment does not: the bytes each holds are
        # what torch's allocator counts for it (its blocks, rounded).
        kept = -allocated(device)
        reference = _reference(spec, wf.tensors(), inputs, device)
        kept += allocated(device)
        with ExitStack() as run:  # the executor and its pool, given back before any rerun of the reference
            executor = streamed_executor(run, wf, order, backend=w.backend, source=w.source, budget_bytes=budget,
                                         eviction=w.eviction, lookahead=w.lookahead, keep_steps=None)
            outputs: list[dict] = []
            torch_peak = 0 if cuda else None
            with torch.no_grad():
                for i in range(cfg.workload.steps):
                    wf.check_intact()
                    before = allocated(device)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    with executor.step(timed=i == cfg.workload.steps - 1):  # the steady state, on the timeline
                        outputs.append(forward(spec, executor, inputs))
                    if cuda:
                        torch_peak = max(torch_peak, torch.cuda.max_memory_allocated(device) - kept)
                    kept += allocated(device) - before
                    end_of_step(cfg.workload.loop, device, i)
            telemetry = executor.telemetry()  # waits for the last step
            timeline = executor.step_timeline()
            pool_cap = executor.backend.cap_bytes
            reserved_peak = executor.backend.reserved_peak_bytes()
        compared = None if reference is None else resident_outcomes(
            spec, wf.tensors(), inputs, device, reference, outputs, REFERENCE_RETRIES)
    _write_telemetry(out_dir, telemetry)
    last = telemetry[-1]
    return {
        **run_settings(w),
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        "pool_cap_bytes": pool_cap,
        "pool_reserved_peak_bytes": reserved_peak,
        **step_times(telemetry),
        "h2d_bytes": last["h2d_bytes"],
        **weight_counts(last),
        # Pool refusals under the budget (fragmentation): answered by releasing the pool's
        # unused reserve, or else by copying the resident weights in again; the simulator
        # models neither.
        "reserve_releases": sum(row["reserve_releases"] for row in telemetry),
        "relocations": sum(row["relocations"] for row in telemetry),
        # those in the steps the median step is taken over: their stalls are in it
        "warm_relocations": sum(row["relocations"] for row in telemetry[1:]),
        "peak_device_bytes": max(row["peak_device_bytes"] for row in telemetry),
        "peak_pool_torch_bytes": None if torch_peak is None else
        max(row["held_device_bytes"] for row in telemetry) + torch_peak,
        "peak_torch_bytes": torch_peak,  # torch's allocator's part: activations, outputs, inputs
        "peak_resident_bytes": max(row["peak_resident_bytes"] for row in telemetry),
        "outputs_match_reference": None if compared is None else compared.match,
        "outputs_bitwise": None if compared is None else compared.bitwise,
        "reference_outcomes": 0 if compared is None else compared.count,
        "reference_outcomes_spread": None if compared is None else compared.spread,
        "weights_file": w.file,  # None: a temporary file, gone now
        "timeline": timeline,
    }


def run_train_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps LoRA training steps; write telemetry.jsonl; return the measurement.

    When the model and its saved activations fit the device beside nothing else,
    the same steps run first with every weight resident and no hooks, and every
    step's loss and gradients are compared with that reference."""
    w, act = cfg.weights, cfg.activations
    if cfg.workload.kind != "train_lora" or cfg.workload.lora_rank < 1:
        raise ExecutorError(f"training execute needs workload.kind=train_lora with lora_rank >= 1 (got "
                            f"{cfg.workload.kind}, rank {cfg.workload.lora_rank}); use workload=train_lora")
    device = compute_device(w.backend, replica=True)
    order = trace.access_order()
    check_train_order(order, spec)
    budget, floor_bytes, out_dir = _start_run(cfg, order, out_dir)
    policy = build_activation_policy(act, spec.num_layers)  # a bad activations config fails here too
    saved_bytes = sum(s.nbytes for r in trace.records for s in r.saved)
    steps = cfg.workload.steps
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
        compare = fits_resident(spec.model_bytes + saved_bytes, device)
        # The kernels run as a training script (and mode=record) runs them, not torch's
        # deterministic ones, whose time differs; a second reference run measures the spread.
        reference = reference_steps(spec, wf.tensors(), inputs, lora, steps, device) if compare else None
        spread = None
        if reference is not None and device.type == "cuda":
            # Some CUDA kernels (cuDNN's attention backward) are not deterministic: a second
            # reference run measures that spread, so a difference within it is not called wrong.
            spread = max_abs_diff(reference, reference_steps(spec, wf.tensors(), inputs, lora, steps, device))
        executor = streamed_executor(stack, wf, order, backend=w.backend, source=w.source, budget_bytes=budget,
                                     eviction=w.eviction, lookahead=w.lookahead, keep_steps=None)
        streamed = StreamedWeights(executor, len(spec.kernels))
        offloader = None
        if policy is not None:
            offloader = ActivationOffloader(policy, act, device, weights=AsManaged(streamed), keep_steps=None)
            stack.callback(offloader.close)
        results, peaks = [], []
        for i in range(steps):
            wf.check_intact()
            executor.time_steps = i == steps - 1  # the steady state, on the timeline
            results.append(to_host(train_step(spec, executor, streamed, offloader, inputs, lora, device)))
            end_of_step(cfg.workload.loop, device, i)
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        weight_rows = executor.telemetry()  # waits for the last step
        timeline = executor.step_timeline()
        act_rows = offloader.telemetry() if offloader is not None else [None] * steps
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the results' copies to the host have landed
    rows = [telemetry_row(wr, ar, peak) for wr, ar, peak in zip(weight_rows, act_rows, peaks)]
    _write_telemetry(out_dir, rows)
    losses = grads = None
    if reference is not None:
        losses, grads = match_reference(results, reference, spread)
    last = rows[-1]
    return {
        **run_settings(w),
        "activations": act.mode,
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        **step_times(rows),
        # The simulator's h2d_bytes counts every host-to-device copy: weights and activation restores.
        "h2d_bytes": last["weight_h2d_bytes"] + last["restore_bytes"],
        "weight_h2d_bytes": last["weight_h2d_bytes"],
        "reserve_releases": sum(r["weight_reserve_releases"] for r in rows),
        "relocations": sum(r["weight_relocations"] for r in rows),
        "warm_relocations": sum(r["weight_relocations"] for r in rows[1:]),
        **weight_counts(last, "weight_"),
        "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
        # On CUDA a row's held bytes are the weights' plus torch's allocator's peak (telemetry_row).
        "peak_pool_torch_bytes": max(r["held_device_bytes"] for r in rows) if device.type == "cuda" else None,
        "spill_bytes": last["spill_bytes"],
        "restore_bytes": last["restore_bytes"],
        "pool_hits": last["pool_hits"],
        "pool_misses": last["pool_misses"],
        "stall_ms": statistics.median(r["stall_time_ms"] for r in rows[1:] or rows),
        # The offloader's hooks, host us a call (median over the steps after the first).
        **({k: statistics.median(r[k] for r in rows[1:] or rows) for k in HOOK_FIELDS} if offloader is not None
           else {}),
        "loss_match_reference": losses,
        "grads_match_reference": grads,
        "weights_file": w.file,  # None: a temporary file, gone now
        "reference_spread": spread,  # 0 or None: compared bitwise
        "timeline": timeline,
    }
