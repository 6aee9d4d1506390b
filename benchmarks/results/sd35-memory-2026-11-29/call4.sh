# pytest -m cuda on the final code (the buffer copies' device memory among them).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
timeout 560 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -8
