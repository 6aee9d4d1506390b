# Qwen-Image (4096 + 256 tokens) on the H200, held out; then pytest -m cuda.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 300 python3 benchmarks/real_models.py --models qwen_image --budgets 0,16000 --evictions priority --lookahead 2 --hardware h200 --out $OUT/qwen-image > $OUT/qwen-image.log 2>&1; echo "qwen-image rc $?"
rm -f /dev/shm/*
timeout 200 python3 -m pytest -m cuda -q -x -p no:cacheprovider tests 2>&1 | tail -4
grep -v "Warning\|warn\|materialize" $OUT/qwen-image.log | tail -8
