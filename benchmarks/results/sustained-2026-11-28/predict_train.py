"""LoRA steps predicted before they run (hardware=h200, synthesized, free-running, priority, lookahead 2,
activations kept, budget 16000): with the step's sustained slowdown by its linear share (now) and
with the profile's one number (before)."""
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from engine.config import load_hardware, register  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from engine.trace import Trace  # noqa: E402

register()
hw = load_hardware("h200")
for model, tokens in (("wan14b_diffusers", 6144), ("flux_diffusers", 4096)):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"model={model}", "workload=train_lora", f"workload.video_tokens={tokens}", "workload.text_tokens=512",
            "workload.lora_rank=32", "workload.checkpointing=true", "hardware=h200"])
    trace = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
    before = Trace({k: v for k, v in trace.header.items() if k != "compute_sustained_slowdown"},
                   trace.weight_sizes, trace.records)
    p, q = (predict(t, hw, 16_000_000_000, 2, "priority") for t in (trace, before))
    print(f"{model} LoRA, {tokens} tokens, budget 16000: {p['step_ms']:.1f} ms (before {q['step_ms']:.1f}), "
          f"sustained slowdown {trace.header['compute_sustained_slowdown']}, H2D {p['h2d_bytes'] / 1e9:.3f} GB, "
          f"pool + torch peak {p['peak_pool_torch_bytes'] / 1e9:.2f} GB", flush=True)
