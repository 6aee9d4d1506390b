# Qwen2.5-14B's 4096-token prefill (causal attention, 40 heads), predicted before
# (predictions-qwen.txt), recorded and measured at all resident, 16000 and 8000.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
run() {  # name model budgets timeout [steps]
  timeout $4 python3 benchmarks/real_models.py --models $2 --budgets $3 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${5:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run qwen25_14b_prefill qwen25_14b_prefill 0,16000,8000 330
for f in $OUT/*.log; do grep "^\[" $f | grep -v "wrote" | tail -5; done
