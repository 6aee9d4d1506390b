"""Real modules measured on the GPU, predicted again from their own recordings; runs on any CPU.

    python benchmarks/real_models_report.py benchmarks/results/real-2026-11-26/run*
    python benchmarks/real_models_report.py DIR... --hardware h100_pcie5
    python benchmarks/real_models_report.py DIR... --set host_syncs=[0] --set block_records=true
    python benchmarks/real_models_report.py data/traces/modules --synthesized [--leave-one-out]
    python benchmarks/real_models_report.py data/traces/h200/modules --hardware h200 --synthesized \
        --leave-one-out --table-traces data/traces/h200 --table-modules data/traces/h200/modules

Each DIR holds what `benchmarks/real_models.py --out DIR` wrote: real_models.json (the
measured rows) and each model's recording (KEY.trace.jsonl.gz). Every measured row is
predicted as real_models.py predicts it (engine.modules.offload.predict, the row's budget,
eviction, lookahead and backend) from the recording, its header edited by each --set
KEY=JSON (to replay an older recording under a newer simulator, or the other way round).
Prints measured against predicted (the mean of the measured steps, beside their fastest and
slowest where the run kept them, and how many rows the prediction lands inside that range; a run
that measured them
in a synced loop, row key predicted_synced_ms, is predicted with loop="synced"), the mean, max and mean
signed error, and at each run's budget whether the configuration the simulator ranks first
is the one measured fastest; for rows that measured it, the process peak (pool, torch and the
CUDA context; less what the harness itself held there, `harness_bytes`) against the predicted one. Rows without that key (older runs) timed
each step after a device-wide synchronize, which also waits for the copy stream, a loop the
simulator does not model; they are predicted free-running, as they were compared then.

--synthesized predicts each row from a trace synthesized on this CPU instead
(engine/modules/synthesize.py: the model config whose name the recording carries, with the
fields real_models.py --model-set changed, built on the meta device, on the recording's workload), as `python -m engine model=NAME` predicts a module
nobody recorded; --leave-one-out prices it with a kernel table whose module costs are fitted
without that model's recording (the spec recordings and probes of --table-traces, the
other module recordings of --table-modules; by default the H100's as shipped: TABLE_* below).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engine.calibrate_kernels import fit_kernel_table, read_probe_file  # noqa: E402
from engine.config import load_hardware  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.errors import ConfigError, TraceError  # noqa: E402
from engine.trace import Trace, check_trace, read_trace  # noqa: E402
from real_models import legacy_harness_bytes  # noqa: E402


def edited(trace: Trace, sets: list[str]) -> Trace:
    """`trace` with each KEY=JSON of `sets` in its header, checked as a trace file is."""
    header = dict(trace.header)
    for s in sets:
        key, _, value = s.partition("=")
        try:
            header[key] = json.loads(value)
        except json.JSONDecodeError:
            raise TraceError(f"--set {s}: the value is not JSON; write e.g. --set host_syncs=[0]") from None
    out = Trace(header, trace.weight_sizes, trace.records)
    check_trace(out)
    return out


def measured(d: Path) -> dict:
    """The run's measured rows: real_models.json, or gzipped (a kept run with timelines)."""
    for path, opener in ((d / "real_models.json", open), (d / "real_models.json.gz", gzip.open)):
        if path.is_file():
            with opener(path, "rt") as f:
                return json.load(f)
    raise ConfigError(f"{d}: no real_models.json(.gz) here; give directories benchmarks/real_models.py --out wrote")


def grouping(trace: Trace, path: Path) -> str:
    """How `trace` grouped its kernels: its header's, else (an older recording) real_models.py's
    file name, KEY-leaf.trace.jsonl.gz for leaf."""
    return trace.header.get("grouping") or ("leaf" if path.name.endswith("-leaf.trace.jsonl.gz") else "block")


def shape(workload: dict | None) -> str:
    """A workload as a key: the recording of a run's rows is the one of its model, grouping and
    workload (a directory may hold one model recorded at several token counts)."""
    return json.dumps(workload or {}, sort_keys=True)


ROOT = Path(__file__).resolve().parents[1]
TABLE_TRACES = ROOT / "data" / "traces" / "full"  # what the shipped kernel table is fitted from
TABLE_MODULES = ROOT / "data" / "traces" / "modules"


def harness_bytes(result: dict) -> tuple[int, int]:
    """What the run's harness held on the device beside the module, (in its recording's torch
    peak, in its rows'): its "harness_device_bytes", or for an older run
    real_models.legacy_harness_bytes."""
    if "harness_device_bytes" in result:
        return result["harness_device_bytes"], result["harness_device_bytes"]
    cfg = model_config(result["model"], result.get("model_set"))
    return legacy_harness_bytes(cfg, result["workload"], result.get("resident_outcomes", 1))


