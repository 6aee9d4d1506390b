"""Wall time of a 100-point LTX-2 sweep in simulate mode, as a user runs it.

    python benchmarks/sweep_speed.py                 # both launchers
    python benchmarks/sweep_speed.py --launchers local

The sweep: 25 budgets (5000..29000 MB) x eviction belady,priority x lookahead
1,2 = 100 points of `python -m engine -m +model=ltx ...`, each simulating
`workload.steps` (3) LTX-2 inference steps and writing its report; the sweep
callback writes summary.csv/md and pareto.png. Launchers: `basic` (Hydra's
own, one process, points in turn) and `local` (+launch=local: joblib, one
worker per core). The time is the whole command, start-up included. Checks
that the summary lists every point and names a winner.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ("+model=ltx", "budget=range(5000,30000,1000)", "weights.eviction=belady,priority",
         "weights.lookahead=1,2")
POINTS = 25 * 2 * 2


def run(launcher: str, out: Path) -> dict:
    extra = ["+launch=local"] if launcher == "local" else []
    cmd = [sys.executable, "-m", "engine", "-m", *extra, *SWEEP, f"hydra.sweep.dir={out}"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"sweep with launcher {launcher} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = list(csv.DictReader(open(out / "summary.csv")))
    winner = next((ln for ln in (out / "summary.md").read_text().splitlines() if "inner" in ln), "-")
    return {"launcher": launcher, "points": len(rows), "wall_s": wall, "per_point_s": wall / max(len(rows), 1),
            "pareto": (out / "pareto.png").is_file(), "winner": winner.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launchers", default="basic,local", help="comma-separated: basic, local")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="sweep-speed-") as tmp:
        for launcher in args.launchers.split(","):
            results.append(run(launcher, Path(tmp) / launcher))
            r = results[-1]
            if r["points"] != POINTS or not r["pareto"]:
                sys.exit(f"launcher {launcher}: summary has {r['points']} of {POINTS} points, "
                         f"pareto.png {'written' if r['pareto'] else 'missing'}")
    print(f"\n{POINTS}-point LTX-2 simulate sweep on {os.cpu_count()} cores")
    print("| launcher | points | wall s | s / point |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['launcher']} | {r['points']} | {r['wall_s']:.1f} | {r['per_point_s']:.2f} |")
    print(results[-1]["winner"])


if __name__ == "__main__":
    main()
