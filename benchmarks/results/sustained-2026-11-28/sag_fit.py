"""Each GPU-paced module recording's sag under sustained load (its compute_scale less 1) against
the share of its priced compute in linear cores and the PFLOP/s its cores run at, and each
recording's sag predicted from the others' (left out one at a time) by their median, by the
linear share and by the FLOP rate, through 0. Also each inference recording's synthesized
compute against its held kernels. On the CPU:

    python benchmarks/results/sustained-2026-11-28/sag_fit.py h200 data/traces/h200/modules
    python benchmarks/results/sustained-2026-11-28/sag_fit.py h100_calibrated data/traces/modules
"""
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine.compute import ExecutionTimePredictor, core_flops  # noqa: E402
from engine.config import load_hardware  # noqa: E402
from engine.trace import read_trace  # noqa: E402
from real_models_report import synthesized  # noqa: E402

# FLUX.1-dev recorded on one lease at 4096, 16384 and 4096 tokens (sag.txt): (tokens, sag)
ONE_LEASE = ((4096, 0.0467), (16384, 0.0992), (4096, 0.0422))

hw = load_hardware(sys.argv[1])
p = ExecutionTimePredictor(hw)
rows = []  # (name, sag, linear share, PFLOP/s)
print("| recording | sag | linear share | PFLOP/s | synthesized / held |\n|---|---|---|---|---|")
for path in sorted(Path(sys.argv[2]).glob("*.trace.jsonl.gz")):
    t = read_trace(path)
    h = t.header
    if (h.get("workload") or {}).get("kind") != "infer":
        continue
    scale = float(h["compute_scale"])
    held = sum(r.compute_ns for r in t.records) / scale
    host = sum(r.host_ns for r in t.records) * float(h.get("plain_host_factor") or 1)
    if not (h.get("pipelined_step_ns") and host < held):  # as fit_module_cost's _gpu_paced
        continue
    linear = sum(p.core_ns(op, s) for r in t.records for op, s in r.cores if op == "linear") / held
    rate = sum(core_flops(op, s) for r in t.records for op, s in r.cores) / held / 1e6
    synth = sum(r.compute_ns for r in synthesized(t, hw, None).records) / held
    rows.append((path.name, scale - 1, linear, rate))
    print(f"| {path.name} | {scale - 1:.2%} | {linear:.2f} | {rate:.3f} | {synth:.3f} |")


def left_out(rows: list, feature: int | None) -> tuple[float, float]:
    errors = []
    for i, r in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        if feature is None:
            guess = statistics.median(o[1] for o in others)
        else:
            k = sum(o[1] * o[feature] for o in others) / sum(o[feature] ** 2 for o in others)
            guess = k * r[feature]
        errors.append(abs(guess - r[1]))
    return statistics.mean(errors), max(errors)


def show(rows: list, what: str) -> None:
    print(f"\n{what}, {len(rows)} recordings, each left out: mean / max error in points")
    for name, feature in (("median", None), ("linear share", 2), ("FLOP rate", 3)):
        mean, most = left_out(rows, feature)
        print(f"  {name}: {100 * mean:.2f} / {100 * most:.2f}")


show(rows, "the recordings")
flux = {r[0]: r for r in rows}
if "flux.trace.jsonl.gz" in flux and "flux-16384.trace.jsonl.gz" in flux:
    extra = [(f"one lease {n}", sag, *flux["flux.trace.jsonl.gz" if n == 4096 else "flux-16384.trace.jsonl.gz"][2:])
             for n, sag in ONE_LEASE[:2]]
    show(rows + extra, "with FLUX.1-dev at 4096 and 16384 tokens on one lease (sag.txt)")
