#!/bin/bash
# The GPU tests after the session's changes (StreamedWeights and the training handle fetch
# through a wrapper; the census's frozen inputs), then the plain LoRA step's host at a few
# tokens again on this lease (FLUX.1-dev, Llama-3.1-8B).
set -u
OUT=$1
timeout 380 python -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
H=benchmarks/results/host-pace-2026-11-30/host_steps.py
for run in "flux_diffusers workload.video_tokens=256 workload.text_tokens=32" "llama8b_hf workload.text_tokens=64"; do
  set -- $run
  timeout 60 python $H $OUT/$1-b.json $run > $OUT/$1-b.log 2>&1
  echo "rc=$? $(grep -E 'host forward' $OUT/$1-b.log)"
done
