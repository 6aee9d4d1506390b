# Spec LTX-2 whole LoRA training on the pool at 16000 (relocating inside a step) and all
# resident; the fault tests on CUDA; Wan 2.1 14B from diffusers recorded and measured.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/tr2; mkdir -p $T
timeout 80 python3 -m engine model=ltx mode=materialize out=/dev/shm/ltx.ptd hydra.run.dir=$T/mat > /dev/null 2>&1
timeout 140 python3 -m engine model=ltx workload=train_lora budget=16000 mode=execute weights.file=/dev/shm/ltx.ptd \
  workload.steps=4 hydra.run.dir=$T/train-cuda 2>&1 | grep -v Warning | tail -3
pkill -f "python3 -m engine"; sleep 1
timeout 120 python3 -m engine model=ltx workload=train_lora budget=null mode=execute weights.file=/dev/shm/ltx.ptd \
  workload.steps=3 hydra.run.dir=$T/train-resident 2>&1 | grep -v Warning | tail -3
pkill -f "python3 -m engine"; sleep 1
rm -f /dev/shm/*
(cd $T && tar czf $OUT/ltx-train.tgz $(find . -name report.json -o -name "*.md" -o -name engine.log -o -name telemetry.jsonl))
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_faults.py tests/test_train_execute.py 2>&1 | tail -3
R=/tmp/rm2; mkdir -p $R
timeout 260 python3 benchmarks/real_models.py --models wan14b --budgets 0,16000,8000 --evictions priority --lookahead 2 \
  --steps 6 --hardware h200 --out $R 2>&1 | grep -v Warning | tail -8
rm -f /dev/shm/*
(cd $R && tar czf $OUT/wan-real.tgz $(find . -type f))
ls -la $OUT
