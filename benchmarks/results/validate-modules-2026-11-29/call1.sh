#!/bin/bash
# mode=validate on real modules (H200): each model's grid measured once, predicted from its
# config alone (no trace=); the report from a recording is rebuilt on a CPU with measurements=.
# Usage: bash call1.sh OUT MODEL[:OVERRIDES] ...   (weights in /dev/shm, deleted after)
set -u
OUT=$1; shift
for spec in "$@"; do
  model=${spec%%:*}; extra=${spec#*:}; [ "$extra" = "$spec" ] && extra=""
  extra=${extra//,/ }
  w=/dev/shm/$model.safetensors
  t0=$(date +%s)
  python -m engine model=$model mode=materialize out=$w hydra.run.dir=$OUT/$model/mat > $OUT/$model.mat.log 2>&1
  t1=$(date +%s)
  python -m engine model=$model hardware=h200 mode=validate weights.file=$w $extra \
      hydra.run.dir=$OUT/$model/validate > $OUT/$model.validate.log 2>&1
  echo "$model validate rc=$? materialize $((t1 - t0)) s, validate $(( $(date +%s) - t1 )) s"
  grep -E "^- (fit|held)|NOT preserved" $OUT/$model.validate.log
  rm -f $w
done
