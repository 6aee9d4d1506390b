# LoRA steps (rank 32 on the configs' targets, checkpointed), predicted first (predictions.txt):
# `mode=execute` records the step, runs the plain module all resident and the offloaded one at the
# budget: HunyuanImage 2.1 at 16000 MB (4096 + 256 tokens), Gemma 3 12B at 8000 MB (2048 tokens).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
R="workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off hardware=h200"
train() {  # name model budget timeout tokens...
  local name=$1 M=model=$2 B=$3 T=$4; shift 4
  timeout 90 python3 -m engine $M mode=materialize out=/dev/shm/$name.safetensors hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
  timeout $T python3 -m engine $M $R "$@" $P budget=$B mode=execute weights.file=/dev/shm/$name.safetensors \
    hydra.run.dir=/tmp/train-$name > $OUT/train-$name.log 2>&1
  echo "train $name rc $?"; rm -f /dev/shm/*
  gzip -c /tmp/train-$name/trace.jsonl > $OUT/$name-train.jsonl.gz 2>/dev/null
  grep -E "^\| (step|H2D|peak|measured)|^against|every weight resident|rror" $OUT/train-$name.log | head -12
}
train hunyuan_image hunyuan_image_diffusers 16000 300 workload.video_tokens=4096 workload.text_tokens=256
train gemma3 gemma3_12b_hf 8000 180 workload.text_tokens=2048
