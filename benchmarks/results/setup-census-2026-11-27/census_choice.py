"""As run (from the repository root): the eviction and lookahead chosen on each shipped real module's
recording against those chosen on its synthesized trace (module costs fitted without it), at each
budget of its measured rows, with h100_pcie5; each pick's step as the recording predicts it.

    python benchmarks/results/setup-census-2026-11-27/census_choice.py
"""
import sys, json
sys.path.insert(0, 'benchmarks')
from pathlib import Path
from omegaconf import OmegaConf
from engine.trace import read_trace
from engine.config import load_hardware
from engine.modules.offload import predict
from real_models_report import synthesized
import tempfile
hw = load_hardware("h100_pcie5")
tmp = Path(tempfile.mkdtemp())
d = Path('data/traces/modules')
data = json.load(open(d/'real_models.json'))
for path in sorted(d.glob('*.trace.jsonl.gz')):
    t = read_trace(path)
    if t.header['workload'].get('kind') == 'train_lora': continue
    s = synthesized(t, hw, True, tmp)
    budgets = sorted({r['budget_mb'] for res in data['results'] if res['model']==t.header['model'] for r in res['rows'] if r['budget_mb']}) or [8000, 16000]
    for b in budgets:
        pr = predict(t, hw, round(b*1e6), "auto", "auto")
        ps = predict(s, hw, round(b*1e6), "auto", "auto")
        # the recorded trace's prediction of the synthesized pick
        cs = pr['candidates'].get(f"{ps['eviction']}/{ps['lookahead']}")
        print(f"{t.header['model']:22s} {b:6.0f} recorded pick {pr['eviction']}/{pr['lookahead']} {pr['step_ms']:.1f} | census pick {ps['eviction']}/{ps['lookahead']} (recorded predicts {cs:.1f}, {100*(cs/pr['step_ms']-1):+.2f}%)")
