"""The simulator against whole spec models measured on the GPU; runs on any CPU.

    python benchmarks/full_models_report.py                          # the default profile
    python benchmarks/full_models_report.py hardware=h100_calibrated  # any engine override
    python benchmarks/full_models_report.py --recorded               # replay each model's recording
    python benchmarks/full_models_report.py --leave-one-out          # each model from the others' table
    python benchmarks/full_models_report.py --measured data/traces/full/measured-2026-11-27.json

Reads the GPU side (--measured, default data/traces/full/measured.json; written from
benchmarks/full_models.py), predicts every measured configuration with the CLI a user runs
(one `-m` sweep per model and lookahead, each row at the lookahead it ran with; synthesized
traces unless --recorded), and prints measured against predicted: the error of
each, mean and max |error|, and whether the eviction the simulator ranks first at each budget
is the one measured fastest (where not, how far its measured step is from the fastest). Rows
whose pool relocated in a warm step (`warm_relocations`, in sets measured since 2026-11-28) are
marked, and the summary is repeated without them: the simulator does not model relocations.

--leave-one-out predicts each model with a kernel table fitted (engine.calibrate) from the
recordings of the other models only (TABLE_TRACES less its own) and the compute probe
files beside them (PROBES: they time bare ops and belong to no model, so they stay in), as
a model nobody recorded would be predicted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "data" / "traces" / "full" / "measured.json"
MEASURED_STEPS = 5  # full_models.py's workload.steps in the runs measured.json holds
RECORDINGS = {"ltx": "ltx2-full", "flux": "flux-full", "llama8b": "llama8b-decode-full", "wan14b": "wan14b-full"}
# The recordings conf/hardware/h100_calibrated.kernels.json is fitted from, by the model each records.
TABLE_TRACES = {**RECORDINGS, "ltx-train": "ltx2-train-8blocks"}
# The compute probe files (python -m engine.measure.compute --out) the table is fitted with too.
PROBES = sorted((ROOT / "data" / "traces" / "full").glob("probes-*.json"))


def held_out_table(model: str, tmp: Path) -> str:
    """A kernel table fitted from every TABLE_TRACES recording but `model`'s, and PROBES: its path."""
    from engine.calibrate_kernels import fit_kernel_table, read_probe_file
    from engine.trace import read_trace

    traces = [read_trace(ROOT / "data" / "traces" / "full" / f"{name}.jsonl.gz")
              for key, name in TABLE_TRACES.items() if key.split("-")[0] != model]
    path = tmp / f"without-{model}.kernels.json"
    path.write_text(json.dumps(fit_kernel_table(traces, f"held out: {model}",
                                                [read_probe_file(p) for p in PROBES]).to_json()))
    return str(path)


def budget_arg(b: int | None) -> str:
    return "null" if b is None else str(b)


