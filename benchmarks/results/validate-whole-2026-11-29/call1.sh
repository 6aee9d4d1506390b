# The CUDA executor tests (execute's peak leaves out the outputs it keeps); the spec Llama-3.1-8B
# prefill's process peak over 8 steps; then Llama-3.1-8B whole, decode, recorded and validated on
# the H200 (the grid up to every weight resident, each row timed until its median is known).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/v; mkdir -p $T
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_executor_cuda.py 2>&1 | tail -3
W=/dev/shm/llama8b.ptd
timeout 90 python3 -m engine +model=llama8b mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
timeout 120 python3 -m engine +model=llama8b hardware=h200 budget=8000 workload.steps=8 mode=execute weights.file=$W \
  hydra.run.dir=$T/prefill > $T/prefill.log 2>&1; echo "prefill execute rc=$?"
grep -E "step time|peak|bitwise|outputs" $T/prefill.log | head -12
L="+model=llama8b workload=decode hardware=h200 weights.file=$W"
SECONDS=0
timeout 240 python3 -m engine $L budget=8000 mode=record hydra.run.dir=$T/record > $T/record.log 2>&1; echo "record rc=$? ${SECONDS}s"
gzip -9 -c $T/record/trace.jsonl > $T/llama8b-decode.jsonl.gz
SECONDS=0
timeout 300 python3 -m engine $L mode=validate trace=$T/llama8b-decode.jsonl.gz hydra.run.dir=$T/validate > $T/validate.log 2>&1
echo "validate rc=$? ${SECONDS}s"
cp $T/validate/measurements.json $T/llama8b-decode.measurements.json 2>/dev/null
rm -rf /dev/shm/*
tar czf $OUT/runs.tgz -C $T --exclude='*.jsonl' --exclude='trace.jsonl' .
grep -E "^\|" $T/validate.log | head -24; grep -E "^- " $T/validate.log
