# Held out on the H200, predicted first (predictions.txt): Qwen3-8B decode over a 4096-token KV
# cache and its 4096-token prefill (benchmarks/real_models.py); then LoRA steps (rank 32,
# checkpointed) of Z-Image at 4000 MB and Qwen3-8B at 8000 MB by `mode=execute`, which records the
# step, runs the plain module all resident and the offloaded one at the budget.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
run() {  # name budgets timeout [steps]
  timeout $3 python3 benchmarks/real_models.py --models $1 --budgets $2 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${4:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run qwen3_8b 0,8000,4000 150 16
run qwen3_8b_prefill 0,8000 110
R="workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off hardware=h200"
train() {  # name model budget tokens...
  local name=$1 M=model=$2 B=$3; shift 3
  timeout 60 python3 -m engine $M mode=materialize out=/dev/shm/$name.safetensors hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
  timeout 150 python3 -m engine $M $R "$@" $P budget=$B mode=execute weights.file=/dev/shm/$name.safetensors \
    hydra.run.dir=$OUT/train-$name > $OUT/train-$name.log 2>&1
  echo "train $name rc $?"; rm -f /dev/shm/* $OUT/train-$name/trace.jsonl $OUT/train-$name/timeline.*
  grep -E "^\| (step|H2D|peak|measured)|^against|every weight resident|rror" $OUT/train-$name.log | head -12
}
train zimage zimage_diffusers 4000 workload.video_tokens=4096 workload.text_tokens=256
train qwen3 qwen3_8b_hf 8000 workload.text_tokens=2048
for f in $OUT/qwen3*.log; do echo "== $f"; grep "^\[" $f | tail -4; grep "^|" $f | tail -6; done
