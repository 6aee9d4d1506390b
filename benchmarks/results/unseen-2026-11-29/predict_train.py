"""LoRA steps of two model classes never trained here before, predicted before they run
(hardware=h200, synthesized, free-running, priority, lookahead 2, activations kept, rank 32,
checkpointed): AuraFlow at 4096 + 256 tokens, budget 8000; Mochi 1 at 6144 + 256, budget 12000."""
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from engine.config import load_hardware, register  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402

register()
hw = load_hardware("h200")
for model, tokens, budget in (("auraflow_diffusers", 4096, 8000), ("mochi_diffusers", 6144, 12000)):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"model={model}", "workload=train_lora", f"workload.video_tokens={tokens}", "workload.text_tokens=256",
            "workload.lora_rank=32", "workload.checkpointing=true", "hardware=h200"])
    trace = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
    p = predict(trace, hw, budget * 1_000_000, 2, "priority")
    print(f"{model} LoRA, {tokens} + 256 tokens, budget {budget}: {p['step_ms']:.1f} ms, bound by {p['bound_by']}, "
          f"H2D {p['h2d_bytes'] / 1e9:.3f} GB, pool + torch peak {p['peak_pool_torch_bytes'] / 1e9:.2f} GB", flush=True)
