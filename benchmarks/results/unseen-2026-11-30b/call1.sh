# Tuning by simulation from the config alone (predictions.txt, written first): HunyuanImage 2.1,
# never run here before, at 12000 MB, every grouping x eviction x lookahead (18 candidates), each
# measured synced and free-running (benchmarks/real_models.py records each grouping too).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader; free -g | head -2
timeout 570 python3 benchmarks/real_models.py --models hunyuan_image --budgets 12000 --groupings block,leaf \
  --evictions priority,belady,lru --lookahead 1,2,3 --steps 5 --warmup 2 --hardware h200 --out $OUT/tune \
  2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/tune.log
echo "tune rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
grep "^\[" $OUT/tune.log | tail -3; grep "^|" $OUT/tune.log | tail -22 | cut -c1-260
