# validate's final code end to end on the GPU: the 8-layer Llama-3.1-8B decode grid (19 rows,
# rows that would not fit skipped: none here) from the shipped H100 recording, on the H200.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/v6; rm -rf $T; mkdir -p $T
L="+model=llama8b model.num_layers=8 workload=decode"
timeout 60 python3 -m engine $L mode=materialize out=/dev/shm/l8.ptd hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
SECONDS=0
cp data/traces/llama_decode.jsonl.gz $T/  # away from its shipped measurements, which validate would read
timeout 150 python3 -m engine $L weights.file=/dev/shm/l8.ptd mode=validate trace=$T/llama_decode.jsonl.gz \
  hydra.run.dir=$T/validate > $T/validate.log 2>&1; echo "validate rc=$? ${SECONDS}s"
rm -rf /dev/shm/*
cp $T/validate.log $T/validate/report.md $T/validate/measurements.json $OUT/ 2>/dev/null
grep -E "skipped|all resident|^- (fit|held)|NOT" $T/validate.log | head -12
