"""The 18 tuning candidates predicted from HunyuanImage 2.1's config (predictions.txt, written
before the runs) beside their measurement (runs/tune/real_models.json): free-running steps, the
simulator's steady state, and the synced ones; the pick against the best measured.

    python benchmarks/results/unseen-2026-11-30b/tuning.py
"""
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent
predicted = {}
for line in (HERE / "predictions.txt").read_text().splitlines():
    m = re.match(r"\s*\d+ (\w+ / \w+ / \d) +([\d.]+) ms", line)
    if m:
        predicted[m[1]] = float(m[2])
rows = json.loads((HERE / "runs/tune/real_models.json").read_text())["results"][0]["rows"]
measured = {f"{r['grouping']} / {r['eviction']} / {r['lookahead']}": r for r in rows if r["budget_mb"] == 12000}
assert set(measured) == set(predicted), "the candidates measured are not the ones predicted"
best = min(measured.values(), key=lambda r: r["free_running_ms"])["free_running_ms"]
pick = min(predicted, key=predicted.get)
print("| rank predicted | candidate | predicted ms | free-running ms (rank) | error | synced median ms | relocations |")
print("|---|---|---|---|---|---|---|")
order = sorted(measured, key=lambda c: measured[c]["free_running_ms"])
errors = []
for rank, c in enumerate(sorted(predicted, key=predicted.get), 1):
    r = measured[c]
    err = predicted[c] / r["free_running_ms"] - 1
    errors.append((abs(err), r["free_running_relocations"]))
    print(f"| {rank} | {c} | {predicted[c]:.1f} | {r['free_running_ms']:.1f} ({order.index(c) + 1}) | {100 * err:+.1f}% "
          f"| {r['step_ms']:.1f} | {r['relocations']} / {r['free_running_relocations']} |")
quiet = [e for e, reloc in errors if not reloc]
print(f"\nthe pick, {pick}: {measured[pick]['free_running_ms']:.1f} ms free-running, "
      f"{100 * (measured[pick]['free_running_ms'] / best - 1):+.1f}% of the best measured ({best:.1f})")
print(f"error over the {len(quiet)} candidates without relocations: {100 * statistics.mean(quiet):.1f}% mean, "
      f"{100 * max(quiet):.1f}% max; all {len(errors)}: {100 * statistics.mean(e for e, _ in errors):.1f}% mean")