def predictions(model: str, workload: str, rows: list[dict], overrides: list[str], recorded: bool,
                tmp: Path) -> dict:
    """{(budget, eviction, lookahead): predicted ms} for `rows`, one sweep per lookahead."""
    trace = [f"trace={ROOT / 'data' / 'traces' / 'full' / RECORDINGS[model]}.jsonl.gz"] if recorded else []
    out = {}
    for la in sorted({r["lookahead"] for r in rows}):
        at = [r for r in rows if r["lookahead"] == la]
        budgets = sorted({budget_arg(r["budget_mb"]) for r in at})
        # every eviction of the model: a group of all-resident rows alone still names one
        evictions = sorted({r["eviction"] for r in rows if r["eviction"] != "resident"})
        sweep = tmp / f"{model}-{la}"
        subprocess.run([sys.executable, "-m", "engine", "-m", f"model={model}", f"workload={workload}",
                        f"budget={','.join(budgets)}", f"weights.eviction={','.join(evictions)}",
                        f"weights.lookahead={la}", "sim.timeline=false", f"workload.steps={MEASURED_STEPS}",
                        *trace, *overrides, f"hydra.sweep.dir={sweep}"], check=True, cwd=ROOT, capture_output=True)
        for path in sweep.glob("*/report.json"):
            r = json.loads(path.read_text())
            b = r["config"]["budget_mb"]
            key = (None, "resident") if b is None else (int(b), r["config"]["eviction"])
            out[(*key, la)] = r["prediction"]["mean_step_ms"]  # the warm steps, as execute's median of them
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorded", action="store_true", help="replay each model's recording (trace=)")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="predict each model from a kernel table fitted without its recordings")
    ap.add_argument("--measured", type=Path, default=MEASURED, help="the GPU's measurements (full_models.py's rows)")
    ap.add_argument("overrides", nargs="*", help="engine overrides, e.g. hardware=h100_calibrated")
    args = ap.parse_args()
    data = json.loads(args.measured.read_text())
    by_model: dict[str, list[dict]] = {}
    for r in data["rows"]:
        by_model.setdefault(r["model"], []).append(r)
    print(f"measured: {data['device']}, {data['date']}; predicted: "
          f"{'each model recorded' if args.recorded else 'synthesized'} {' '.join(args.overrides) or 'defaults'}"
          f"{', each model held out of the kernel table' if args.leave_one_out else ''}\n")
    print("| model | budget MB | eviction | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|")
    errors, relocated, ranked, budgets, misses = [], [], 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for model, rows in by_model.items():
            held = [f"hardware.kernel_table={held_out_table(model, Path(tmp))}"] if args.leave_one_out else []
            pred = predictions(model, rows[0]["workload"], rows, [*args.overrides, *held], args.recorded, Path(tmp))
            seen = set()
            for r in rows:
                key = (r["budget_mb"], r["eviction"])
                if key in seen:  # the resident step, run once per eviction of the sweep
                    continue
                seen.add(key)
                p = pred[(*key, r["lookahead"])]
                err = (p / r["step_ms"] - 1) * 100
                errors.append(abs(err))
                relocated.append(bool(r.get("warm_relocations")))  # rows of older sets carry no per-step count
                mark = " (the pool relocated in a warm step)" if relocated[-1] else ""
                print(f"| {model} | {r['budget_mb'] or 'all resident'} | {r['eviction']} | {r['step_ms']:.1f} | "
                      f"{p:.1f} | {err:+.1f}%{mark} |")
            for b in sorted({r["budget_mb"] for r in rows if r["budget_mb"] is not None}):
                at = [r for r in rows if r["budget_mb"] == b]
                fastest = min(at, key=lambda r: r["step_ms"])
                pick = min(at, key=lambda r: pred[(b, r["eviction"], r["lookahead"])])
                ranked += fastest["eviction"] == pick["eviction"]
                budgets += 1
                if fastest["eviction"] != pick["eviction"]:
                    misses.append(f"{model} at {b}: the simulator ranks {pick['eviction']} first, which measured "
                                  f"{pick['step_ms']:.1f} ms, {100 * (pick['step_ms'] / fastest['step_ms'] - 1):+.1f}% "
                                  f"over {fastest['eviction']}'s {fastest['step_ms']:.1f}")
    print(f"\n{len(errors)} configurations: mean |error| {statistics.mean(errors):.1f}%, max {max(errors):.1f}%; "
          f"the simulator's fastest eviction is the measured fastest at {ranked} of {budgets} budgets")
    if any(relocated):  # the simulator does not model the pool's relocations: the rest, apart
        rest = [e for e, moved in zip(errors, relocated) if not moved]
        others = (f"; the other {len(rest)}: mean |error| {statistics.mean(rest):.1f}%, max {max(rest):.1f}%"
                  if rest else "")
        print(f"{sum(relocated)} of them relocated in a warm step (a stall the simulator does not model){others}")
    for line in misses:
        print(f"- {line}")


if __name__ == "__main__":
    main()
