"""mode=validate: trace=PATH -> the simulator's prediction beside the GPU's
measurement for a grid of configurations (engine/validation.py). The
measurements are read from beside the trace (X.measurements.json), or
measured on the GPU when there are none."""
from __future__ import annotations

from engine.config import profile_mismatch
from engine.job import Job, Outcome, config_summary
from engine.modes.calibrate import recorded_trace


def validate_mode(job: Job) -> Outcome:
    from engine import validation as v

    trace_path = recorded_trace(job, "validate")
    beside = v.measurements_path(trace_path)
    if beside.is_file():
        measurements = v.read_measurements(beside)
        where = f"measurements: {beside}"
    else:
        measurements = v.measure(job.cfg, job.spec, job.trace, v.grid(job.trace))
        written = job.out_dir / "measurements.json"
        v.write_measurements(written, measurements)
        where = f"measured now; wrote {written} (ship it as {beside.name} beside the trace)"
    rep = v.report(job.trace, measurements, job.cfg.hardware)
    md = v.report_md(rep) + "\n\n" + where
    other = profile_mismatch(job.cfg.hardware, measurements.get("device"), "the measurements were made on")
    if other is not None:
        rep["hardware_mismatch"] = other
    return Outcome({"config": config_summary(job), "validation": rep}, md,
                   notes=() if other is None else (f"validate: {other}",))
