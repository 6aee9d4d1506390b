# Where SD3.5 Large's joint block spends its GPU time (the synthesized block is priced 11% under
# its recording): two blocks at the full width, 4096 + 333 tokens, one forward profiled.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1; export PYTHONPATH=$PWD/.site:$PWD
python3 - <<'PY'
import torch, collections
from types import SimpleNamespace
from omegaconf import OmegaConf
from diffusers import SD3Transformer2DModel
from engine.modules.build import sd3_inputs
cfg = OmegaConf.to_container(OmegaConf.load("conf/model/sd35_large_diffusers.yaml").module)
cfg.pop("_target_"); cfg["num_layers"] = 3
with torch.device("cuda"):
    m = SD3Transformer2DModel(**cfg).to(torch.bfloat16).eval()
x = sd3_inputs(m, SimpleNamespace(batch=1, video_tokens=4096, text_tokens=333), torch.device("cuda"), torch.bfloat16)
blk = m.transformer_blocks[1]
with torch.no_grad():
    for _ in range(20): m(**x)
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity, record_function
    orig = blk.forward
    def fwd(*a, **k):
        with record_function("BLOCK1"):
            return orig(*a, **k)
    blk.forward = fwd
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5): m(**x)
        torch.cuda.synchronize()
ev = prof.events()
blocks = [e for e in ev if e.name == "BLOCK1"]
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.device_type.name == "CUDA" and any(b.time_range.start <= e.time_range.start <= b.time_range.end for b in blocks):
        pass
# Simpler: kernels launched under BLOCK1 (CPU range) via their correlation: use key_averages with stack off
k = prof.key_averages()
rows = sorted([(a.device_time_total / 5, a.count // 5, a.key) for a in k if a.device_time_total > 0 and a.key != "BLOCK1"], reverse=True)
print("per forward of 3 blocks, us, top kernels:")
for t, c, name in rows[:25]:
    print(f"{t:10.1f} {c:5d}  {name[:110]}")
b = [a for a in k if a.key == "BLOCK1"]
print("BLOCK1 device time per call us:", b[0].device_time_total / b[0].count if b else None)
PY
