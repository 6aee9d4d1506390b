#!/bin/bash
# pytest -m cuda again (the reconfigure test over the vmm backend's floors too), then the same LoRA
# grid as call 4, each row now timed until settled (call 4 ran ten steps a row): Llama-3.1-8B
# (transformers), 2048 tokens, per-layer checkpointing.
set -u
OUT=$1
timeout 200 python -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
timeout 300 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    llama8b_hf:workload=train_lora,workload.text_tokens=2048,workload.checkpointing=true
