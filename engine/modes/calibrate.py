"""mode=calibrate: trace=PATH (recorded) or trace=DIR (every recorded trace in it,
fitted together: spec models' for the profile, real modules' for their blocks' costs in
the kernel table) -> a hardware profile yaml (engine/calibrate.py);
out=conf/hardware/NAME.yaml writes it where hardware=NAME finds it."""
from __future__ import annotations

import shutil
from pathlib import Path

from engine.errors import ConfigError, TraceError
from engine.files import write_text_new
from engine.job import Job, Outcome, config_summary
from engine.report import table
from engine.trace import Trace, read_trace


def recorded_trace(job: Job, mode: str) -> str:
    """The job's trace=PATH, which must be a trace recorded with mode=record."""
    if job.cfg.trace is None:
        raise ConfigError(f"mode={mode} needs trace=PATH, a trace recorded with mode=record")
    if job.trace.header.get("source") != "recorded":
        raise ConfigError(f"mode={mode}: trace={job.cfg.trace} is {job.trace.header.get('source')}, not recorded; "
                          "record one on a GPU with mode=record")
    return job.cfg.trace


def _recorded_in(directory: Path) -> tuple[list[Path], list[Trace]]:
    """Every recorded trace in `directory` (*.jsonl, *.jsonl.gz), read and checked."""
    paths = sorted(p for p in directory.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    traces = [read_trace(p) for p in paths]
    synthesized = [p.name for p, t in zip(paths, traces) if t.header.get("source") != "recorded"]
    if synthesized:
        raise ConfigError(f"trace={directory}: {', '.join(synthesized)} not recorded; calibrate fits only "
                          "traces from mode=record (move the others out)")
    if not traces:
        raise ConfigError(f"trace={directory} holds no trace (*.jsonl, *.jsonl.gz); record some with mode=record")
    return paths, traces


def _split_recordings(paths: list[Path], traces: list[Trace]) -> tuple[list[Path], list[Trace], list[Path],
                                                                       list[Trace]]:
    """A directory's recordings as spec models' (the profile's fit) and real modules' (header
    "block_records": their op census prices a module's blocks in the kernel table), each as
    paths and traces, all of one GPU; refused without a spec model's."""
    from engine.calibrate import distinct_names, one_device

    try:
        one_device(zip(distinct_names(paths), (t.header.get("device") for t in traces)))
    except TraceError as err:
        raise ConfigError(str(err)) from None
    spec = [(p, t) for p, t in zip(paths, traces) if not t.header.get("block_records")]
    modules = [(p, t) for p, t in zip(paths, traces) if t.header.get("block_records")]
    if not spec:
        raise ConfigError(f"trace={paths[0].parent} holds only real modules' recordings; the profile's link, host "
                          "and kernel rates are fitted from a spec model's recording on the same GPU: record one "
                          "there (python -m engine +model=ltx mode=record budget=16000) and put it beside them")
    return [p for p, _ in spec], [t for _, t in spec], [p for p, _ in modules], [t for _, t in modules]


def calibrate_mode(job: Job) -> Outcome:
    from engine.calibrate import FITTED, add_module_costs_source, fit_profile, profile_yaml
    from engine.calibrate_kernels import write_kernel_table

    target = Path(job.cfg.out) if job.cfg.out else job.out_dir / "h100_calibrated.yaml"
    if target.suffix != ".yaml":
        raise ConfigError(f"out={job.cfg.out}: the profile is a .yaml file (e.g. conf/hardware/h100_calibrated.yaml)")
    module_paths: list[Path] = []
    modules: list[Trace] = []
    if job.cfg.trace is not None and Path(job.cfg.trace).is_dir():
        paths, traces, module_paths, modules = _split_recordings(*_recorded_in(Path(job.cfg.trace)))
    else:
        paths, traces = [Path(recorded_trace(job, "calibrate"))], [job.trace]
    profile = fit_profile(traces, job.cfg.hardware, target.stem, [p.name for p in paths])
    add_module_costs_source(profile, [p.name for p in module_paths])
    if target.exists():
        raise ConfigError(f"out={target} already exists; calibrate never overwrites a profile: remove it "
                          "or pick another name")
    try:
        kernels = write_kernel_table(profile, traces, target, modules=modules)
        write_text_new(target, profile_yaml(profile))
    except FileExistsError:
        raise ConfigError(f"out={target} already exists; calibrate never overwrites a profile: remove it "
                          "or pick another name") from None
    except OSError as e:
        raise ConfigError(f"cannot write out={target}: {e.strerror or e}; pick a writable path") from None
    if target.parent != job.out_dir:
        shutil.copy(target, job.out_dir / target.name)
        if kernels is not None:
            shutil.copy(kernels, job.out_dir / kernels.name)
    rows = [[f, str(profile[f]), str(job.cfg.hardware[f])] for f in FITTED]
    md = (f"## Calibrated profile {profile['name']}\n\nfrom {', '.join(p.name for p in paths)}"
          + (f"; a real module's blocks priced by the op census of {', '.join(p.name for p in module_paths)}"
             if module_paths else "")
          + "\n\n"
          + table(["field", "fitted", job.cfg.hardware.name], rows)
          + f"\n\nwrote {target}" + ("; use it as hardware=" + target.stem if target.parent.name == "hardware"
                                     else "; copy it to conf/hardware/ to use it as hardware=" + target.stem))
    return Outcome({"config": config_summary(job), "profile": profile, "written": str(target)}, md)
