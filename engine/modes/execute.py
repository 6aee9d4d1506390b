"""The modes that touch real memory: execute (run on the device) and materialize.

execute runs the simulator first on the very same config and trace, then the
executor (a spec model: engine/modes/spec_run.py; a real module:
engine/modes/module.py), and prints the two side by side: the prediction a user
checked before deploying is the thing the measurement is held against.
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from engine.errors import BelowFloorError, ConfigError
from engine.config import profile_mismatch
from engine.executor.setup import compute_device, device_name
from engine.job import Job, Outcome, plan_report
from engine.measure.spread import typical_step_ms
from engine.node import node_failures
from engine.modes.simulate import prediction_md, prediction_report, run_simulation, timeline_files
from engine.modes.spec_run import run_execute, run_materialize, run_train_execute
from engine.report import fmt_bytes, plan_md, relocations_note, steps_cell, table, varying_steps_note


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


# The prediction's name for a measured quantity where they differ: the measured step is
# the one the warm steps stand for (typical_step_ms), as the prediction's is their mean;
# what spills is what the simulator copies device to host.
_PREDICTED_AS = {"step_ms": "mean_step_ms", "spill_bytes": "d2h_bytes"}
# A spec's training step saves what the spec declares the GPU's kernels save; on the CPU
# backend F.rms_norm, decomposed, saves its float32 upcast (and sizes change the pool's), so
# these quantities are the CPU's there, shown and not compared.
_SAVES_KEYS = ("h2d_bytes", "peak_device_bytes", "spill_bytes", "pool_hits", "pool_misses")


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
    Times are compared only on a GPU: the test backend's are a CPU's (error None), as are a
    training step's saved activations there (_SAVES_KEYS)."""
    rows = []
    for label, key, unit in _INFER_ROWS + (_TRAIN_ROWS if training else ()):
        p = pred.get(_PREDICTED_AS.get(key, key))
        m = meas.get(key)
        cpu = meas["backend"] != "cuda"
        why = ("not a GPU's time" if cpu and unit in ("ms", "GB/s")
               else "the CPU's saves" if cpu and training and key in _SAVES_KEYS else None)
        err = None if p in (None, 0) or m is None or why else (m - p) / p
        rows.append({"what": label, "key": key, "unit": unit, "predicted": p, "measured": m,
                     "relative_error": err, "not_compared": why})
    return rows


def comparison_md(rows: list[dict], meas: dict, step_ms_range: Sequence[float] | None = None) -> str:
    """The comparison table and what the run's notes say about it (`step_ms_range`: the
    predicted warm steps', named where the measurement says they vary)."""
    gpu = meas["backend"] != "cpu"

    def verdict(r: dict) -> str:
        err = r["relative_error"]
        return r.get("not_compared") or ("-" if err is None else f"{err:+.1%}")

    body = [[r["what"], _cell(r["predicted"], r["unit"]), _cell(r["measured"], r["unit"]), verdict(r)] for r in rows]
    md = ["## Measured beside predicted", "", table(["what", "predicted", "measured", "error"], body), ""]
    if not gpu:
        saves = any(r.get("not_compared") == "the CPU's saves" for r in rows)
        md.append(f"- weights.backend={meas['backend']} is the test backend: its times are a CPU's, not a GPU's, "
                  "so they are shown but not compared; bytes, copies and pool counts are compared exactly"
                  + ("; but for the saved activations': the spec declares what the GPU's kernels save, and "
                     "the CPU's save more (F.rms_norm, decomposed there, saves its float32 upcast)"
                     if saves else ""))
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
