# After the telemetry fix: SD3.5 at 12000 (4096 and 9216 image tokens), where the first step holds the most.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=$OUT
timeout 200 python3 benchmarks/real_models.py --models sd35_large --budgets 12000 --evictions priority \
  --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35-12000 > $T/sd35-12000.log 2>&1; echo "4096 rc=$?"
timeout 200 python3 benchmarks/real_models.py --models sd35_large --workload video_tokens=9216 --budgets 12000 \
  --evictions priority --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35-9216-12000 > $T/sd35-9216-12000.log 2>&1
echo "9216 rc=$?"
for f in $T/sd35-12000.log $T/sd35-9216-12000.log; do tr '\r' '\n' < $f | grep "process peak" | grep "12000" | sed 's/.*\] //'; done
rm -f /dev/shm/*
