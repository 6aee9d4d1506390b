# Held out, predicted first (predictions.txt): HunyuanImage 2.1 (4096 + 256 tokens) all resident and
# at 24000 MB; Gemma 3 12B's prefill of 4096 tokens and its decode over a 4096-token KV cache
# (benchmarks/real_models.py: synced, priority, lookahead 2).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
run() {  # name budgets timeout [steps]
  timeout $3 python3 benchmarks/real_models.py --models $1 --budgets $2 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${4:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run hunyuan_image 0,24000 200
run gemma3_12b_prefill 0,12000,6000 150
run gemma3_12b 0,8000,4000 150 16
for f in $OUT/*.log; do echo "== $f"; grep "^\[" $f | tail -3; grep "^|" $f | tail -5 | cut -c1-300; done
