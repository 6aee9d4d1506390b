"""Predictions written down before the runs: two model classes never run before, HunyuanImage 2.1
(diffusers HunyuanImageTransformer2DModel, 17.4B) and Gemma 3 12B's language model (transformers
Gemma3ForCausalLM, 11.8B), hardware=h200, synthesized on the CPU from the config alone (no
recording of either).

- inference: synced loop, priority, lookahead 2, as benchmarks/real_models.py measures it;
- tuning: HunyuanImage at 12000 MB, the 18 candidates grouping (block, leaf) x eviction x
  lookahead (1-3), free-running (steps back to back), each grouping synthesized on its own;
- LoRA steps: rank 32 on the config's targets, checkpointed, activations kept, free-running,
  priority, lookahead 2, as `mode=execute` runs them.

    python benchmarks/results/unseen-2026-11-30b/predict.py > predictions.txt

`--inference KEY:B,B,...` predicts those inference rows alone (HunyuanVideo 1.5, synthesized once
its mask gathers ran on the meta device: predictions-hv15.txt).
"""
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


def synthesized(key: str, grouping: str = "block"):
    model = OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml")
    model.grouping = grouping
    return synthesize_module(model, OmegaConf.create(WORKLOADS[key]), hw)


ONLY = sys.argv[sys.argv.index("--inference") + 1] if "--inference" in sys.argv else None
INFER = [("hunyuan_image", (0, 24000, 12000)), ("gemma3_12b_prefill", (0, 12000, 6000)), ("gemma3_12b", (0, 8000, 4000))]
if ONLY:
    INFER = [(ONLY.split(":")[0], tuple(int(b) for b in ONLY.split(":")[1].split(",")))]
for key, budgets in INFER:
    trace = synthesized(key)
    for b in budgets:
        p = predict(trace, hw, round(b * 1e6) if b else None, 2, "priority", loop="synced")
        print(f"{key} {WORKLOADS[key]}: budget {b}: {p['step_ms']:.1f} ms, bound by {p['bound_by']}, "
              f"H2D {p['h2d_bytes'] / 1e9:.2f} GB, process peak {p['peak_process_bytes'] / 1e9:.2f} GB", flush=True)

if ONLY:
    sys.exit(0)
print("\ntuning: hunyuan_image at 12000 MB, free-running, ranked")
rows = []
for grouping in ("block", "leaf"):
    trace = synthesized("hunyuan_image", grouping)
    for eviction in ("priority", "belady", "lru"):
        for lookahead in (1, 2, 3):
            p = predict(trace, hw, 12000 * 10**6, lookahead, eviction, loop="free")
            rows.append((p["step_ms"], f"{grouping} / {eviction} / {lookahead}", p["h2d_bytes"] / 1e9))
for rank, (ms, name, h2d) in enumerate(sorted(rows), 1):
    print(f"{rank:2d} {name:22s} {ms:8.1f} ms  H2D {h2d:.2f} GB", flush=True)

print()
for model, tokens, budgets in [("hunyuan_image_diffusers", ["workload.video_tokens=4096", "workload.text_tokens=256"],
                                (None, 16000)),
                               ("gemma3_12b_hf", ["workload.text_tokens=2048"], (None, 8000))]:
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
