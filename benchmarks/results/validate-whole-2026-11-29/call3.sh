# The CUDA executor tests again (torch's part of execute's peak over two steps and six); then
# LTX-2 whole (48 blocks, 37.75 GB) validated on the H200 from call 2's recording.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/v; mkdir -p $T
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_executor_cuda.py 2>&1 | grep -E "assert|Error|passed|failed" | tail -8
W=/dev/shm/ltx.ptd
SECONDS=0
timeout 100 python3 -m engine +model=ltx mode=materialize out=$W hydra.run.dir=$T/mat-ltx > $T/mat-ltx.log 2>&1; echo "materialize ltx rc=$? ${SECONDS}s"
SECONDS=0
timeout 330 python3 -m engine +model=ltx hardware=h200 weights.file=$W mode=validate \
  trace=data/traces/h200/validate/ltx2-full.jsonl.gz hydra.run.dir=$T/validate-ltx > $T/validate-ltx.log 2>&1
echo "validate ltx rc=$? ${SECONDS}s"
cp $T/validate-ltx/measurements.json $T/ltx2-full.measurements.json 2>/dev/null
rm -rf /dev/shm/*
tar czf $OUT/runs.tgz -C $T .
grep -E "^\||^- " $T/validate-ltx.log | tail -30
