"""mode=validate: the simulator's prediction beside the GPU's measurement for a grid of
configurations (engine/validation/), for a spec model or a real module
(engine/modes/module_validate.py). The prediction is the trace's: trace=PATH, a
recording, else the one synthesized from the config (the main command's). The
measurements are measurements=PATH, else those beside trace=PATH
(X.measurements.json), else measured on the GPU now. Beside the report, validate.png draws
it (engine/validation/plot.py)."""
from __future__ import annotations

from engine.config import profile_mismatch
from engine.errors import ConfigError
from engine.job import Job, Outcome, config_summary, is_module_model
from engine.modes.calibrate import recorded_trace
from engine.trace import WORKLOAD_SHAPE
from engine.validation.plot import plot_validation


def validate_mode(job: Job) -> Outcome:
    from engine import validation as v

    cfg = job.cfg
    trace_path = recorded_trace(job, "validate") if cfg.trace is not None else None
    beside = v.measurements_path(trace_path) if trace_path is not None else None
    if cfg.measurements is not None:
        measurements = v.read_measurements(cfg.measurements)
        where = f"measurements: {cfg.measurements}"
    elif beside is not None and beside.is_file():
        measurements = v.read_measurements(beside)
        where = f"measurements: {beside}"
    else:
        rows = v.grid(job.trace, cfg.activations.min_tensor_bytes)
        if is_module_model(cfg.model):
            from engine.modes.module_validate import measure_module

            measurements = measure_module(job, job.trace, rows)
        else:
            measurements = v.measure(cfg, job.spec, job.trace, rows)
        written = job.out_dir / "measurements.json"
        v.write_measurements(written, measurements)
        where = f"measured now; wrote {written}" + (
            "" if beside is None else f" (ship it as {beside.name} beside the trace)")
    notes = _check_measured(job, measurements)
    rep = v.report(job.trace, measurements, cfg.hardware)
    plot = job.out_dir / "validate.png"
    plot_validation(rep, plot)
    md = v.report_md(rep) + "\n\n" + where + f"\n\nplot: {plot}"
    other = profile_mismatch(cfg.hardware, measurements.get("device"), "the measurements were made on")
    if other is not None:
        rep["hardware_mismatch"] = other
        notes += (f"validate: {other}",)
    rep["notes"] = list(notes)
    return Outcome({"config": config_summary(job), "validation": rep}, "\n\n".join([md, *notes]), notes=notes)


def _check_measured(job: Job, measurements: dict) -> tuple[str, ...]:
    """The measurements were made of this job's model, at its depth and kind of step (else a
    ConfigError); a note for each of the workload's sizes they were made at another value of
    (a key the model does not read, such as a FLUX job's audio_tokens, changes nothing)."""
    cfg = job.cfg
    name, layers = (cfg.model.name, None) if job.spec is None else (job.spec.name, job.spec.num_layers)
    made = measurements.get("model")
    if made != name or (layers is not None and measurements.get("num_layers") not in (None, layers)):
        depth = "" if layers is None else f" ({measurements.get('num_layers')} layers)"
        raise ConfigError(f"the measurements were made of model {made}{depth}, not {name}"
                          + ("" if layers is None else f" ({layers} layers)")
                          + ": give the model they were made of, or measure this one (drop measurements=)")
    made_of = measurements.get("workload") or {}
    ours = job.trace.header.get("workload") or {}
    if made_of.get("kind", ours.get("kind")) != ours.get("kind"):
        raise ConfigError(f"the measurements were made of {made_of['kind']} steps and this job runs "
                          f"{ours.get('kind')} steps: give the workload they were made of, or measure this one "
                          "(drop measurements=)")
    differ = [k for k in WORKLOAD_SHAPE if k in made_of and k in ours and made_of[k] != ours[k]]
    return tuple(f"validate: the measurements were made with workload.{k}={made_of[k]} and this job has {ours[k]}; "
                 "where the model reads it, the rows compare different steps (set it as measured)" for k in differ)
