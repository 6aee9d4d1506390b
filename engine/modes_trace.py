"""The modes that close the loop with the GPU: record, calibrate, validate.

    record     one step on the GPU, timed kernel by kernel -> trace.jsonl (engine/record.py)
    calibrate  trace=PATH (recorded) or trace=DIR (every recorded trace in it, fitted
               together) -> a hardware profile yaml (engine/calibrate.py);
               out=conf/hardware/NAME.yaml writes it where hardware=NAME finds it
    validate   trace=PATH -> prediction beside measurement for a grid of configurations
               (engine/validate.py); the measurements are read from beside the trace
               (X.measurements.json), or measured on the GPU when there are none
"""
from __future__ import annotations

import shutil
from pathlib import Path

from engine.app import Job, Outcome, _config_summary, register_mode
from engine.errors import ConfigError
from engine.report import table


def _recorded(job: Job, mode: str) -> str:
    if job.cfg.trace is None:
        raise ConfigError(f"mode={mode} needs trace=PATH, a trace recorded with mode=record")
    if job.trace.header.get("source") != "recorded":
        raise ConfigError(f"mode={mode}: trace={job.cfg.trace} is {job.trace.header.get('source')}, not recorded; "
                          "record one on a GPU with mode=record")
    return job.cfg.trace


def _recorded_in(directory: Path) -> tuple[list[Path], list]:
    """Every recorded trace in `directory` (*.jsonl, *.jsonl.gz), read and checked."""
    from engine.trace import read_trace

    paths = sorted(p for p in directory.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    traces = [read_trace(p) for p in paths]
    synthesized = [p.name for p, t in zip(paths, traces) if t.header.get("source") != "recorded"]
    if synthesized:
        raise ConfigError(f"trace={directory}: {', '.join(synthesized)} not recorded; calibrate fits only "
                          "traces from mode=record (move the others out)")
    if not traces:
        raise ConfigError(f"trace={directory} holds no trace (*.jsonl, *.jsonl.gz); record some with mode=record")
    return paths, traces


@register_mode("record")
def record_mode(job: Job) -> Outcome:
    from engine.record import record

    path, trace = record(job.cfg, job.spec, job.out_dir)
    h = trace.header
    probes = h["probes"]
    rows = [["trace", str(path)], ["records", f"{len(trace.records):,}"],
            ["step (GPU, resident)", f"{h['step_ns'] / 1e6:.3f} ms"],
            ["kernel compute, sum", f"{sum(r.compute_ns for r in trace.records) / 1e6:.3f} ms"],
            ["saved for backward", f"{sum(s.nbytes for r in trace.records for s in r.saved) / 1e9:.3f} GB"],
            ["weight copies observed", f"{sum(len(r.copies) for r in trace.records):,}"],
            ["device", f"{h['device']} (torch {h['torch']}, CUDA {h['cuda']})"]]
    if "compute_under_copy" in probes:
        c = probes["compute_under_copy"]
        rows.append(["step beside H2D copies", f"{c['with_copy_ns'] / 1e6:.3f} ms"])
    md = f"## Recorded {h['model']} ({job.cfg.workload.name})\n\n" + table(["what", "value"], rows)
    report = {"config": _config_summary(job), "trace": str(path), "records": len(trace.records),
              "step_ns": h["step_ns"], "device": h["device"]}
    return Outcome(report, md + f"\n\nreplay it: python -m engine +model=... trace={path}")


@register_mode("calibrate")
def calibrate_mode(job: Job) -> Outcome:
    from engine.calibrate import FITTED, fit_profile, profile_yaml

    target = Path(job.cfg.out) if job.cfg.out else job.out_dir / "h100_calibrated.yaml"
    if target.suffix != ".yaml":
        raise ConfigError(f"out={job.cfg.out}: the profile is a .yaml file (e.g. conf/hardware/h100_calibrated.yaml)")
    if job.cfg.trace is not None and Path(job.cfg.trace).is_dir():
        paths, traces = _recorded_in(Path(job.cfg.trace))
    else:
        paths, traces = [Path(_recorded(job, "calibrate"))], [job.trace]
    profile = fit_profile(traces, job.cfg.hardware, target.stem, [p.name for p in paths])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(profile_yaml(profile))
    if target.parent != job.out_dir:
        shutil.copy(target, job.out_dir / target.name)
    rows = [[f, str(profile[f]), str(job.cfg.hardware[f])] for f in FITTED]
    md = (f"## Calibrated profile {profile['name']}\n\nfrom {', '.join(p.name for p in paths)}\n\n"
          + table(["field", "fitted", job.cfg.hardware.name], rows)
          + f"\n\nwrote {target}" + ("; use it as hardware=" + target.stem if target.parent.name == "hardware"
                                     else "; copy it to conf/hardware/ to use it as hardware=" + target.stem))
    return Outcome({"config": _config_summary(job), "profile": profile, "written": str(target)}, md)


@register_mode("validate")
def validate_mode(job: Job) -> Outcome:
    from engine import validate as v

    trace_path = _recorded(job, "validate")
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
    return Outcome({"config": _config_summary(job), "validation": rep}, md)
