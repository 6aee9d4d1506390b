# Mistral-7B's prefill peak and op times (llm_ops.py), then the masked attention probe with a
# decode's folded query rows (engine/measure/compute.py DECODE_Q).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 300 python3 benchmarks/results/llm-ops-2026-11-29/llm_ops.py $OUT 2>&1 | tr '\r' '\n' | grep -v "materialize\|Warning\|warn" | tail -40
echo "llm_ops rc ${PIPESTATUS[0]}"; rm -f /dev/shm/*
timeout 200 python3 -m engine.measure.compute --only attention_masked --out $OUT/probes-h200-2026-11-29-masked.json 2>&1 | tail -3
ls -la $OUT
