#!/bin/bash
# The spec Llama-3.1-8B decode's validate grid again (from the config alone), now that rows say where
# the CUDA pool released its reserve; then every CUDA test.
set -u
OUT=$1
W=/dev/shm/llama8b.ptd
timeout 90 python -m engine +model=llama8b mode=materialize out=$W hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1; echo "materialize rc=$?"
SECONDS=0
timeout 300 python -m engine +model=llama8b workload=decode hardware=h200 mode=validate weights.file=$W \
  hydra.run.dir=$OUT/validate > $OUT/validate.log 2>&1
echo "validate rc=$? ${SECONDS}s"
cp $OUT/validate/measurements.json $OUT/llama8b-decode.measurements.json
grep -E "^\| |^- (fit|held)|^†|link" $OUT/validate.log | grep -v "^| ---"
rm -f $W
SECONDS=0
timeout 400 python -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tail -4
echo "pytest ${SECONDS}s"
