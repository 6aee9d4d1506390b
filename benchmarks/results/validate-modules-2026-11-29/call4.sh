#!/bin/bash
# pytest -m cuda again (the reconfigure test's budgets over its floor), then a real module's
# LoRA grid on the GPU: Llama-3.1-8B (transformers), 2048 tokens, per-layer checkpointing.
set -u
OUT=$1
timeout 200 python -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
timeout 300 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    llama8b_hf:workload=train_lora,workload.text_tokens=2048,workload.checkpointing=true
