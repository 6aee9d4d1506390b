"""Whole spec models on the GPU: recorded, then executed over budgets and evictions.

    python benchmarks/full_models.py --models ltx,llama8b        # on a CUDA machine
    python benchmarks/full_models.py --models flux --budgets flux=8000,16000,null

For each model, through the CLI a user runs (so the numbers are the CLI's):
1. `mode=materialize` writes its random bf16 weights into --dir (default /dev/shm);
2. `mode=record` records one resident step kernel by kernel, with the header's probes
   (copies, host, compute grid): the trace `mode=calibrate` fits and `trace=` replays;
3. `-m mode=execute` runs each budget x eviction (null: every weight resident),
   workload.steps steps each, outputs compared bitwise with the resident run;
4. the weight file is deleted.
Writes OUT/full_models.json (every execute report, the traces' paths), OUT/measured.json (one
row per configuration, the format `benchmarks/full_models_report.py --measured` reads: the
predictions of any profile, table or trace are recomputed from it on any CPU) and prints a
table of measured step against the prediction the execute run printed beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_BUDGETS = {
    "ltx": "8000,12000,16000,24000,null",
    "flux": "8000,12000,16000,null",
    "wan14b": "8000,16000,24000,null",
    "llama8b": "4000,8000,12000,null",
}
WORKLOADS = {"llama8b": "decode"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def engine(*args: str) -> None:
    cmd = [sys.executable, "-m", "engine", *args]
    log(" ".join(cmd[1:]))
    subprocess.run(cmd, check=True)


def reports(sweep_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(sweep_dir.glob("*/report.json"), key=lambda p: int(p.parent.name)):
        rows.append(json.loads(path.read_text()))
    for path in sorted(sweep_dir.glob("*/error.json")):
        rows.append({"error": json.loads(path.read_text()), "dir": str(path.parent)})
    return rows


def measured_rows(result: dict, device: str, command: str) -> dict:
    """full_models.json's execute reports as full_models_report.py's measured rows."""
    rows = []
    for model, entry in result.items():
        for r in entry.get("runs", []):
            if "error" in r:
                continue
            cfg, meas = r["config"], r["measurement"]
            resident = cfg["budget_mb"] is None
            rows.append({"model": model, "workload": entry["workload"], "budget_mb": cfg["budget_mb"],
                         "eviction": "resident" if resident else meas["eviction"], "lookahead": meas["lookahead"],
                         "step_ms": round(meas["step_ms"], 2), "first_step_ms": round(meas["first_step_ms"], 1),
                         "h2d_bytes": meas["h2d_bytes"], "weight_copies": meas["weight_copies"],
                         "relocations": meas["relocations"], "warm_relocations": meas["warm_relocations"],
                         "peak_pool_bytes": meas["peak_device_bytes"],
                         "bitwise": meas.get("outputs_bitwise", meas["outputs_match_reference"]),
                         "matches_reference": meas["outputs_match_reference"],
                         "predicted_ms": round(r["prediction"]["step_ms"], 2)})
    return {"format": "offload-engine-full-model-measurements", "device": device,
            "date": time.strftime("%Y-%m-%d"), "command": command,
            "note": "weights=auto: each row's lookahead is the one execute chose; predicted_ms is execute's own "
                    "prediction (the profile and kernel table it ran with)", "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ltx,llama8b")
    ap.add_argument("--budgets", action="append", default=[], help="MODEL=B1,B2,... (MB; null: all resident)")
    ap.add_argument("--evictions", default="priority,belady")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--override", action="append", default=[], help="an engine override for every run")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    budgets = dict(DEFAULT_BUDGETS)
    budgets.update(dict(b.split("=", 1) for b in args.budgets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "full_models.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    for model in args.models.split(","):
        workload = ([f"workload={WORKLOADS[model]}"] if model in WORKLOADS else []) + args.override
        weights = Path(args.dir) / f"full-{model}.ptd"
        entry: dict = {"workload": WORKLOADS.get(model, "infer")}
        try:
            t = time.perf_counter()
            engine(f"model={model}", *workload, "mode=materialize", f"out={weights}",
                   f"hydra.run.dir={out / f'{model}-materialize'}")
            entry["materialize_s"] = time.perf_counter() - t
            if not args.no_record:
                rec = out / f"{model}-record"
                engine(f"model={model}", *workload, "mode=record", f"weights.file={weights}",
                       f"hydra.run.dir={rec}")
                trace = rec / "trace.jsonl"
                gz = out / f"{model}-full.jsonl.gz"
                subprocess.run(["gzip", "-c", str(trace)], check=True, stdout=gz.open("wb"))
                entry["trace"] = gz.name
            sweep = out / f"{model}-execute"
            engine("-m", f"model={model}", *workload, "mode=execute", f"weights.file={weights}",
                   f"budget={budgets[model]}", f"weights.eviction={args.evictions}",
                   f"workload.steps={args.steps}", f"hydra.sweep.dir={sweep}")
            entry["runs"] = reports(sweep)
        finally:
            weights.unlink(missing_ok=True)
        result[model] = entry
        result_path.write_text(json.dumps(result, indent=1))
    import torch

    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if torch.cuda.is_available() else "cpu"
    (out / "measured.json").write_text(json.dumps(measured_rows(result, device, " ".join(sys.argv)), indent=1))
    print("\n| model | budget | eviction | predicted ms | measured ms | error | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for model, entry in result.items():
        for r in entry.get("runs", []):
            if "error" in r:
                print(f"| {model} | error | {r['error']} |")
                continue
            cfg, pred, meas = r["config"], r["prediction"], r["measurement"]
            print(f"| {model} | {cfg['budget_mb']} | {meas['eviction']} | {pred['step_ms']:.1f} | "
                  f"{meas['step_ms']:.1f} | {(pred['step_ms'] / meas['step_ms'] - 1) * 100:+.1f}% | "
                  f"{meas['outputs_match_reference']} |")


if __name__ == "__main__":
    main()
