# The tiles probe again (lease E), its lengths now up to 32760 tokens (call 5's Wan 14B at 32760
# was priced from lengths up to 12000 off the tile).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 300 python3 -m engine.measure.compute --only attention_tiles --out $OUT/tiles-e.json; echo "probe rc=$?"
