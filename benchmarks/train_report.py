"""Real modules' LoRA steps measured by `mode=execute`, predicted again on any CPU.

    python benchmarks/train_report.py benchmarks/results/train-h200-2026-11-29/runs/* --hardware h200 \
        --leave-one-out --table-traces data/traces/h200 --table-modules data/traces/h200/modules

Each DIR holds what `python -m engine ... workload=train_lora mode=execute` wrote without
trace= (report.json, and trace.jsonl.gz: the recording the run made first, gzipped) or, for
a run that kept no recording, a recording of the same step made elsewhere as trace.jsonl.gz.
Each run gives two rows: its streamed step at its budget and, where it ran the plain module
every weight resident (the report's resident_step_ms), that step predicted with no budget.
Each row is predicted three ways: from the run's recording; from the step synthesized on
this CPU (engine/modules/synthesize.py, the model config the report names, the workload the
recording carries), priced by --hardware; and with --leave-one-out, synthesized and priced
by a kernel table whose module costs are fitted without any recording of that model
(benchmarks/real_models_report.py held_out_hardware). Prints the rows, the mean and max
|error| of each way, and the pool plus torch peak against the synthesized one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omegaconf import OmegaConf  # noqa: E402

from engine.config import load_hardware  # noqa: E402
from engine.errors import ConfigError, TraceError  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from engine.trace import Trace, read_trace  # noqa: E402
from real_models_report import TABLE_MODULES, TABLE_TRACES, held_out_hardware  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_of(d: Path) -> tuple[dict, Trace]:
    """A run directory's execute report and recording (module docstring)."""
    report, trace = d / "report.json", d / "trace.jsonl.gz"
    if not report.exists() or not trace.exists():
        raise ConfigError(f"{d}: no report.json and trace.jsonl.gz; pass the hydra.run.dir of one "
                          "workload=train_lora mode=execute run, its trace.jsonl gzipped")
    data = json.loads(report.read_text())
    if data["config"].get("workload") != "train_lora" or "measurement" not in data:
        raise ConfigError(f"{d}/report.json is not a measured LoRA step (workload=train_lora mode=execute)")
    return data, read_trace(trace)


def synthesized(report: dict, recording: Trace, hw) -> Trace:
    """The step synthesized from the model config the run named, on the recording's workload."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{report['config']['model_option']}.yaml")
    return synthesize_module(cfg, OmegaConf.create(recording.header["workload"]), hw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
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
    peaks = []
    print(f"hardware={args.hardware}{' --leave-one-out' if args.leave_one_out else ''}\n")
    print("| run | model | budget MB | measured ms | " + " | ".join(f"{w} ms" for w in ways) + " |")
    print("|---|---|---|---|" + "---|" * len(ways))
    for d in args.dirs:
        report, recording = run_of(d)
        c, m = report["config"], report["measurement"]
        model = recording.header["model"]
        traces = {"recording": recording, "synthesized": synthesized(report, recording, hw)}
        if args.leave_one_out:
            held = held_out_hardware(hw, model, tmp, args.table_traces, args.table_modules)
            traces["held out"] = synthesized(report, recording, held)
        rows = [(c["budget_mb"], m["step_ms"])] + ([(None, m["resident_step_ms"])] if m.get("resident_step_ms") else [])
        for budget, measured in rows:
            cells = []
            for w in ways:
                p = predict(traces[w], hw, round(budget * 1e6) if budget else None, c["lookahead"], c["eviction"])
                errors[w].append(p["step_ms"] / measured - 1)
                cells.append(f"{p['step_ms']:.1f} ({errors[w][-1]:+.1%}, {p['bound_by']})")
                if w == "synthesized" and budget and m.get("peak_pool_torch_bytes"):
                    peaks.append((d.name, p["peak_pool_torch_bytes"] / m["peak_pool_torch_bytes"] - 1))
            print(f"| {d.name} | {model} | {budget or 'all resident'} | {measured:.1f} | " + " | ".join(cells) + " |")
    print()
    for w in ways:
        e = errors[w]
        print(f"{w}: {len(e)} rows, mean |error| {statistics.mean(map(abs, e)):.1%}, max {max(map(abs, e)):.1%}, "
              f"mean signed {statistics.mean(e):+.1%}")
    if peaks:
        print("pool + torch peak, synthesized: " + ", ".join(f"{n} {e:+.1%}" for n, e in peaks))


if __name__ == "__main__":
    try:
        main()
    except (TraceError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
