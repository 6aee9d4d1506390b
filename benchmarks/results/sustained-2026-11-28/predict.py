"""Predictions written down before the run: hardware=h200, synthesized (no recording), synced loop,
priority, lookahead 2; with the step's sustained slowdown by its linear share (now) and with the
profile's one number (before)."""
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
CASES = [("wan14b", 12288, (0, 16000)), ("flux", 16384, (0, 12000)), ("hunyuan_video", 12288, (0, 12000)),
         ("ltx2", 12288, (0, 16000))]
for key, tokens, budgets in CASES:
    wl = OmegaConf.create({**WORKLOADS[key], "video_tokens": tokens})
    trace = synthesize_module(OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml"), wl, hw)
    before = Trace({k: v for k, v in trace.header.items() if k != "compute_sustained_slowdown"},
                   trace.weight_sizes, trace.records)
    for b in budgets:
        p, q = (predict(t, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced") for t in (trace, before))
        print(f"{key} video_tokens={tokens} budget {b}: {p['step_ms']:.1f} ms (before {q['step_ms']:.1f}), "
              f"sustained slowdown {trace.header['compute_sustained_slowdown']}, process peak "
              f"{p['peak_process_bytes'] / 1e9:.2f} GB", flush=True)
