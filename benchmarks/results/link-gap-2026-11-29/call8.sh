#!/bin/bash
# Llama-3.1-8B (transformers), 2048-token prefill, the validate grid from its config alone on the
# vmm backend (its embedding and head are 2.4x its layers' size); weights in /dev/shm, deleted after.
set -u
OUT=$1
w=/dev/shm/llama8b_hf.safetensors
timeout 90 python -m engine model=llama8b_hf mode=materialize out=$w hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1 || tail -5 $OUT/mat.log
SECONDS=0
timeout 200 python -m engine model=llama8b_hf hardware=h200 mode=validate weights.file=$w weights.backend=vmm \
  workload.text_tokens=2048 hydra.run.dir=$OUT/validate > $OUT/validate.log 2>&1
echo "validate rc=$? ${SECONDS}s"
cp $OUT/validate/measurements.json $OUT/llama8b-hf-prefill-vmm.measurements.json
grep -E "^\| |^- (fit|held|ranking)|^†|link" $OUT/validate.log | grep -v "^| ---"
rm -f $w
