# The GPU tests after the session's last change (attention tiles up to 32768 tokens, calibrate's sms check) (pytest -m cuda).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tail -8
