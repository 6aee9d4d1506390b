# After the buffer fix: SD3.5 Large again (real_models.py; its LoRA step replayed from call 1's
# recording), then Qwen2.5-14B LoRA rank 32 at 4096 tokens, checkpointed, at 16000 (records first).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/nm; mkdir -p $T
R=benchmarks/results/new-models-2026-11-28
tar xzf $R/call1.tgz -C $T ./sd35-train/trace.jsonl && mv $T/sd35-train/trace.jsonl $T/sd35-train-call1.jsonl
timeout 200 python3 benchmarks/real_models.py --models sd35_large --budgets 0,12000,8000,4000 --evictions priority \
  --lookahead 2 --hardware h200 --keep --dir /dev/shm --out $T/sd35 > $T/sd35.log 2>&1; echo "real_models rc=$?"
grep -v "materialize" $T/sd35.log | grep -E "^\[|^\|" | tail -7
timeout 150 python3 -m engine model=sd35_large_diffusers workload=train_lora workload.video_tokens=4096 \
  workload.text_tokens=333 workload.checkpointing=true workload.steps=4 activations=off budget=8000 hardware=h200 \
  trace=$T/sd35-train-call1.jsonl mode=execute weights.file=/dev/shm/sd35_large.safetensors \
  hydra.run.dir=$T/sd35-train > $T/sd35-train.log 2>&1
echo "sd35 train rc=$?"; grep -E "^\| (step|H2D|peak)|^predicted|^against|^error" $T/sd35-train.log | head -8
rm -f /dev/shm/*
timeout 60 python3 -m engine model=qwen25_14b_hf mode=materialize out=/dev/shm/qwen.safetensors \
  hydra.run.dir=$T/qmat > /dev/null 2>&1; echo "qwen materialize rc=$?"
timeout 240 python3 -m engine model=qwen25_14b_hf workload=train_lora workload.text_tokens=4096 \
  workload.checkpointing=true workload.steps=4 activations=off budget=16000 hardware=h200 mode=execute \
  weights.file=/dev/shm/qwen.safetensors hydra.run.dir=$T/qwen-train > $T/qwen-train.log 2>&1
echo "qwen train rc=$?"; grep -E "^\| (step|H2D|peak)|^predicted|^against|^error" $T/qwen-train.log | head -8
rm -f /dev/shm/*
tar czf $OUT/nm3.tgz -C $T .
