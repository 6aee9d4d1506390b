# LoRA steps held out on the H200, predicted first (predictions-train.txt): AuraFlow (4096 + 256 tokens,
# budget 8000) and Mochi 1 (6144 + 256, budget 12000), rank 32, checkpointed, priority, lookahead 2,
# each executed with the trace synthesized on the device; then Mistral-7B's prefill again, all
# resident, with each step's output let go before the next (its process peak).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
train() {  # model tokens budget
  M="model=$1"; W="workload=train_lora workload.video_tokens=$2 workload.text_tokens=256 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
  CK=/dev/shm/$1.safetensors; T0=$(date +%s)
  timeout 90 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$1 > /dev/null 2>&1
  timeout 90 python3 - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth-$1.jsonl"), "$M $W hardware=h200".split())
PY
  timeout 220 python3 -m engine $M $W weights.eviction=priority weights.lookahead=2 activations=off hardware=h200 \
    mode=execute trace=/tmp/synth-$1.jsonl weights.file=$CK budget=$3 hydra.run.dir=/tmp/x-$1 2>&1 \
    | grep -v "Warn\|warn" | grep -E "^\| (step time|measured|bound|H2D|peak)|^error|Error" | head -10
  cp /tmp/x-$1/report.json $OUT/$1-execute-report.json; rm -f $CK
  echo "$1 done in $(( $(date +%s) - T0 )) s"
}
train auraflow_diffusers 4096 8000
train mochi_diffusers 6144 12000
timeout 150 python3 benchmarks/real_models.py --models mistral7b_prefill --budgets 0 --evictions priority --lookahead 2 \
  --hardware h200 --out $OUT/prefill 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/prefill.log
rm -f /dev/shm/*; grep "^\[" $OUT/prefill.log | tail -2
