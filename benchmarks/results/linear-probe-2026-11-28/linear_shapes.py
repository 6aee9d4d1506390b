"""Each linear shape of a census_ops.py file (its time in the model, events included) against the
shipped kernel table's price, and the probe points of three linear grids at a few shapes. On the CPU:

    python benchmarks/results/linear-probe-2026-11-28/linear_shapes.py \
        benchmarks/results/census-2026-11-28/ops-h200.json.gz ltx2:6144
"""
import collections
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from census_ops import timed_cores  # noqa: E402
from engine.compute import ExecutionTimePredictor  # noqa: E402
from engine.config import load_hardware  # noqa: E402
from engine.trace import read_trace  # noqa: E402

p = ExecutionTimePredictor(load_hardware("h200"))
with gzip.open(sys.argv[1], "rt") as f:
    data = json.load(f)
for case in data["cases"]:
    if not case["case"].startswith(tuple(sys.argv[2:])):
        continue
    shapes = collections.defaultdict(list)
    for op, shape, ns in timed_cores(case):
        if op == "linear":
            shapes[shape].append(ns)
    print(f"{case['case']}\n| m, n, k | ops | in the model us | priced us |\n|---|---|---|---|")
    for shape, times in sorted(shapes.items(), key=lambda x: -sum(x[1])):
        print(f"| {shape} | {len(times)} | {sum(times) / len(times) / 1e3:.1f} | {p.core_ns('linear', shape) / 1e3:.1f} |")

here = Path(__file__).parent
grids = {"shipped (recording's header)": read_trace(ROOT / "data/traces/h200/flux-full.jsonl.gz").header["probes"]["compute"],
         "call 1 (held)": json.loads((here / "probes-h200-linear.json").read_text())["probes"]["compute"],
         "call 2 (held, cold weights)": json.loads((here / "probes-h200-linear-cold.json").read_text())["probes"]["compute"]}
points = {name: {tuple(r[:3]): r[3] for r in g["linear"]} for name, g in grids.items()}
print("\n| m, n, k | " + " | ".join(f"{name} us" for name in points) + " |\n|---|---|---|---|")
for shape in ((1, 4096, 4096), (1, 2048, 2048), (64, 2048, 2048), (256, 2048, 2048), (256, 4096, 4096),
              (1024, 4096, 4096), (6144, 4096, 4096), (16384, 4096, 4096)):
    print(f"| {shape} | " + " | ".join(f"{pts[shape] / 1e3:.1f}" for pts in points.values()) + " |")
