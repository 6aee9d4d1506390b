"""Whether lru and belady make the same decisions on the shipped LoRA recordings at the training
grid's budgets (lookahead 2, six synced steps). CPU only:

    PYTHONPATH=. python benchmarks/results/validate-train-2026-11-29/lru_belady.py
"""
import glob
from engine.trace import read_trace
from engine.config import WeightsConfig, hardware_of
from engine.calibrate import base_profile
from engine.validation import grid
from sim import simulate
for prof, pat in (("h200", "data/traces/h200/**/*train*.jsonl.gz"), ("h100_pcie5", "data/traces/modules/*train*.jsonl.gz"), ("h100_pcie5", "data/traces/ltx2_train_lora.jsonl.gz")):
    hw = hardware_of(base_profile(prof))
    for p in sorted(glob.glob(pat, recursive=True)):
        t = read_trace(p)
        bs = sorted({r["budget_mb"] for r in grid(t) if r["budget_mb"] is not None})
        same = []
        for b in bs:
            d = {}
            for ev in ("lru", "belady"):
                r = simulate(t, WeightsConfig(eviction=ev, lookahead=2), None, hw, int(b * 10**6), 6, False, loop="synced")
                d[ev] = [(x.step, x.position, x.action, x.target) for x in r.decisions]
            same.append(d["lru"] == d["belady"])
        print(p.replace("data/traces/", ""), same)
