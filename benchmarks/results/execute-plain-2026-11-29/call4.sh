# Llama-3.1-8B after the recorder stopped holding a training step's output through its backward
# (the recordings over-predicted the LoRA step's pool + torch peak by one step's logits, 525 MB)
# and execute's H2D bytes became the warm steps' mean: a LoRA step at 8000, decode at 12000 (belady).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/c4; mkdir -p $T
W=/dev/shm/llama8b.safetensors
python3 -m engine model=llama8b_hf mode=materialize out=$W hydra.run.dir=/tmp/mat > /dev/null 2>&1; echo "materialize rc=$?"
run() {  # NAME ARGS...
  local name=$1; shift
  timeout 240 python3 -m engine model=llama8b_hf hardware=h200 mode=execute weights.file=$W hydra.run.dir=$T/$name "$@" \
    > $T/$name.log 2>&1; echo "$name rc=$?"
  grep -E "^\| (step|peak|H2D|D2H)|measured steps|bitwise|against the same" $T/$name.log
}
run lora-8000 workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.text_tokens=2048 \
  weights.eviction=priority weights.lookahead=2 activations=off budget=8000 workload.steps=6
run decode-12000 workload=decode budget=12000 workload.steps=16
rm -rf /dev/shm/*
cd $T && gzip -f */trace.jsonl; rm -f */timeline.json
tar czf $OUT/runs.tgz $(find . -name "trace.jsonl.gz" -o -name report.json -o -name report.md -o -name telemetry.jsonl -o -name "*.log")
