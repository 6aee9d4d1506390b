# Host-bound inference from its own recording, the recorder timing its all-resident and plain steps
# until their median is known: Llama-3.1-8B decode (all resident, 12000) and SD3.5 Large at 1024 tokens.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=$OUT
timeout 290 python3 benchmarks/real_models.py --models llama8b --budgets 0,12000 --evictions priority --lookahead 2 \
  --steps 16 --hardware h200 --dir /dev/shm --out $T/llama8b > $T/llama8b.log 2>&1; echo "llama8b rc=$?"
tr '\r' '\n' < $T/llama8b.log | grep -E "^\|" | tail -4
rm -f /dev/shm/*
timeout 230 python3 benchmarks/real_models.py --models sd35_large --budgets 0,8000 --workload video_tokens=1024 \
  --evictions priority --lookahead 2 --steps 16 --hardware h200 --dir /dev/shm --out $T/sd35-1024 > $T/sd35-1024.log 2>&1
echo "sd35-1024 rc=$?"
tr '\r' '\n' < $T/sd35-1024.log | grep -E "^\|" | tail -4
rm -f /dev/shm/*
