#!/bin/bash
# Wan 2.1 14B's LoRA grid from its config (6144 + 512 tokens, per-block checkpointing), its
# streamed rows' stalls timed; then FLUX.1-dev's block kinds profiled again, the first block's
# input carrying a gradient as every later block's does.
set -u
OUT=$1
timeout 100 python benchmarks/results/flux-lora-ops-2026-11-30/profile_blocks.py $OUT > $OUT/flux-ops.log 2>&1
echo "flux profile rc=$?"; grep -E "^== " $OUT/flux-ops.log
timeout 480 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    wan14b_diffusers:workload=train_lora,workload.video_tokens=6144,workload.text_tokens=512,workload.checkpointing=true
grep -E "measured train" $OUT/wan14b_diffusers.validate.log
cp $OUT/wan14b_diffusers/validate/measurements.json $OUT/wan-measurements.json
rm -rf $OUT/wan14b_diffusers
