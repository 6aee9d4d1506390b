# The linear grid probed a third time: timed calls queued behind a spin kernel, and each call
# reading the next of enough weight copies to outgrow the L2 cache twice (call 1's probe read one
# weight over and over: small weights stayed in L2 and ran 20-40% under their time in a model).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
T0=$(date +%s)
timeout 330 python3 -m engine.measure.compute --only linear --out $OUT/probes-h200-linear-cold.json; echo "probe rc $? in $(( $(date +%s) - T0 )) s"
