# The linear grid probed again with its timed calls queued behind a spin kernel (the probe's
# small points had run at the host's launch pace); each op of two LTX-2 and HunyuanVideo blocks at
# 12288 tokens timed in the model (census_ops.py) to set beside them.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
T0=$(date +%s)
timeout 330 python3 -m engine.measure.compute --only linear --out $OUT/probes-h200-linear.json; echo "probe rc $? in $(( $(date +%s) - T0 )) s"
timeout 150 python3 benchmarks/census_ops.py --cases ltx2:12288:256,hunyuan:12288:256,ltx2:6144:256 --out $OUT/ops-long.json; echo "census rc $? in $(( $(date +%s) - T0 )) s"
gzip $OUT/ops-long.json
