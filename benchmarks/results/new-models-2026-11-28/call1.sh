# Stable Diffusion 3.5 Large (diffusers, never run on a GPU here before): recorded, measured at
# all resident, 12000, 8000, 4000 (synced loops), then a LoRA step at 8000 through the CLI.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/nm; mkdir -p $T
nvidia-smi --query-gpu=name,temperature.gpu,power.limit --format=csv,noheader
timeout 320 python3 benchmarks/real_models.py --models sd35_large --budgets 0,12000,8000,4000 --evictions priority \
  --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35 > $T/sd35.log 2>&1; echo "real_models rc=$?"
tail -22 $T/sd35.log
timeout 220 python3 -m engine model=sd35_large_diffusers workload=train_lora workload.video_tokens=4096 \
  workload.text_tokens=333 workload.checkpointing=true workload.steps=4 activations=off budget=8000 hardware=h200 \
  mode=execute weights.file=/dev/shm/sd35_large.safetensors hydra.run.dir=$T/sd35-train > $T/sd35-train.log 2>&1
echo "train rc=$?"; grep -E "^\| (step|H2D|peak)|^predicted|^against|^error" $T/sd35-train.log | head -20
rm -f /dev/shm/*
tar czf $OUT/nm1.tgz -C $T .
