# As run on the lent H100 (OUT: the device tool's output folder).
M="model=wan14b_diffusers"
W="workload=train_lora workload.video_tokens=6144 workload.text_tokens=512 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/wan-train.safetensors
T0=$(date +%s)
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
echo "materialized $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth/trace.jsonl"), "$M $W".split())
PY
echo "synthesized $(( $(date +%s) - T0 )) s"
python -m engine $M $W $P mode=execute trace=/tmp/synth/trace.jsonl weights.file=$CK budget=16000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -4
cp /tmp/x/report.json $OUT/wan-execute-report.json
echo "executed $(( $(date +%s) - T0 )) s"
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | tail -1
cp /tmp/rec/trace.jsonl $OUT/wan-train-record.jsonl; gzip $OUT/wan-train-record.jsonl
echo "recorded $(( $(date +%s) - T0 )) s"
rm -f $CK
