# diffusers LTX-2 (48 blocks), peft LoRA rank 32 at 6144 tokens, checkpointed, at 16000 MB on the
# H200: executed beside the prediction synthesized on the meta device with hardware=h200.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/mt; mkdir -p $T
M="model=ltx2_diffusers"
W="workload=train_lora workload.checkpointing=true workload.steps=4"
CK=/dev/shm/ltx2-train.safetensors
T0=$(date +%s)
timeout 150 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=$T/mat 2>&1 | tail -1
echo "materialized $(( $(date +%s) - T0 )) s"; free -g | head -2
timeout 380 python3 -m engine $M $W weights.eviction=priority weights.lookahead=2 activations=off budget=16000 \
  hardware=h200 mode=execute weights.file=$CK hydra.run.dir=$T/exec 2>&1 | grep -v Warning | grep -E "^\| |rror" | head -30
echo "executed $(( $(date +%s) - T0 )) s"
rm -f /dev/shm/*
(cd $T && tar czf $OUT/ltx2-diffusers-train.tgz $(find . -name report.json -o -name report.md -o -name telemetry.jsonl))
ls -la $OUT
