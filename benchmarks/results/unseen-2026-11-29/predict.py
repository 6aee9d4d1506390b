"""Predictions written down before the runs: three model classes never run here before (Mochi 1,
AuraFlow, Mistral-7B decode and prefill), hardware=h200, synthesized on the CPU (no recording),
synced loop, priority, lookahead 2. Mochi's with and without the host syncs its nonzero makes."""
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine.config import load_hardware  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from engine.trace import Trace  # noqa: E402
from real_models import MODELS, WORKLOADS  # noqa: E402

hw = load_hardware("h200")
CASES = [("mochi", (0, 8000, 3000)), ("auraflow", (0, 8000, 4000)), ("mistral7b", (0, 8000, 4000)),
         ("mistral7b_prefill", (0, 8000))]
for key, budgets in CASES:
    wl = OmegaConf.create(WORKLOADS[key])
    trace = synthesize_module(OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml"), wl, hw)
    nosync = Trace({k: v for k, v in trace.header.items() if k != "host_syncs"}, trace.weight_sizes, trace.records)
    for b in budgets:
        p, q = (predict(t, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced") for t in (trace, nosync))
        syncs = f" (without its {len(trace.header['host_syncs'])} host syncs {q['step_ms']:.1f})" \
            if trace.header.get("host_syncs") else ""
        print(f"{key} {dict(wl)}: budget {b}: {p['step_ms']:.1f} ms{syncs}, bound by {p['bound_by']}, "
              f"H2D {p['h2d_bytes'] / 1e9:.2f} GB, process peak {p['peak_process_bytes'] / 1e9:.2f} GB", flush=True)
