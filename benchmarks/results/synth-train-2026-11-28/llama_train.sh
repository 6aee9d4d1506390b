# As run on the lent H100 (OUT: the device tool's output folder).
M="model=llama8b_hf"
W="workload=train_lora workload.text_tokens=2048 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/llama-train.safetensors
T0=$(date +%s)
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
echo "materialized $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth/trace.jsonl"), "$M $W".split())
PY
python -m engine $M $W $P mode=execute trace=/tmp/synth/trace.jsonl weights.file=$CK budget=8000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -3
cp /tmp/x/report.json $OUT/llama-execute-report.json
echo "executed $(( $(date +%s) - T0 )) s"
rm -f $CK
