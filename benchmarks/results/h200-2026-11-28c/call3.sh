# Whole spec LTX-2 (48 blocks) LoRA rank 32 at 6144 tokens on the H200: all resident, then
# 16000 MB on the pool and on vmm, 4 steps each, one lease.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/tr; mkdir -p $T
timeout 80 python3 -m engine model=ltx mode=materialize out=/dev/shm/ltx.ptd hydra.run.dir=$T/mat > /dev/null 2>&1
for run in "resident budget=null weights.backend=cuda" "cuda budget=16000 weights.backend=cuda" "vmm budget=16000 weights.backend=vmm"; do
  set -- $run; name=$1; shift
  timeout 150 python3 -m engine model=ltx workload=train_lora mode=execute weights.file=/dev/shm/ltx.ptd \
    workload.steps=4 hardware=h200 "$@" hydra.run.dir=$T/train-$name 2>&1 | grep -E "^\| (step time|measured|bound)" | head -4
  pkill -f "python3 -m engine"; sleep 1
done
rm -f /dev/shm/*
(cd $T && tar czf $OUT/ltx-train.tgz $(find . -name report.json -o -name "*.md" -o -name telemetry.jsonl))
ls -la $OUT