def without_harness(trace: Trace, held: int) -> Trace:
    """A recording made beside `held` bytes of its harness, its torch peak without them (none
    where benchmarks/restamp_harness.py took them out already)."""
    h = trace.header
    if not held or "activation_peak_bytes" not in h or "harness_device_bytes" in h:
        return trace
    return Trace({**h, "activation_peak_bytes": max(0, h["activation_peak_bytes"] - held),
                  "harness_device_bytes": held}, trace.weight_sizes, trace.records)


def model_config(name: str, model_set: Sequence[str] | None = None) -> DictConfig:
    """The shipped model config (conf/model/*.yaml) named `name`, with a run's overrides
    (real_models.py --model-set, as its results and recordings keep them)."""
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        if cfg.get("name") == name and "module" in cfg:
            return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(model_set or [])))
    raise ConfigError(f"no model config in conf/model names the real module {name!r}")


def held_out_hardware(hw: DictConfig, model: str, tmp: Path, table_traces: Path = TABLE_TRACES,
                      table_modules: Path = TABLE_MODULES) -> DictConfig:
    """`hw` with a kernel table fitted from `table_traces` (spec recordings and probes) and
    `table_modules` (module recordings), less `model`'s module recording."""
    traces = [read_trace(p) for p in sorted(table_traces.glob("*.jsonl.gz"))]
    probes = [read_probe_file(p) for p in sorted(table_traces.glob("probes-*.json"))]
    modules = [t for t in (read_trace(p) for p in sorted(table_modules.glob("*.jsonl.gz")))
               if t.header.get("model") != model]
    path = tmp / f"without-{model}.kernels.json"
    path.write_text(json.dumps(fit_kernel_table(traces, f"held out: {model}", probes, modules).to_json()))
    out = OmegaConf.create(OmegaConf.to_container(hw))
    out.kernel_table = str(path)
    return out


