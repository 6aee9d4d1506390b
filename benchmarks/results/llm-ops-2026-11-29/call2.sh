# real_models.py with the harness holding nothing on the device (its recordings' and rows' torch
# peaks the module's): Mistral-7B prefill and decode; then what a full mask costs SDPA (mask_cost.py).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
run() {  # name model budgets timeout [steps]
  timeout $4 python3 benchmarks/real_models.py --models $2 --budgets $3 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${5:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run mistral7b_prefill mistral7b_prefill 0,8000 170
run mistral7b mistral7b 8000,4000 170 16
timeout 120 python3 benchmarks/results/llm-ops-2026-11-29/mask_cost.py 2>&1 | tail -14
for f in $OUT/*.log; do grep "^\[" $f | grep -v "wrote\|eviction=auto" | tail -4; done
