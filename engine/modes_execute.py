"""The modes that touch real memory: execute (run on the device) and materialize.

execute runs the simulator first on the very same config and trace, then the
executor, and prints the two side by side: the prediction a user checked
before deploying is the thing the measurement is held against.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from engine.app import Job, Outcome, _config_summary, _plan_keys, register_mode
from engine.errors import BelowFloorError, ConfigError
from engine.modes import _report, _simulate, prediction_md
from engine.report import fmt_bytes, plan_md, table

HOST_BACKEND_NOTE = ("note: weights.backend=host is the test backend (device memory is a capped host arena, "
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
)
_TRAIN_ROWS = (
    ("stall", "stall_ms", "ms"),
    ("spilled bytes / step", "spill_bytes", "bytes"),
    ("activation pool hits / step", "pool_hits", "count"),
    ("activation pool misses / step", "pool_misses", "count"),
)


def _cell(value: object, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "bytes":
        return fmt_bytes(value)
    return f"{value:,}"


def predicted_counts(result: object) -> dict:
    """The simulator's last-step weight counts, from its decision log (the executor logs the same)."""
    last_step = max((d.step for d in result.decisions), default=0)
    last = [d for d in result.decisions if d.step == last_step]
    return {"weight_copies": sum(d.action in ("fetch", "prefetch") for d in last),
            "weight_misses": sum(d.action == "fetch" for d in last),
            "weight_hits": sum(d.action == "hit" for d in last)}


def comparison(pred: dict, meas: dict, training: bool) -> list[dict]:
    """Predicted against measured, one row per quantity; `pred` holds the simulator's figures.
    Times are compared only on a GPU: the test backend's are a CPU's (error None)."""
    rows = []
    for label, key, unit in _INFER_ROWS + (_TRAIN_ROWS if training else ()):
        p = pred["d2h_bytes"] if key == "spill_bytes" else pred.get(key)
        m = meas.get(key)
        timed_elsewhere = unit == "ms" and meas["backend"] != "cuda"
        err = None if p in (None, 0) or m is None or timed_elsewhere else (m - p) / p
        rows.append({"what": label, "key": key, "unit": unit, "predicted": p, "measured": m,
                     "relative_error": err})
    return rows


def comparison_md(rows: list[dict], meas: dict) -> str:
    gpu = meas["backend"] == "cuda"
    body = [[r["what"], _cell(r["predicted"], r["unit"]), _cell(r["measured"], r["unit"]),
             "not a GPU's time" if r["unit"] == "ms" and not gpu
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
            md.append(f"- {what} {verdict[meas[key]]} the all-resident run")
    if meas.get("reference_spread"):
        md.append(f"- the all-resident run itself differs between two runs by up to {meas['reference_spread']:.3g} "
                  "(a non-deterministic CUDA kernel, e.g. cuDNN's attention backward), so training is "
                  "compared within twice that spread, not bitwise")
    md.append(f"- backend {meas['backend']}, {meas['steps']} steps (the first fills the pool; "
              "the table shows the median of the rest)")
    if meas.get("relocations"):
        md.append(f"- {meas['relocations']} relocations: the pool refused a block under the budget "
                  "(fragmentation) and the resident weights were copied in again; the simulator "
                  "does not model this, so measured times include stalls it did not predict")
    return "\n".join(md)


@register_mode("execute")
def execute_mode(job: Job) -> Outcome:
    cfg = job.cfg
    if job.plan.below_floor:
        # Execute never runs below the floor; the simulator can show why.
        floor = job.plan.floor
        raise BelowFloorError(job.plan.budget_bytes, floor.bytes, tuple(floor.kernels))
    training = cfg.workload.kind == "train_lora"
    if cfg.weights.backend == "host":
        print(HOST_BACKEND_NOTE, file=sys.stderr)
    result = _simulate(job, allow_below_floor=False)
    pred = result.prediction
    if training:
        from engine.executor.train import run_train_execute as run
    else:
        from engine.executor.execute import run_execute as run
    meas = run(cfg, job.spec, job.trace, job.out_dir)
    rows = comparison({**pred, **predicted_counts(result)}, meas, training)
    report = _report(job, pred, result)
    report.update(measurement=meas, comparison=rows)
    md = (plan_md(job.plan.as_dict()) + "\n\n" + prediction_md(pred, job) + "\n\n"
          + comparison_md(rows, meas) + f"\n\ntelemetry: {job.out_dir / 'telemetry.jsonl'}")
    wrong = [k for k in ("outputs_match_reference", "loss_match_reference", "grads_match_reference")
             if meas.get(k) is False]
    for k in wrong:
        print(f"execute: {k.split('_')[0]} differ from the all-resident run", file=sys.stderr)
    return Outcome(report, md, exit_code=1 if wrong else 0)


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


def _model_choice(job: Job) -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get("model") or job.cfg.model.name


@register_mode("materialize")
def materialize_mode(job: Job) -> Outcome:
    from engine.executor.execute import run_materialize

    path = _materialize_target(job.cfg.out, job.spec.model_bytes)
    info = run_materialize(job.cfg, job.spec, path)
    plan = job.plan.as_dict()
    report = {"config": _config_summary(job), "plan": plan, **_plan_keys(plan), "materialized": info}
    md = (f"## Weight file: {job.spec.name}\n\n" + table(["what", "value"], [
        ["file", info["weights_file"]],
        ["tensors", f"{info['weights']:,}"],
        ["bytes", f"{info['model_bytes']:,} ({fmt_bytes(info['model_bytes'])})"],
        ["seed", info["seed"]],
    ]) + f"\n\nrun it: python -m engine +model={_model_choice(job)} mode=execute weights.file={info['weights_file']}"
        + (f" budget={job.cfg.budget:g}" if job.cfg.budget is not None else ""))
    return Outcome(report, md)
