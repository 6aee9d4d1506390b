# Held out on the H200, predicted first (predictions.txt): HunyuanVideo at 12288 video tokens and
# LTX-2 at 12288 video tokens, each recorded and measured all resident and streamed.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader
run() {  # name model budgets tokens
  timeout $5 python3 benchmarks/real_models.py --models $2 --budgets $3 --workload video_tokens=$4 --evictions priority \
    --lookahead 2 --hardware h200 --out $OUT/$1 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" > $OUT/$1.log
  echo "$1 rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
}
run hv-12288 hunyuan_video 0,12000 12288 270
run ltx2-12288 ltx2 0,16000 12288 290
for f in $OUT/*.log; do grep "^\[" $f | tail -4; done
