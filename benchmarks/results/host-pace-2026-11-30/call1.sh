#!/bin/bash
# The plain LoRA step's host, forward and backward, at a few tokens (the GPU never the bound),
# for FLUX.1-dev, Wan 14B and Llama-3.1-8B; FLUX also at its grid's 4096 + 256 tokens.
set -u
OUT=$1
H=benchmarks/results/host-pace-2026-11-30/host_steps.py
for run in "flux_diffusers workload.video_tokens=256 workload.text_tokens=32" \
           "flux_diffusers workload.video_tokens=4096 workload.text_tokens=256" \
           "wan14b_diffusers workload.video_tokens=256 workload.text_tokens=32" \
           "llama8b_hf workload.text_tokens=64"; do
  set -- $run
  name=$1-$(echo "$run" | md5sum | cut -c1-6)
  timeout 150 python $H $OUT/$name.json $run > $OUT/$name.log 2>&1
  echo "rc=$? $(grep -E 'host forward' $OUT/$name.log)"
done
