# Held out on the H200, predicted first (predictions.txt): Wan 14B at 12288 video tokens and
# FLUX.1-dev at 16384 image tokens, each recorded and measured all resident and streamed.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader
run() {  # name model budgets tokens
  timeout $5 python3 benchmarks/real_models.py --models $2 --budgets $3 --workload video_tokens=$4 --evictions priority \
    --lookahead 2 --hardware h200 --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run wan-12288 wan14b 0,16000 12288 280
run flux-16384 flux 0,12000 16384 270
for f in $OUT/*.log; do grep "^\[" $f | tail -4; done
