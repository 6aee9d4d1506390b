"""The whole model's LoRA step without the engine: every weight on the GPU, random, the same
LoRA targets, per-block checkpointing, the CLI's loss. CUDA events, median of 5 after 3 warm-up."""
import statistics, subprocess, sys
import torch
from hydra import compose, initialize_config_module
from engine.config import register
from engine.modules.build import build_module, example_inputs
from engine.modules.adapters import add_lora, enable_checkpointing, TrainingLoss
register()
dev = torch.device("cuda")
name, tokens = sys.argv[1], sys.argv[2]
with initialize_config_module(config_module="conf", version_base="1.3"):
    cfg = compose("config", overrides=[f"model={name}", "workload=train_lora", f"workload.video_tokens={tokens}",
                                       "workload.lora_rank=32", "workload.checkpointing=true", *sys.argv[3:]])
module = build_module(cfg.model).to_empty(device=dev)
with torch.no_grad():
    for p in module.parameters():
        p.normal_(0, 0.02)
    for b in module.buffers():
        if b.is_floating_point():
            b.normal_(0, 0.02)
inputs = example_inputs(cfg.model, module, cfg.workload, dev)
add_lora(module, 32, list(cfg.model.lora_targets), device=dev)
enable_checkpointing(module)
loss = TrainingLoss()
params = [p for p in module.parameters() if p.requires_grad]


def step():
    for p in params:
        p.grad = None
    loss(module(**inputs)).backward()


def fwd():
    module(**inputs)


for label, fn in (("step", step), ("forward", fwd)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"PLAIN {name} {tokens} {label}: median {statistics.median(ts):.1f} ms, all {[round(t, 1) for t in ts]} | {smi}")
