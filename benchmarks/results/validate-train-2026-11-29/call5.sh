#!/bin/bash
# Wan 2.1 14B's LoRA grid (diffusers), 6144 + 512 tokens, per-block checkpointing, from its
# config, as its H200 LoRA recording (data/traces/h200/modules/wan14b-train.jsonl.gz) was made.
set -u
OUT=$1
timeout 540 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    wan14b_diffusers:workload=train_lora,workload.video_tokens=6144,workload.text_tokens=512,workload.checkpointing=true
grep -E "measured train" $OUT/wan14b_diffusers.validate.log
cp $OUT/wan14b_diffusers/validate/measurements.json $OUT/wan-measurements.json
rm -rf $OUT/wan14b_diffusers
