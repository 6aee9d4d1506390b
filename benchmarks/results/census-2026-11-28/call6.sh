# LTX-2 at 3072 video tokens on the H200, held out.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 500 python3 benchmarks/real_models.py --models ltx2 --budgets 0,16000 --workload video_tokens=3072 --evictions priority --lookahead 2 --hardware h200 --out $OUT/ltx2-3072 > $OUT/ltx2.log 2>&1; echo "ltx2 rc $?"
rm -f /dev/shm/*
grep -v "Warning\|warn\|materialize" $OUT/ltx2.log | tail -8
