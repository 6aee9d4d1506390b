# The CUDA tests on the final code (spec execute's runs moved to engine/modes/spec_run.py).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
timeout 330 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
rm -rf /dev/shm/*
