"""One HunyuanVideo single + one dual block (default width, 4096 tokens), LoRA rank 32, checkpointed:
GPU time by kernel name over one training step, and over one inference forward."""
import collections, os, sys
import torch
from hydra import compose, initialize_config_module
from torch.profiler import profile, ProfilerActivity
from engine.config import register
from engine.modules.build import build_module, example_inputs
from engine.modules.adapters import add_lora, enable_checkpointing, TrainingLoss
register()
dev = torch.device("cuda")
name = sys.argv[1]
layers = sys.argv[2:]
with initialize_config_module(config_module="conf", version_base="1.3"):
    cfg = compose("config", overrides=[f"model={name}", "workload=train_lora", "workload.video_tokens=4096",
                                       "workload.lora_rank=32", "workload.checkpointing=true", *layers])
module = build_module(cfg.model).to_empty(device=dev)
with torch.no_grad():
    for p in module.parameters():
        p.normal_(0, 0.02)
    for b in module.buffers():
        if b.is_floating_point():
            b.normal_(0, 0.02)
inputs = example_inputs(cfg.model, module, cfg.workload, dev)


def by_kernel(run, label):
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(); torch.cuda.synchronize()
    t = collections.Counter(); n = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t[e.name[:100]] += e.device_time; n[e.name[:100]] += 1
    total = sum(t.values())
    print(f"== {label}: {total / 1e3:.2f} ms of kernels, {sum(n.values())} kernels")
    for k, us in t.most_common(25):
        print(f"   {us / 1e3:7.3f} ms {n[k]:4d}x {k}")


with torch.no_grad():
    by_kernel(lambda: module(**inputs), name + " inference forward")
add_lora(module, 32, list(cfg.model.lora_targets), device=dev)
enable_checkpointing(module)
loss = TrainingLoss()
by_kernel(lambda: module(**inputs), name + " training forward")
by_kernel(lambda: loss(module(**inputs)).backward(), name + " training step")
