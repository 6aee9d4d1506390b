# The recorder timing a host-bound module's steps in turns with the plain module's: the GPU tests, a
# Llama-3.1-8B LoRA step through mode=execute, SD3.5 Large at 1024 tokens through real_models.py.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -1
LIMIT=260 bash benchmarks/results/plain-ref-2026-11-29/call.sh llama:8000:8 2>&1 | grep -v "^NVIDIA"
mkdir -p $OUT/c5 && tar xzf $OUT/runs.tgz -C $OUT/c5 && rm $OUT/runs.tgz
timeout 150 python3 benchmarks/real_models.py --models sd35_large --budgets 0,8000 --workload video_tokens=1024 \
  --evictions priority --lookahead 2 --steps 16 --hardware h200 --dir /dev/shm --out $OUT/sd35-1024 > $OUT/sd35-1024.log 2>&1
echo "sd35-1024 rc=$?"
tr '\r' '\n' < $OUT/sd35-1024.log | grep -E "^\|" | tail -3
rm -f /dev/shm/*
