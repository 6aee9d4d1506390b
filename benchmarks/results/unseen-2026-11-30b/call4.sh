# Attention at 256-wide heads (Gemma's), which the compute probe's grid (64, 128) lacked: every
# attention part's grid at 256 (python -m engine.measure.compute --head-dims 256), and Gemma 3's
# LoRA step op by op (profile_gemma3.py).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
T0=$(date +%s)
timeout 150 python3 benchmarks/results/unseen-2026-11-30b/profile_gemma3.py > $OUT/profile_gemma3.txt 2>&1
echo "profile rc $? $(( $(date +%s) - T0 )) s"; grep -v "^\s*$" $OUT/profile_gemma3.txt | head -32 | cut -c1-200
timeout 400 python3 -m engine.measure.compute --head-dims 256 --out $OUT/probes-h200-2026-11-30-head256.json
echo "probe rc $? $(( $(date +%s) - T0 )) s"
