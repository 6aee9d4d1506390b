# Spec LTX-2 whole LoRA training at 16000 on the pool (the reserve released before any stop)
# and on vmm; then FLUX.1-dev from diffusers recorded and measured on the H200.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
nvidia-smi --query-gpu=name,memory.total,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv > $OUT/gpu.txt
T=/tmp/tr; mkdir -p $T
timeout 80 python3 -m engine model=ltx mode=materialize out=/dev/shm/ltx.ptd hydra.run.dir=$T/mat > /dev/null 2>&1
for b in cuda vmm; do
  timeout 140 python3 -m engine model=ltx workload=train_lora budget=16000 mode=execute weights.file=/dev/shm/ltx.ptd \
    workload.steps=4 weights.backend=$b hydra.run.dir=$T/train-$b 2>&1 | grep -v Warning | tail -4
  pkill -f "python3 -m engine"; sleep 1
done
rm -f /dev/shm/*
(cd $T && tar czf $OUT/ltx-train.tgz $(find . -name report.json -o -name "*.md" -o -name engine.log))
R=/tmp/rm; mkdir -p $R
timeout 300 python3 benchmarks/real_models.py --models flux --budgets 0,16000,8000 --evictions priority --lookahead 2 \
  --steps 6 --hardware h200 --out $R 2>&1 | grep -v Warning | tail -14
rm -f /dev/shm/*
(cd $R && tar czf $OUT/flux-real.tgz $(find . -type f))
ls -la $OUT
