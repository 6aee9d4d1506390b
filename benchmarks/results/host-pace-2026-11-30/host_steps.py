"""A plain LoRA step's host time, forward and backward, where the GPU never holds the host up:
the whole model (random bf16 weights on the GPU, peft LoRA, per-block checkpointing, the CLI's
training attention) at a few tokens, so each kernel runs shorter than the host takes to launch
it. The host's work per op does not depend on the tokens (what the simulator's host model
assumes); compare.py prices the same step on a CPU.

    python benchmarks/results/host-pace-2026-11-30/host_steps.py OUT.json MODEL [OVERRIDES...]
"""
import json
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_module

from engine.config import register
from engine.modules.adapters import TrainingLoss, add_lora, enable_checkpointing
from engine.modules.adapters import ALL_LINEAR
from engine.modules.build import build_module, example_inputs

WARM, STEPS = 3, 15


def main(out: str, model: str, *overrides: str) -> None:
    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", "workload=train_lora",
                                                       "workload.checkpointing=true", *overrides])
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the CLI's training runs
    dev = torch.device("cuda")
    module = build_module(cfg.model).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02, generator=g)
    targets = cfg.model.get("lora_targets", ALL_LINEAR)
    add_lora(module, cfg.workload.lora_rank, targets if isinstance(targets, str) else list(targets), device=dev)
    enable_checkpointing(module)
    module.train()
    inputs = example_inputs(cfg.model, module, cfg.workload, dev)
    loss_fn = TrainingLoss(seed=2)
    rows = []
    for i in range(WARM + STEPS):
        for p in module.parameters():
            p.grad = None
        torch.cuda.synchronize(dev)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        t0 = time.perf_counter_ns()
        start.record()
        loss = loss_fn(module(**inputs))
        t1 = time.perf_counter_ns()
        mid.record()
        loss.backward()
        t2 = time.perf_counter_ns()
        end.record()
        torch.cuda.synchronize(dev)
        if i >= WARM:
            rows.append({"host_fwd_ms": (t1 - t0) / 1e6, "host_bwd_ms": (t2 - t1) / 1e6,
                         "gpu_fwd_ms": start.elapsed_time(mid), "gpu_bwd_ms": mid.elapsed_time(end),
                         "step_ms": start.elapsed_time(end)})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{model} {' '.join(overrides)}: host forward {med['host_fwd_ms']:.2f} ms, backward "
          f"{med['host_bwd_ms']:.2f} ms; step {med['step_ms']:.2f} ms (events: forward {med['gpu_fwd_ms']:.2f}, "
          f"backward {med['gpu_bwd_ms']:.2f})")
    json.dump({"model": model, "overrides": list(overrides), "median": med, "steps": rows,
               "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
