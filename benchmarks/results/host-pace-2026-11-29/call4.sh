# The GPU tests on this session's code, then a second lease's Llama-3.1-8B LoRA rows (plain steps with GC paused).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
T0=$(date +%s)
timeout 330 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -4
echo "pytest $(( $(date +%s) - T0 )) s"
bash benchmarks/results/train-h200-2026-11-29/train.sh llama 2>&1 | grep -v "^total\|^d\|^-"
