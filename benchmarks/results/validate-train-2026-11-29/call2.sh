#!/bin/bash
# FLUX.1-dev's LoRA grid (diffusers), 4096 + 256 tokens, per-block checkpointing, as its
# H200 LoRA recording (data/traces/h200/modules/flux-train.jsonl.gz) was made.
set -u
OUT=$1
timeout 560 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    flux_diffusers:workload=train_lora,workload.video_tokens=4096,workload.text_tokens=256,workload.checkpointing=true
grep -E "measured train" $OUT/flux_diffusers.validate.log
