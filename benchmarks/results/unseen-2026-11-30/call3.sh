# Z-Image's LoRA step (rank 32, checkpointed, 4096 + 256 tokens) recorded on the H200 (mode=record),
# to set beside its synthesized step (predicted 6.5-7.4% under the measured steps in call 2).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
M="model=zimage_diffusers workload=train_lora workload.lora_rank=32 workload.checkpointing=true"
W="workload.video_tokens=4096 workload.text_tokens=256 hardware=h200"
timeout 60 python3 -m engine $M mode=materialize out=/dev/shm/z.safetensors hydra.run.dir=/tmp/mat > /dev/null 2>&1
timeout 200 python3 -m engine $M $W mode=record weights.file=/dev/shm/z.safetensors hydra.run.dir=/tmp/rec > $OUT/record.log 2>&1
echo "record rc $?"; gzip -c /tmp/rec/trace.jsonl > $OUT/zimage-train.jsonl.gz; rm -f /dev/shm/*
grep -v INFO $OUT/record.log | tail -5
