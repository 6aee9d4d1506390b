# The diffusers LTX-2 LoRA step recorded on the H200 (as call 4's execute recorded it first), its
# trace kept this time.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/mt; mkdir -p $T
M="model=ltx2_diffusers"
W="workload=train_lora workload.checkpointing=true workload.steps=4"
CK=/dev/shm/ltx2-train.safetensors
T0=$(date +%s)
timeout 100 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=$T/mat 2>&1 | tail -1
echo "materialized $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m engine $M $W weights.eviction=priority weights.lookahead=2 activations=off budget=16000 \
  hardware=h200 mode=record weights.file=$CK hydra.run.dir=$T/rec 2>&1 | grep -v Warning | tail -4
echo "recorded $(( $(date +%s) - T0 )) s"
rm -f /dev/shm/*
gzip -c $T/rec/trace.jsonl > $OUT/ltx2-diffusers-train-record.jsonl.gz
(cd $T && tar czf $OUT/rec.tgz $(find rec -name report.json -o -name report.md -o -name engine.log))
ls -la $OUT
