# LTX-2 from diffusers and Llama-3.1-8B decode from transformers, recorded and measured on the H200.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
R=/tmp/rm3; mkdir -p $R/ltx2 $R/llama
timeout 280 python3 benchmarks/real_models.py --models ltx2 --budgets 0,16000,8000 --evictions priority --lookahead 2 \
  --steps 6 --hardware h200 --out $R/ltx2 2>&1 | grep -v Warning | grep "@\|resident\|recorded" | tail -6
rm -f /dev/shm/*
timeout 200 python3 benchmarks/real_models.py --models llama8b --budgets 0,4000,12000 --evictions priority --lookahead 2 \
  --steps 16 --hardware h200 --out $R/llama 2>&1 | grep -v Warning | grep "@\|resident\|recorded" | tail -6
rm -f /dev/shm/*
(cd $R && tar czf $OUT/real3.tgz $(find . -type f))
ls -la $OUT
