#!/bin/bash
# FLUX.1-dev's LoRA grid from its config (4096 + 256 tokens, per-block checkpointing), its
# streamed rows' stalls timed.
set -u
OUT=$1
timeout 560 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    flux_diffusers:workload=train_lora,workload.video_tokens=4096,workload.text_tokens=256,workload.checkpointing=true
grep -E "measured train" $OUT/flux_diffusers.validate.log
cp $OUT/flux_diffusers/validate/measurements.json $OUT/flux-measurements.json
rm -rf $OUT/flux_diffusers
