#!/bin/bash
# The training grid on the GPU (H200): the new GPU tests (a LoRA step resident and streamed, a
# spec model's and a real module's), then a real module's whole LoRA grid from its config:
# Llama-3.1-8B (transformers), 2048 tokens, per-layer checkpointing.
set -u
OUT=$1
timeout 170 python -m pytest -q -p no:cacheprovider -m cuda tests/test_validation_cuda.py > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
timeout 360 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    llama8b_hf:workload=train_lora,workload.text_tokens=2048,workload.checkpointing=true
grep -E "measured train" $OUT/llama8b_hf.validate.log
