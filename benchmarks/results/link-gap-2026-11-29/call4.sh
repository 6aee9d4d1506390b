#!/bin/bash
# FLUX.1-dev's validate grid from its config alone, on the CUDA pool (its rows now say where the pool
# released its reserve) and on the vmm backend; weights in /dev/shm, deleted after. (Call 4 ran it and
# failed at the first row's stall: the shared timing loop read CUDA events in flight. Call 5, after
# the fix: the GPU tests of validate's measuring first, then this.)
set -u
OUT=$1
timeout 240 python -m pytest -q -p no:cacheprovider -m cuda tests/test_validation_cuda.py 2>&1 | tail -3
w=/dev/shm/flux_diffusers.safetensors
python -m engine model=flux_diffusers mode=materialize out=$w hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1 || tail -5 $OUT/mat.log
for backend in cuda vmm; do
  SECONDS=0
  python -m engine model=flux_diffusers hardware=h200 mode=validate weights.file=$w weights.backend=$backend \
    workload.video_tokens=4096 workload.text_tokens=512 hydra.run.dir=$OUT/validate-$backend > $OUT/validate-$backend.log 2>&1
  echo "$backend validate rc=$? ${SECONDS}s"
  cp $OUT/validate-$backend/measurements.json $OUT/flux-$backend.measurements.json
  grep -E "^\| |^- (fit|held)|^†|link" $OUT/validate-$backend.log | grep -v "^| ---"
done
rm -f $w
