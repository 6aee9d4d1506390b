# SD3.5 Large at 9216 image tokens as call 2 ran the others, then its LoRA step (rank 32, checkpointed)
# at 8000 through the CLI, predicted without a recording (synthesized on the meta device).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=$OUT
timeout 270 python3 benchmarks/real_models.py --models sd35_large --workload video_tokens=9216 --budgets 0,12000,6000 \
  --evictions priority --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35-9216 > $T/sd35-9216.log 2>&1
echo "9216 rc=$?"; tr '\r' '\n' < $T/sd35-9216.log | grep -v materialize | grep -E "^\[|peak" | tail -4
timeout 250 python3 -m engine model=sd35_large_diffusers workload=train_lora workload.video_tokens=4096 \
  workload.text_tokens=333 workload.checkpointing=true workload.steps=4 activations=off budget=8000 hardware=h200 \
  mode=execute weights.file=/dev/shm/sd35_large.safetensors hydra.run.dir=$T/sd35-train > $T/sd35-train.log 2>&1
echo "train rc=$?"; grep -E "^\| (step|H2D|peak)|^predicted|^against|^error" $T/sd35-train.log | head -12
rm -f /dev/shm/*
