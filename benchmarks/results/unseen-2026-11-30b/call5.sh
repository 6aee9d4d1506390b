# HunyuanVideo 1.5 (12288 video + 256 text tokens), whose forward failed on the meta device until
# its mask gathers did (engine/modules/meta_values.py), predicted first (predictions-hv15.txt):
# all resident, 8000 and 4000 MB (benchmarks/real_models.py: synced, priority, lookahead 2).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 240 python3 benchmarks/real_models.py --models hunyuan_video15 --budgets 0,8000,4000 --evictions priority \
  --lookahead 2 --hardware h200 --out $OUT/hunyuan_video15 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" \
  > $OUT/hunyuan_video15.log
echo "rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
grep "^\[" $OUT/hunyuan_video15.log | tail -4 | cut -c1-330; grep "^|" $OUT/hunyuan_video15.log | tail -5 | cut -c1-300
