# The tiles probe again (lease F), with 32768 tokens too: an aligned length as long as call 6's
# 32760, where only lengths off the tile had been probed.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 300 python3 -m engine.measure.compute --only attention_tiles --out $OUT/tiles-f.json; echo "probe rc=$?"
