"""Predictions written down before the runs: three model classes never run here before (FLUX.2
[dev], Z-Image, Qwen3-8B), hardware=h200, synthesized on the CPU from the config alone (no
recording). Inference: synced loop, priority, lookahead 2, as benchmarks/real_models.py measures
it. LoRA steps (rank 32, checkpointed, activations kept, free-running, priority, lookahead 2), as
`mode=execute` runs them. `--train-only`: the LoRA steps alone (predicted again after the
backward's census, predictions-after.txt); with `--flux2`, FLUX.2's LoRA step instead
(predictions-flux2-train.txt)."""
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine.config import load_hardware, register  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from real_models import MODELS, WORKLOADS  # noqa: E402

register()
hw = load_hardware("h200")
INFER = [("flux2", (0, 24000, 12000)), ("zimage", (0, 6000, 3000)), ("qwen3_8b", (0, 8000, 4000)),
         ("qwen3_8b_prefill", (0, 8000))]
for key, budgets in [] if "--train-only" in sys.argv else INFER:
    wl = OmegaConf.create(WORKLOADS[key])
    trace = synthesize_module(OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml"), wl, hw)
    for b in budgets:
        p = predict(trace, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced")
        print(f"{key} {dict(wl)}: budget {b}: {p['step_ms']:.1f} ms, bound by {p['bound_by']}, "
              f"H2D {p['h2d_bytes'] / 1e9:.2f} GB, process peak {p['peak_process_bytes'] / 1e9:.2f} GB", flush=True)
TRAIN = [("zimage_diffusers", ["workload.video_tokens=4096", "workload.text_tokens=256"], (None, 4000)),
         ("qwen3_8b_hf", ["workload.text_tokens=2048"], (None, 8000))]
if "--flux2" in sys.argv:  # predicted with the backward counted op by op, before FLUX.2's LoRA step first ran
    TRAIN = [("flux2_diffusers", ["workload.video_tokens=4096", "workload.text_tokens=512"], (None, 24000))]
for model, tokens, budgets in TRAIN:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"model={model}", "workload=train_lora", *tokens, "workload.lora_rank=32", "workload.checkpointing=true",
            "hardware=h200"])
    trace = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
    for b in budgets:
        p = predict(trace, hw, b * 1_000_000 if b else None, 2, "priority")
        print(f"{model} LoRA, {' '.join(tokens)}, budget {b}: {p['step_ms']:.1f} ms, bound by {p['bound_by']}, "
              f"H2D {p['h2d_bytes'] / 1e9:.3f} GB, pool + torch peak {p['peak_pool_torch_bytes'] / 1e9:.2f} GB",
              flush=True)
