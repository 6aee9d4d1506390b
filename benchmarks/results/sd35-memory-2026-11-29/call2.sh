# SD3.5 Large with set-up's buffer copies on the host and the buffers counted: 4096 and 1024 image tokens.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=$OUT
timeout 280 python3 benchmarks/real_models.py --models sd35_large --budgets 0,12000,8000,4000 --evictions priority \
  --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35 > $T/sd35.log 2>&1; echo "4096 rc=$?"
timeout 230 python3 benchmarks/real_models.py --models sd35_large --budgets 0,8000 --workload video_tokens=1024 \
  --evictions priority --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35-1024 > $T/sd35-1024.log 2>&1
echo "1024 rc=$?"
for f in $T/sd35.log $T/sd35-1024.log; do tr '\r' '\n' < $f | grep -v materialize | grep -E "^\[|^\||peak" | tail -8; done
ls -la /dev/shm; rm -f /dev/shm/*
