# Causal attention against full (causal_check.py), then Llama-3.1-8B's 4096-token prefill,
# predicted before (predictions.txt), recorded and measured at all resident, 8000 and 4000.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 150 python3 benchmarks/results/llm-ops-2026-11-29/causal_check.py 2>&1 | tail -12
run() {  # name model budgets timeout [steps]
  timeout $4 python3 benchmarks/real_models.py --models $2 --budgets $3 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${5:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run llama8b_prefill llama8b_prefill 0,8000,4000 240
for f in $OUT/*.log; do grep "^\[" $f | grep -v "wrote" | tail -5; done
