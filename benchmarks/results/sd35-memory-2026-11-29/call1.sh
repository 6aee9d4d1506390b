# SD3.5 Large's plain forward: its device memory against the meta trace, every SDPA backend, cuDNN on and off.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
timeout 500 python benchmarks/results/sd35-memory-2026-11-29/sd35_memory.py 2>&1 | grep -v Warning | tee $OUT/sd35_memory.log
