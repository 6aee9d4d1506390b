# Attention at lengths off the 128-token tile (call 1's probe ran past its timeout: cuDNN builds a
# plan for each new shape, which the probe's rest counted; now the first call is left out of it).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
T=/tmp/at; mkdir -p $T
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 500 python3 benchmarks/attention_lengths.py --out $T/attention_lengths.json --seconds 380; echo "probe rc=$?"
cp $T/attention_lengths.json $OUT/
