"""Predictions written down before the runs: Llama-3.1-8B's 4096-token prefill, never run here,
hardware=h200, synthesized on the CPU (no recording), synced loop, priority, lookahead 2; its
attention causal (is_causal, no mask), priced on the tiles the flash kernel runs. With `qwen`
(argument 1): Qwen2.5-14B's 4096-token prefill the same way, after causal attention was priced
on its waves."""
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine.compute import ExecutionTimePredictor  # noqa: E402
from engine.config import load_hardware  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from real_models import MODELS, WORKLOADS  # noqa: E402

hw = load_hardware("h200")
key = "qwen25_14b_prefill" if sys.argv[1:] == ["qwen"] else "llama8b_prefill"
wl = OmegaConf.create(WORKLOADS[key])
trace = synthesize_module(OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml"), wl, hw)
layer = trace.records[1]
attention = [(op, shape) for op, shape in layer.cores if op.startswith("attention")]
p = ExecutionTimePredictor(hw)
print(f"{key}: a layer's attention {attention}: {p.core_ns(*attention[0]) / 1e3:.1f} us priced "
      f"(as an unmasked, non-causal one {p.core_ns('attention', attention[0][1]) / 1e3:.1f} us)")
for b in (0, 16000, 8000) if key.startswith("qwen") else (0, 8000, 4000):
    r = predict(trace, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced")
    print(f"{key} {dict(wl)}: budget {b}: {r['step_ms']:.1f} ms, bound by {r['bound_by']}, "
          f"H2D {r['h2d_bytes'] / 1e9:.2f} GB, process peak {r['peak_process_bytes'] / 1e9:.2f} GB", flush=True)
