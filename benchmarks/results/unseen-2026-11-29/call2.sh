# Held out on the H200, predicted first (predictions.txt): Mistral-7B decode over a 4096-token KV
# cache and its 4096-token prefill, never run here before, each recorded and measured; then the GPU tests.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
run() {  # name model budgets timeout [steps]
  timeout $4 python3 benchmarks/real_models.py --models $2 --budgets $3 --evictions priority \
    --lookahead 2 --hardware h200 --steps ${5:-5} --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run mistral7b mistral7b 0,8000,4000 200 16
run mistral7b_prefill mistral7b_prefill 0,8000 160
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
for f in $OUT/*.log; do grep "^\[" $f | tail -4; done
