# HunyuanVideo (6144 + 256 tokens) and SD3.5 Large (1024 + 333) on the H200, held out.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 280 python3 benchmarks/real_models.py --models hunyuan_video --budgets 0,12000 --evictions priority --lookahead 2 --hardware h200 --out $OUT/hv > $OUT/hv.log 2>&1; echo "hv rc $?"
rm -f /dev/shm/*
timeout 220 python3 benchmarks/real_models.py --models sd35_large --budgets 0,8000 --workload video_tokens=1024 --evictions priority --lookahead 2 --hardware h200 --out $OUT/sd35-1024 > $OUT/sd35.log 2>&1; echo "sd35 rc $?"
rm -f /dev/shm/*
tail -12 $OUT/hv.log; tail -10 $OUT/sd35.log
