# After the telemetry fix: Llama-3.1-8B decode at 12000, whose first step holds the most (its older H200 row
# ran 16 timed steps and reported the steady pool).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=$OUT
timeout 280 python3 benchmarks/real_models.py --models llama8b --budgets 12000 --evictions priority --lookahead 2 \
  --steps 16 --hardware h200 --dir /dev/shm --out $T/llama8b-12000 > $T/llama8b-12000.log 2>&1; echo "rc=$?"
tr '\r' '\n' < $T/llama8b-12000.log | grep "process peak" | sed 's/.*\] //'
rm -f /dev/shm/*
