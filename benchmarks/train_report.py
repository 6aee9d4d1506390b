"""Real modules' LoRA steps measured on a GPU, predicted again on any CPU.

    python benchmarks/train_report.py benchmarks/results/train-h200-2026-11-29/runs/* --hardware h200 \
        --leave-one-out --table-traces data/traces/h200 --table-modules data/traces/h200/modules
    python benchmarks/train_report.py data/traces/modules/*-train*.jsonl.gz --hardware h100_pcie5 --leave-one-out

Each argument is a run: the directory `python -m engine ... workload=train_lora mode=execute`
wrote without trace= (report.json, and trace.jsonl.gz: the recording the run made first,
gzipped, or one of the same step made elsewhere), or a shipped recording of a LoRA step with
its measured rows beside it (NAME.measured.json: each row's budget, policy and measured
steps). Each measured step is a row, and so is the plain module's step every weight resident
(resident_step_ms) where the run measured it, predicted with no budget, each beside the steps
its median is taken over where the run kept them (fastest to slowest: a host-bound step on a
shared host spreads by tens of percent). Each row is predicted three ways: from the run's recording; from the step synthesized on this CPU
(engine/modules/synthesize.py, from the model config the recording names, on its workload)
and priced by --hardware; and with --leave-one-out, synthesized and priced by a kernel table
whose module costs are fitted without any recording of that model
(benchmarks/real_models_report.py held_out_hardware). Prints the rows, each way's mean and
max |error|, how many rows it puts inside their steps' range, and the pool plus torch peak
against the synthesized one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engine.config import load_hardware  # noqa: E402
from engine.errors import ConfigError, TraceError  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from engine.trace import Trace, read_trace  # noqa: E402
from real_models_report import TABLE_MODULES, TABLE_TRACES, held_out_hardware, model_config  # noqa: E402


@dataclass(frozen=True)
class Measured:
    """One measured LoRA step: its budget (None: every weight resident) and policy, its step."""
    run: str
    budget_mb: float | None
    eviction: str
    lookahead: int
    step_ms: float
    peak_pool_torch_bytes: int | None = None
    steps_ms: tuple[float, ...] = ()  # the steps the median is taken over, where the run kept them


def runs_of(path: Path) -> tuple[list[Measured], Trace]:
    """A run's measured steps and its recording (module docstring)."""
    if path.is_dir():
        report, trace = path / "report.json", path / "trace.jsonl.gz"
        if not report.exists() or not trace.exists():
            raise ConfigError(f"{path}: no report.json and trace.jsonl.gz; pass the hydra.run.dir of one "
                              "workload=train_lora mode=execute run, its trace.jsonl gzipped")
        data = json.loads(report.read_text())
        if data["config"].get("workload") != "train_lora" or "measurement" not in data:
            raise ConfigError(f"{report} is not a measured LoRA step (workload=train_lora mode=execute)")
        measurement = dict(data["measurement"])
        telemetry = path / "telemetry.jsonl"
        if "steps_ms" not in measurement and telemetry.exists():  # runs before the report kept them
            measurement["steps_ms"] = [json.loads(line)["weight_step_ms"] for line in telemetry.open()]
        rows = [(data["config"], measurement)]
    else:
        if not path.name.endswith(".jsonl.gz"):
            raise ConfigError(f"{path}: neither a run directory nor a recording (*.jsonl.gz); pass the "
                              "hydra.run.dir of a workload=train_lora mode=execute run, or a recording with its "
                              "measured rows")
        side = path.with_name(path.name.replace(".jsonl.gz", ".measured.json"))
        if not side.exists():
            raise ConfigError(f"{path}: no {side.name} beside it; pass a run directory or a recording with its "
                              "measured rows")
        rows = [(r, r["measured"]) for r in json.loads(side.read_text())["rows"]]
        trace = path
    out = []
    name = path.name.split(".")[0]
    for c, m in rows:
        steps = m.get("steps_ms") or []
        out.append(Measured(name, c["budget_mb"], c["eviction"], c["lookahead"], m["step_ms"],
                            m.get("peak_pool_torch_bytes"), tuple(steps[1:] or steps)))
        if m.get("resident_step_ms"):
            resident = [t for run in m.get("resident_steps_ms") or [] for t in run[1:] or run]
            out.append(Measured(name, None, c["eviction"], c["lookahead"], m["resident_step_ms"],
                                steps_ms=tuple(resident)))
    return out, read_trace(trace)


def synthesized(recording: Trace, hw: DictConfig) -> Trace:
    """The step synthesized from the model config the recording names, on its workload."""
    cfg = model_config(recording.header["model"], recording.header.get("model_set"))
    return synthesize_module(cfg, OmegaConf.create(recording.header["workload"]), hw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="also synthesized with module costs fitted without the model's recordings")
    ap.add_argument("--table-traces", type=Path, default=TABLE_TRACES)
    ap.add_argument("--table-modules", type=Path, default=TABLE_MODULES)
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    tmp = Path(tempfile.mkdtemp(prefix="train-report-"))
    ways = ["recording", "synthesized"] + (["held out"] if args.leave_one_out else [])
    errors: dict[str, list[float]] = {w: [] for w in ways}
    inside: dict[str, list[bool]] = {w: [] for w in ways}  # rows with steps: within their fastest and slowest
    peaks = []
    print(f"hardware={args.hardware}{' --leave-one-out' if args.leave_one_out else ''}\n")
    print("| run | model | budget MB | measured ms | its steps ms | " + " | ".join(f"{w} ms" for w in ways) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ways))
    for path in args.runs:
        rows, recording = runs_of(path)
        model = recording.header["model"]
        traces = {"recording": recording, "synthesized": synthesized(recording, hw)}
        if args.leave_one_out:
            traces["held out"] = synthesized(recording, held_out_hardware(hw, model, tmp, args.table_traces,
                                                                          args.table_modules))
        for row in rows:
            cells = []
            for w in ways:
                p = predict(traces[w], hw, round(row.budget_mb * 1e6) if row.budget_mb else None, row.lookahead,
                            row.eviction)
                errors[w].append(p["step_ms"] / row.step_ms - 1)
                if row.steps_ms:
                    inside[w].append(min(row.steps_ms) <= p["step_ms"] <= max(row.steps_ms))
                cells.append(f"{p['step_ms']:.1f} ({errors[w][-1]:+.1%}, {p['bound_by']})")
                if w == "synthesized" and row.peak_pool_torch_bytes:
                    peaks.append((row.run, p["peak_pool_torch_bytes"] / row.peak_pool_torch_bytes - 1))
            steps = f"{min(row.steps_ms):.1f}-{max(row.steps_ms):.1f}" if row.steps_ms else "-"
            print(f"| {row.run} | {model} | {row.budget_mb or 'all resident'} | {row.step_ms:.1f} | {steps} | "
                  + " | ".join(cells) + " |")
    print()
    for w in ways:
        e = errors[w]
        print(f"{w}: {len(e)} rows, mean |error| {statistics.mean(map(abs, e)):.1%}, max {max(map(abs, e)):.1%}, "
              f"mean signed {statistics.mean(e):+.1%}"
              + (f"; inside the measured steps' range in {sum(inside[w])} of {len(inside[w])} rows that kept them"
                 if inside[w] else ""))
    if peaks:
        print("pool + torch peak, synthesized: " + ", ".join(f"{n} {e:+.1%}" for n, e in peaks))


if __name__ == "__main__":
    try:
        main()
    except (TraceError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
