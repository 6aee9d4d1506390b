# After the split of engine/modes/module.py: the CUDA tests, then Llama-3.1-8B through mode=execute:
# decode all resident and at 12000 (inference: the plain module's outputs and steps beside), and a
# LoRA step (rank 32, checkpointed, 2048 tokens) at 8000 (training: module_train.py).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=$OUT
timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
W=/dev/shm/llama8b.safetensors
python3 -m engine model=llama8b_hf mode=materialize out=$W hydra.run.dir=/tmp/mat > /dev/null 2>&1; echo "materialize rc=$?"
run() {  # NAME ARGS...
  local name=$1; shift
  timeout 240 python3 -m engine model=llama8b_hf hardware=h200 mode=execute weights.file=$W hydra.run.dir=$T/$name "$@" \
    > $T/$name.log 2>&1; echo "$name rc=$?"
  grep -E "^\| (step|peak|H2D|D2H)|measured steps|bitwise|against the same" $T/$name.log
}
run decode-null workload=decode budget=null workload.steps=16
run decode-12000 workload=decode budget=12000 workload.steps=16
run lora-8000 workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.text_tokens=2048 \
  weights.eviction=priority weights.lookahead=2 activations=off budget=8000 workload.steps=8
rm -rf /dev/shm/* $T/*/trace.jsonl $T/*/timeline.json
