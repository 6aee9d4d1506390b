# 1. The engine's tiled attention probe (python -m engine.measure.compute --only attention_tiles),
#    a second lease's times of call 2's shapes. 2. Where SD3.5 Large's joint block spends its GPU
#    time at 9216 + 333 tokens (synthesized 8.5% under its recording with the tiled table).
#    3. FLUX.1-dev at 4080 + 512 tokens (a joint sequence off the tile), held out: all resident, 12000.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/at3; mkdir -p $T
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 120 python3 -m engine.measure.compute --only attention_tiles --out $T/tiles.json; echo "probe rc=$?"
timeout 120 python3 - <<'PY'
import torch, collections
from types import SimpleNamespace
from omegaconf import OmegaConf
from diffusers import SD3Transformer2DModel
from engine.modules.build import sd3_inputs
cfg = OmegaConf.to_container(OmegaConf.load("conf/model/sd35_large_diffusers.yaml").module)
cfg.pop("_target_"); cfg["num_layers"] = 3
with torch.device("cuda"):
    m = SD3Transformer2DModel(**cfg).to(torch.bfloat16).eval()
x = sd3_inputs(m, SimpleNamespace(batch=1, video_tokens=9216, text_tokens=333), torch.device("cuda"), torch.bfloat16)
blk = m.transformer_blocks[1]
from torch.profiler import profile, ProfilerActivity, record_function
with torch.no_grad():
    for _ in range(10): m(**x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    def timed(*a, **k):
        s.record(); out = orig(*a, **k); e.record(); return out
    orig = blk.forward; blk.forward = timed
    times = []
    for _ in range(10):
        m(**x); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
    print("block 1 forward ms (10 runs, median):", sorted(times)[5])
    blk.forward = orig
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): m(**x)
        torch.cuda.synchronize()
k = prof.key_averages()
rows = sorted([(a.device_time_total / 5 / 3, a.count // 15, a.key) for a in k if a.device_time_total > 0], reverse=True)
print("per block (model of 3 blocks / 3), us; launches per block; kernel:")
for t, c, name in rows[:22]:
    print(f"{t:10.1f} {c:5d}  {name[:120]}")
cat = collections.Counter()
for t, c, name in rows:
    n = name.lower()
    cat["attention" if ("sdpa" in n or "flash" in n or "fmha" in n) else "gemm" if ("gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n) else "other"] += t
print("by kind, us per block:", {k: round(v, 1) for k, v in cat.items()})
PY
echo "profile rc=$?"
timeout 300 python3 benchmarks/real_models.py --models flux --workload video_tokens=4080 --budgets 0,12000 \
  --evictions priority --lookahead 2 --hardware h200 --dir /dev/shm --out $T/flux-4080 > $T/flux.log 2>&1
echo "real_models rc=$?"; tail -6 $T/flux.log
rm -f /dev/shm/*
tar czf $OUT/call3.tgz -C $T .
