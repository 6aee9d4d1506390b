# As run on the lent H100s (OUT: the device tool's output folder), from the repository root.
# GPU tests, then Llama-3.1-8B LoRA at 8000 executed twice more against each trace (synthesized, recorded).
T0=$(date +%s)
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python -c "import pytest, hypothesis" 2>/dev/null || echo "no pytest/hypothesis on the device"
timeout 280 python -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -6
echo "tests $(( $(date +%s) - T0 )) s"
M="model=llama8b_hf"
W="workload=train_lora workload.text_tokens=2048 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/llama-train.safetensors
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth/trace.jsonl"), "$M $W".split())
PY
cp data/traces/modules/llama8b-hf-train.jsonl.gz /tmp/rec.jsonl.gz
for i in 1 2; do for T in /tmp/synth/trace.jsonl /tmp/rec.jsonl.gz; do
  python -m engine $M $W $P mode=execute trace=$T weights.file=$CK budget=8000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -1 > /dev/null
  python -c "
import json; r=json.load(open('/tmp/x/report.json')); p, m = r['prediction'], r['measurement']
print('$T'.split('/')[-1], 'pred %.1f meas %.1f resident %.1f' % (p['step_ms'], m['step_ms'], m['resident_step_ms']))" | tee -a $OUT/llama-repeat.txt
  echo "  $(( $(date +%s) - T0 )) s"
done; done
rm -f $CK /dev/shm/*
