#!/bin/bash
# FLUX.1-dev's LoRA step recorded on this lease, then its training grid validated from that
# recording (measured again, on the same machine): the prediction from a recording of the
# model itself, its host's pace the lease's.
set -u
OUT=$1
M="model=flux_diffusers workload=train_lora workload.video_tokens=4096 workload.text_tokens=256 workload.checkpointing=true hardware=h200"
w=/dev/shm/flux_diffusers.safetensors
t0=$(date +%s)
python -m engine model=flux_diffusers mode=materialize out=$w hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1
t1=$(date +%s)
timeout 150 python -m engine $M mode=record weights.file=$w hydra.run.dir=$OUT/rec > $OUT/record.log 2>&1
echo "record rc=$? materialize $((t1 - t0)) s, record $(( $(date +%s) - t1 )) s"
t2=$(date +%s)
timeout 330 python -m engine $M mode=validate trace=$OUT/rec/trace.jsonl weights.file=$w \
    hydra.run.dir=$OUT/validate > $OUT/validate.log 2>&1
echo "validate rc=$? $(( $(date +%s) - t2 )) s"
grep -E "^- (fit|held)|ranking|measured train" $OUT/validate.log
rm -f $w
