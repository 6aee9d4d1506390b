# LoRA steps held out on the H200, predicted first (predictions-train.txt): Wan 14B (6144 + 512
# tokens) and FLUX.1-dev (4096 + 512), rank 32, checkpointed, budget 16000, priority, lookahead 2,
# each executed with the trace synthesized on the device; then pytest -m cuda.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
train() {  # model tokens
  M="model=$1"; W="workload=train_lora workload.video_tokens=$2 workload.text_tokens=512 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
  CK=/dev/shm/$1.safetensors; T0=$(date +%s)
  timeout 90 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$1 > /dev/null 2>&1
  timeout 90 python3 - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth-$1.jsonl"), "$M $W hardware=h200".split())
PY
  timeout 200 python3 -m engine $M $W weights.eviction=priority weights.lookahead=2 activations=off hardware=h200 \
    mode=execute trace=/tmp/synth-$1.jsonl weights.file=$CK budget=16000 hydra.run.dir=/tmp/x-$1 2>&1 \
    | grep -v "Warn\|warn" | grep -E "^\| (step time|measured|bound|H2D|peak)" | head -8
  cp /tmp/x-$1/report.json $OUT/$1-execute-report.json; rm -f $CK
  echo "$1 done in $(( $(date +%s) - T0 )) s"
}
train wan14b_diffusers 6144
train flux_diffusers 4096
timeout 200 python3 -m pytest -m cuda -q -x -p no:cacheprovider tests 2>&1 | tail -3
