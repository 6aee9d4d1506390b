#!/bin/bash
# Call 3's validate again on the same machine (call 3's measurements did not come back): the
# training grid from the recording call 3 made (data/traces/h200/validate/flux-train-c.jsonl.gz).
set -u
OUT=$1
M="model=flux_diffusers workload=train_lora workload.video_tokens=4096 workload.text_tokens=256 workload.checkpointing=true hardware=h200"
w=/dev/shm/flux_diffusers.safetensors
python -m engine model=flux_diffusers mode=materialize out=$w hydra.run.dir=/tmp/mat > $OUT/mat.log 2>&1
t2=$(date +%s)
timeout 400 python -m engine $M mode=validate trace=data/traces/h200/validate/flux-train-c.jsonl.gz \
    weights.file=$w hydra.run.dir=/tmp/validate > $OUT/validate.log 2>&1
echo "validate rc=$? $(( $(date +%s) - t2 )) s"
cp /tmp/validate/measurements.json $OUT/
grep -E "^- (fit|held)|ranking|measured train" $OUT/validate.log
rm -f $w
