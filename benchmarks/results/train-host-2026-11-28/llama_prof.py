"""A plain Llama-3.1-8B LoRA step (rank 32, all-linear, checkpointed, 2048 tokens, the CLI's
loss) on the GPU, no engine: step wall, GPU kernel sum, top ops by CUDA time; host-bound?"""
import time, torch, collections, json, os, sys
from omegaconf import OmegaConf
from hydra import compose, initialize_config_module
from engine.config import register
register()
from engine.modules.build import build_module, example_inputs
from engine.modules.adapters import add_lora, enable_checkpointing, TrainingLoss
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.backends.cuda.enable_cudnn_sdp(False)
with initialize_config_module(config_module="conf", version_base="1.3"):
    cfg = compose(config_name="config", overrides=[sys.argv[1] if len(sys.argv) > 1 else "model=llama8b_hf", "workload=train_lora", "workload.text_tokens=2048",
                                        "workload.lora_rank=32", "workload.checkpointing=true"])
m = build_module(cfg.model)
m.to_empty(device=DEV)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
add_lora(m, 32, cfg.model.lora_targets, device=torch.device(DEV))
enable_checkpointing(m)
inputs = example_inputs(cfg.model, m, cfg.workload, torch.device(DEV))
loss_fn = TrainingLoss(seed=2)
params = [p for p in m.parameters() if p.requires_grad]
def step():
    for p in params: p.grad = None
    loss_fn(m(**inputs)).backward()
for _ in range(3): step()
(torch.cuda.synchronize() if DEV == "cuda" else None)
if DEV == "cpu": print("cpu ok", float(loss_fn(m(**inputs)))); sys.exit()
walls = []
for _ in range(7):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter(); s.record(); step(); host = time.perf_counter() - t0; e.record(); (torch.cuda.synchronize() if DEV == "cuda" else None)
    walls.append((s.elapsed_time(e), host * 1e3))
walls.sort()
print("plain step ms (gpu events, host launch) median:", walls[3])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); (torch.cuda.synchronize() if DEV == "cuda" else None)
ka = prof.key_averages()
rows = sorted([(k.device_time_total / 1e3, k.count, k.key) for k in ka if k.device_time_total > 0], reverse=True)
kern = sum(k.self_device_time_total for k in ka) / 1e3
print(f"GPU self time total {kern:.1f} ms")
for t, c, name in rows[:40]:
    print(f"{t:9.2f} ms {c:6d}  {name[:90]}")
# kernel-level: top kernels by total
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
kk = collections.Counter(); kc = collections.Counter()
for e in ev:
    kk[e.name[:80]] += e.device_time; kc[e.name[:80]] += 1
print("kernels", len(ev))
for n, t in kk.most_common(25):
    print(f"K {t/1e3:9.2f} ms {kc[n]:6d} {n}")
