# As run on the lent H100 (OUT: the device tool's output folder).
M="model=flux_diffusers"
W="workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
CK=/dev/shm/flux-train.safetensors
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | tail -2
cp /tmp/rec/trace.jsonl $OUT/flux-train-record.jsonl
rm -f $CK
