# Attention at lengths off the 128-token tile (probe file), then SD3.5 Large at 9216 image
# tokens + 333 text tokens (9549, unaligned) measured all resident and at 12000 / 6000.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/at; mkdir -p $T
nvidia-smi --query-gpu=name,temperature.gpu,power.limit,clocks.max.sm --format=csv,noheader
timeout 280 python3 benchmarks/attention_lengths.py --out $T/attention_lengths.json; echo "probe rc=$?"
timeout 270 python3 benchmarks/real_models.py --models sd35_large --workload video_tokens=9216 --budgets 0,12000,6000 \
  --evictions priority --lookahead 2 --hardware h200 --dir /dev/shm --out $T/sd35-9216 > $T/sd35.log 2>&1
echo "real_models rc=$?"; tail -14 $T/sd35.log
rm -f /dev/shm/*
tar czf $OUT/call1.tgz -C $T .
