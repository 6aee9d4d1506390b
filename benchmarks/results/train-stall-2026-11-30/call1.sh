#!/bin/bash
# A streamed LoRA step's stall timed (validation's stamped_stall_ms): the GPU tests, then
# Llama-3.1-8B's (transformers) LoRA grid from its config; then FLUX.1-dev's two block kinds'
# kernels in a LoRA step (flux-lora-ops-2026-11-30/profile_blocks.py).
set -u
OUT=$1
timeout 150 python -m pytest -q -p no:cacheprovider -m cuda tests/test_validation_cuda.py -k training > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda -k training rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
timeout 100 python benchmarks/results/flux-lora-ops-2026-11-30/profile_blocks.py $OUT > $OUT/flux-ops.log 2>&1
echo "flux profile rc=$?"; grep -E "^== " $OUT/flux-ops.log
timeout 330 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    llama8b_hf:workload=train_lora,workload.text_tokens=2048,workload.checkpointing=true
grep -E "measured train" $OUT/llama8b_hf.validate.log
cp $OUT/llama8b_hf/validate/measurements.json $OUT/llama-measurements.json
rm -rf $OUT/llama8b_hf
