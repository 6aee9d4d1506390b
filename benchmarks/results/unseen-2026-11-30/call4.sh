# FLUX.2 [dev]'s LoRA step (rank 32, checkpointed, 4096 + 512 tokens), never trained here, predicted
# first (predictions-flux2-train.txt): mode=execute records it, runs the plain module all resident
# and the offloaded one at 24000 MB. Then the GPU tests at the session's code.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
M="model=flux2_diffusers"
R="workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="workload.video_tokens=4096 workload.text_tokens=512 weights.eviction=priority weights.lookahead=2 activations=off hardware=h200"
T0=$(date +%s)
timeout 120 python3 -m engine $M mode=materialize out=/dev/shm/f2.safetensors hydra.run.dir=/tmp/mat > /dev/null 2>&1
echo "materialized rc $? $(( $(date +%s) - T0 )) s"
timeout 330 python3 -m engine $M $R $P budget=24000 mode=execute weights.file=/dev/shm/f2.safetensors \
  hydra.run.dir=/tmp/f2 > $OUT/train-flux2.log 2>&1
echo "train flux2 rc $? $(( $(date +%s) - T0 )) s"; rm -f /dev/shm/*
gzip -c /tmp/f2/trace.jsonl > $OUT/flux2-train.jsonl.gz 2>/dev/null
grep -E "^\| (step|H2D|peak|measured)|^against|every weight resident|rror" $OUT/train-flux2.log | head -12
timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
