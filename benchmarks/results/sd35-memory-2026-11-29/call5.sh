# The executor's first step on the device, SD3.5 at 12000 (4096 tokens): its telemetry against the policy's own.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
timeout 100 python3 -m engine model=sd35_large_diffusers mode=materialize out=/dev/shm/sd35.safetensors hydra.run.dir=/tmp/mat > /dev/null 2>&1
timeout 300 python3 benchmarks/results/sd35-memory-2026-11-29/first_step.py /dev/shm/sd35.safetensors \
  benchmarks/results/sd35-memory-2026-11-29/runs/sd35/sd35_large.trace.jsonl.gz 2>&1 | grep -v Warn | tail -6
rm -f /dev/shm/*
