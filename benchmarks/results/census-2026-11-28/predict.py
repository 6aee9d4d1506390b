"""Predictions written down before the run (hardware=h200, synthesized, synced loop, priority, lookahead 2)."""
import sys
from pathlib import Path
from omegaconf import OmegaConf
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from engine.config import load_hardware  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402

hw = load_hardware("h200")
CASES = [("hunyuan_video_diffusers", dict(video_tokens=6144, text_tokens=256), (0, 12000)),
         ("sd35_large_diffusers", dict(video_tokens=1024, text_tokens=333), (0, 8000))]
if sys.argv[1:] == ["second"]:
    CASES = [("qwen_image_diffusers", dict(video_tokens=4096, text_tokens=256), (0, 16000)),
             ("ltx2_diffusers", dict(video_tokens=3072, audio_tokens=128, text_tokens=256), (0, 16000))]
for model, shape, budgets in CASES:
    wl = OmegaConf.create({"kind": "infer", "batch": 1, "audio_tokens": 0, "context_tokens": 0, **shape})
    trace = synthesize_module(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"), wl, hw)
    for b in budgets:
        p = predict(trace, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced")
        print(f"{model} {shape} budget {b}: {p['step_ms']:.1f} ms, process peak {p['peak_process_bytes'] / 1e9:.2f} GB")
