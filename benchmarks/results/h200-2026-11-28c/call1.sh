# The host timed on a held stream: spec Llama decode's host pace three ways, then FLUX.1-dev
# recorded whole with the new recorder (and run all resident and at 16000), then Llama decode
# all resident, all on one lease.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
nvidia-smi --query-gpu=name,memory.total,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv > $OUT/gpu.txt
timeout 120 python3 benchmarks/host_pace.py --model llama8b --workload decode --rounds 6 2>&1 | grep -v Warning > $OUT/host_pace_llama8b.txt
tail -9 $OUT/host_pace_llama8b.txt
rm -f /dev/shm/*
timeout 300 python3 benchmarks/full_models.py --models flux --budgets flux=null,16000 --evictions priority \
  --out $OUT/flux 2>&1 | grep -v Warning | tail -6
rm -f /dev/shm/*
timeout 120 python3 benchmarks/full_models.py --models llama8b --budgets llama8b=null --evictions priority --no-record \
  --steps 8 --out $OUT/llama 2>&1 | grep -v Warning | tail -4
rm -f /dev/shm/*
find $OUT -name "*.jsonl" -delete
ls -la $OUT $OUT/flux
