# The CUDA executor tests again (execute's kept outputs counted as the allocator holds them);
# Llama-3.1-8B decode validated again from call 1's recording (steps timed without stamps);
# then LTX-2 whole (48 blocks, 37.75 GB) recorded on the H200.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/v; mkdir -p $T
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_executor_cuda.py 2>&1 | tail -3
W=/dev/shm/llama8b.ptd
timeout 60 python3 -m engine +model=llama8b mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
SECONDS=0
timeout 120 python3 -m engine +model=llama8b workload=decode hardware=h200 weights.file=$W mode=validate \
  trace=data/traces/h200/validate/llama8b-decode.jsonl.gz hydra.run.dir=$T/validate-llama > $T/validate-llama.log 2>&1
echo "validate llama rc=$? ${SECONDS}s"
cp $T/validate-llama/measurements.json $T/llama8b-decode.measurements.json 2>/dev/null
grep -E "all resident|^- (fit|held)" $T/validate-llama.log
rm -rf /dev/shm/*
W=/dev/shm/ltx.ptd
SECONDS=0
timeout 100 python3 -m engine +model=ltx mode=materialize out=$W hydra.run.dir=$T/mat-ltx > $T/mat-ltx.log 2>&1; echo "materialize ltx rc=$? ${SECONDS}s"
SECONDS=0
timeout 380 python3 -m engine +model=ltx hardware=h200 weights.file=$W budget=16000 mode=record \
  hydra.run.dir=$T/record-ltx > $T/record-ltx.log 2>&1; echo "record ltx rc=$? ${SECONDS}s"
gzip -9 -c $T/record-ltx/trace.jsonl > $T/ltx2-full.jsonl.gz
rm -rf /dev/shm/*
tar czf $OUT/runs.tgz -C $T --exclude='trace.jsonl' .
grep -E "step \(GPU|launches|beside" $T/record-ltx.log