def synthesized(trace: Trace, hw: DictConfig, held_out: Callable[[str], DictConfig] | None) -> Trace:
    """The trace synthesized for the model and workload `trace` recorded (module docstring),
    priced by `hw` or, given `held_out`, by the profile it makes without the model's recording."""
    from engine.modules.synthesize import synthesize_module

    model = trace.header["model"]
    cfg = model_config(model, trace.header.get("model_set"))
    cfg.grouping = trace.header.get("grouping", "block")
    return synthesize_module(cfg, OmegaConf.create(trace.header["workload"]),
                             held_out(model) if held_out else hw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--hardware", default="h100_calibrated", help="as real_models.py's --hardware")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="edit each recording's header")
    ap.add_argument("--synthesized", action="store_true", help="predict from traces synthesized on this CPU")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="with --synthesized: module costs fitted without the model's own recording")
    ap.add_argument("--table-traces", type=Path, default=TABLE_TRACES,
                    help="with --leave-one-out: the spec recordings and probes the kernel table is fitted from")
    ap.add_argument("--table-modules", type=Path, default=TABLE_MODULES,
                    help="with --leave-one-out: the module recordings the module costs are fitted from")
    args = ap.parse_args()
    if args.leave_one_out and not args.synthesized:
        raise ConfigError("--leave-one-out changes what --synthesized prices with; pass both")
    runs = [(d, measured(d)) for d in args.dirs]
    hw = load_hardware(args.hardware)
    tmp = Path(tempfile.mkdtemp(prefix="real-models-report-"))
    held_out = (lambda model: held_out_hardware(hw, model, tmp, args.table_traces, args.table_modules)) \
        if args.leave_one_out else None
    print(f"hardware={args.hardware}{''.join(f' --set {s}' for s in args.set)}"
          f"{' --synthesized' if args.synthesized else ''}{' --leave-one-out' if args.leave_one_out else ''}\n")
    print("| run | model | budget MB | backend | grouping/eviction/lookahead | measured ms (mean) | its steps ms | "
          "predicted ms | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors, hosts, picks, peaks, host_bound = [], [], [], [], []  # host_bound: (row, error) where the host sets it
    inside: list[bool] = []  # rows that kept their steps: the prediction within their fastest and slowest
    notes: list[str] = []  # printed after the tables, so a bad input stays one line
    for d, data in runs:
        traces = {(t.header["model"], grouping(t, path), shape(t.header.get("workload"))): t
                  for path, t in ((p, read_trace(p)) for p in sorted(d.glob("*.trace.jsonl.gz")))}
        if args.synthesized:
            traces = {key: synthesized(t, hw, held_out) for key, t in traces.items()}
        for result in data["results"]:
            at: dict[float, list[tuple[float, float, str]]] = {}
            measured_peak = any(r.get("process_peak_bytes") for r in result["rows"])
            try:
                held, held_in_rows = harness_bytes(result) if measured_peak else (0, 0)
            except ConfigError as err:  # an older run's reference outputs are sized on the meta device
                notes.append(f"note: {d.name} {result['model']}: its process peaks are left out (the harness it "
                             f"held is sized from the model's meta forward: {err})")
                measured_peak, held, held_in_rows = False, 0, 0
            for r in result["rows"]:
                key = (result["model"], r.get("grouping", "block"), shape(result.get("workload")))
                if key not in traces:
                    raise ConfigError(f"{d} has no {key[1]} recording of {result['model']} on its workload "
                                      "(KEY.trace.jsonl.gz, KEY-leaf.trace.jsonl.gz); pass the --out directory of one "
                                      "real_models.py run")
                trace = edited(traces[key] if args.synthesized else without_harness(traces[key], held), args.set)
                budget = round(r["budget_mb"] * 1e6) if r["budget_mb"] else None  # 0: all resident
                loop = "synced" if "predicted_synced_ms" in r else "free"
                prediction = predict(trace, hw, budget, r["lookahead"], r["eviction"], backend=r["backend"],
                                     loop=loop)
                p = prediction["step_ms"]
                err = p / r["mean_ms"] - 1
                errors.append(err)
                hosts.append(prediction["bound_by"] == "host")
                if hosts[-1]:
                    host_bound.append((f"{d.name} {result['model']} at {r['budget_mb']:.0f} MB", err))
                if measured_peak and r.get("process_peak_bytes"):
                    peak = r["process_peak_bytes"] - held_in_rows
                    peaks.append((f"| {d.name} | {result['model']} | {r['budget_mb']:.0f} | {peak / 1e9:.2f} | "
                                  f"{prediction['peak_process_bytes'] / 1e9:.2f} |",
                                  prediction["peak_process_bytes"] / peak - 1))
                config = f"{r['backend']} {key[1]}/{r['eviction']}/{r['lookahead']}"
                at.setdefault(r["budget_mb"], []).append((r["mean_ms"], p, config))
                steps = r.get("times") or []
                if steps:
                    inside.append(min(steps) <= p <= max(steps))
                span = f"{min(steps):.1f}-{max(steps):.1f}" if steps else "-"
                print(f"| {d.name} | {result['model']} | {r['budget_mb']:.0f} | {r['backend']} | "
                      f"{key[1]}/{r['eviction']}/{r['lookahead']} | {r['mean_ms']:.1f} | {span} | {p:.1f} | {err:+.1%} |")
            for budget, rows in at.items():
                if len(rows) > 1 and budget:  # all resident (0), every configuration runs the same
                    best = min(rows)[0]
                    pick = min(rows, key=lambda x: x[1])
                    picks.append(pick[0] / best - 1)
    print(f"\n{len(errors)} rows: mean |error| {statistics.mean(map(abs, errors)):.2%}, max "
          f"{max(map(abs, errors)):.2%}, mean signed {statistics.mean(errors):+.2%}", end="")
    if picks:
        print(f"; at {len(picks)} budgets with several configurations the simulator's pick measured "
              f"{', '.join(f'{p:+.1%}' for p in picks)} over the best")
    else:
        print()
    if inside:
        print(f"inside the measured steps' range in {sum(inside)} of {len(inside)} rows that kept them")
    rest = [e for e, host in zip(errors, hosts) if not host]
    if host_bound and rest:
        print(f"the {len(rest)} rows the GPU or the link bounds (as predicted): mean |error| "
              f"{statistics.mean(map(abs, rest)):.2%}, max {max(map(abs, rest)):.2%}; the host bounds "
              + ", ".join(f"{name} ({err:+.1%})" for name, err in host_bound))
    if peaks:
        print("\n| run | model | budget MB | measured process peak GB | predicted GB | error |\n|---|---|---|---|---|---|")
        print("\n".join(f"{row} {err:+.1%} |" for row, err in peaks))
        errs = [err for _, err in peaks]
        print(f"process peak, {len(errs)} rows: mean |error| {statistics.mean(map(abs, errs)):.2%}, "
              f"max {max(map(abs, errs)):.2%}")
    for note in notes:
        print(note, file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (TraceError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
