# Held out on the H200, predicted first (predictions.txt): FLUX.2 [dev] (4096 + 512 tokens) and
# Z-Image (4096 + 256), never run here before, each recorded and measured (benchmarks/real_models.py).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader; free -g | head -2
run() {  # name budgets timeout
  timeout $3 python3 benchmarks/real_models.py --models $1 --budgets $2 --evictions priority \
    --lookahead 2 --hardware h200 --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run zimage 0,6000,3000 150
run flux2 0,24000,12000 400
for f in $OUT/*.log; do echo "== $f"; grep "^\[" $f | tail -4; grep "^|" $f | tail -8; done
