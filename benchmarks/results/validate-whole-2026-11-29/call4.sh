# Llama-3.1-8B decode validated again from call 1's recording with the code as shipped (each
# batch's step after the host's wait left out); the spec Llama-3.1-8B prefill's process peak
# over 8 steps with execute's final accounting.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/v; mkdir -p $T
W=/dev/shm/llama8b.ptd
timeout 60 python3 -m engine +model=llama8b mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
SECONDS=0
timeout 150 python3 -m engine +model=llama8b workload=decode hardware=h200 weights.file=$W mode=validate \
  trace=data/traces/h200/validate/llama8b-decode.jsonl.gz hydra.run.dir=$T/validate-llama > $T/validate-llama.log 2>&1
echo "validate llama rc=$? ${SECONDS}s"
cp $T/validate-llama/measurements.json $T/llama8b-decode.measurements.json 2>/dev/null
timeout 90 python3 -m engine +model=llama8b hardware=h200 budget=8000 workload.steps=8 mode=execute weights.file=$W \
  hydra.run.dir=$T/prefill > $T/prefill.log 2>&1; echo "prefill execute rc=$?"
rm -rf /dev/shm/*
tar czf $OUT/runs.tgz -C $T .
grep -E "peak pool|bitwise" $T/prefill.log
grep -E "all resident|^- (fit|held)" $T/validate-llama.log
