# The GPU tests on the session's final code.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -4
