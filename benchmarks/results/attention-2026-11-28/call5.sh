# Wan 14B (diffusers) at a video length users run, 32760 tokens (off the tile; 8 x 63 x 65 latent
# patches) + 512 text tokens, held out: recorded, measured all resident and at 16000.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/at5; mkdir -p $T
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
free -g | head -2
timeout 500 python3 benchmarks/real_models.py --models wan14b --workload video_tokens=32760 --budgets 0,16000 \
  --evictions priority --lookahead 2 --hardware h200 --warmup 1 --steps 4 --dir /dev/shm --out $T/wan-32760 > $T/wan.log 2>&1
echo "real_models rc=$?"; tail -6 $T/wan.log
rm -f /dev/shm/*
tar czf $OUT/call5.tgz -C $T .
