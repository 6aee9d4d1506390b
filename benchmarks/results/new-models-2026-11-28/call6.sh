# After untouched's baseline moved into set-up (Baseline.take_buffers): the GPU tests again.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1; export PYTHONPATH=$PWD/.site:$PWD
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_modules.py -k "checkpoint_buffers or record" 2>&1 | tail -1
