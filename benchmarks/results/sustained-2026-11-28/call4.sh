# FLUX.1-dev's sag at 4096 and 16384 tokens on one lease (sag.py).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 170 python3 benchmarks/results/sustained-2026-11-28/sag.py 2>&1 | grep -v "Warn\|warn\|materialize"
rm -f /dev/shm/*
