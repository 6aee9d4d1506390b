"""FLUX.1-dev's two block kinds in a LoRA step (4096 + 256 tokens, per-block checkpointing, the
CLI's training attention), one of each, on the GPU: every kernel of the forward and of the whole
step by torch.profiler, grouped by the aten op that launched it and its input shapes (the median
of STEPS steps). What the synthesized step prices by census (engine/modules/census.py) is
compared with it on a CPU (compare.py).

    python benchmarks/results/flux-lora-ops-2026-11-30/profile_blocks.py OUT_DIR [OVERRIDES]
"""
import json
import statistics
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from torch.profiler import ProfilerActivity, profile

from engine.config import register
from engine.modules.adapters import TrainingLoss, add_lora, enable_checkpointing
from engine.modules.build import build_module, example_inputs

STEPS = 5

OVERRIDES = ["model=flux_diffusers", "workload=train_lora", "workload.video_tokens=4096", "workload.text_tokens=256",
             "workload.checkpointing=true", "+model.module.num_layers=1", "+model.module.num_single_layers=1"]


def main(out: Path) -> None:
    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=OVERRIDES + sys.argv[2:])
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the CLI's training runs (README, Training)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a dry run, no kernel times
    module = build_module(cfg.model).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02, generator=g)
    add_lora(module, cfg.workload.lora_rank, list(cfg.model.lora_targets), device=dev)
    enable_checkpointing(module)
    module.train()
    inputs = example_inputs(cfg.model, module, cfg.workload, dev)
    # The first block's input carries a gradient, as every later block's does in the whole model
    # (without it the first block's backward leaves out the gradients of its input).
    inputs["hidden_states"].requires_grad_(True)
    loss_fn = TrainingLoss(seed=2)

    def step(profiled_forward_only: bool = False, prof=None) -> None:
        for p in module.parameters():
            p.grad = None
        loss = loss_fn(module(**inputs))
        if prof is not None and profiled_forward_only:
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            prof.stop()
        loss.backward()

    for _ in range(3):
        step()
    result = {}
    for phase in ("forward", "step"):
        ops, kernels = [], {}
        for _ in range(STEPS):
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA][:1 + (dev.type == "cuda")],
                           record_shapes=True)
            prof.start()
            step(phase == "forward", prof)
            if phase == "step":
                torch.cuda.synchronize(dev) if dev.type == "cuda" else None
                prof.stop()
            ops.append({(e.key, str(e.input_shapes)): (e.count, e.self_device_time_total)
                        for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0})
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    k = kernels.setdefault(e.name, [0, 0.0])
                    k[0] += 1
                    k[1] += e.device_time_total / STEPS
        keys = set().union(*ops)
        rows = [{"op": k[0], "shapes": k[1], "calls": ops[-1].get(k, (0, 0))[0],
                 "self_us": statistics.median(o.get(k, (0, 0.0))[1] for o in ops)} for k in keys]
        rows.sort(key=lambda r: -r["self_us"])
        result[phase] = {"ops": rows, "kernels": kernels}
        print(f"== {phase}: kernels {sum(r['self_us'] for r in rows) / 1e3:.3f} ms (median of {STEPS} per op)")
        for r in rows[:40]:
            print(f"{r['self_us']:10.1f} us {r['calls']:4d}x {r['op']:36s} {r['shapes'][:110]}")
    (out / "flux_blocks.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
