# Held out on the H200, predicted first (predictions.txt): Mochi 1 (6144 video + 256 text tokens) and
# AuraFlow (4096 image + 256 text tokens), never run here before, each recorded and measured.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader
run() {  # name model budgets timeout
  timeout $4 python3 benchmarks/real_models.py --models $2 --budgets $3 --evictions priority \
    --lookahead 2 --hardware h200 --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run ${1:-mochi} ${1:-mochi} ${2:-0,8000,3000} ${3:-330}
run ${4:-auraflow} ${4:-auraflow} ${5:-0,8000,4000} ${6:-220}
for f in $OUT/*.log; do grep "^\[" $f | tail -5; done
