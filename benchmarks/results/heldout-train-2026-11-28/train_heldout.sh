# As run on the lent H100 (OUT: the device tool's output folder), from the repository root.
# A diffusers model's LoRA step predicted without any recording (synthesized), executed at 16000,
# then recorded with the fixed recorder. Usage: bash train_heldout.sh MODEL TAG
M="model=$1"; TAG=$2
W="workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/$TAG.safetensors
T0=$(date +%s)
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$TAG > /dev/null 2>&1 || echo "MATERIALIZE FAILED"
echo "$TAG materialized $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth-$TAG/trace.jsonl"), "$M $W".split())
PY
echo "$TAG synthesized $(( $(date +%s) - T0 )) s"
python -m engine $M $W $P mode=execute trace=/tmp/synth-$TAG/trace.jsonl weights.file=$CK budget=16000 hydra.run.dir=/tmp/x-$TAG 2>&1 | grep -v "Warn\|warn" | tail -3
cp /tmp/x-$TAG/report.json $OUT/$TAG-16000-synth-execute-report.json
cp /tmp/x-$TAG/report.md $OUT/$TAG-16000-synth-execute-report.md 2>/dev/null
echo "$TAG executed $(( $(date +%s) - T0 )) s"
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec-$TAG 2>&1 | grep -v "Warn\|warn" | tail -2
cp /tmp/rec-$TAG/trace.jsonl $OUT/$TAG-train.jsonl && gzip -f $OUT/$TAG-train.jsonl
echo "$TAG recorded $(( $(date +%s) - T0 )) s"
rm -f $CK /dev/shm/*
python - <<PY
import json
r = json.load(open("$OUT/$TAG-16000-synth-execute-report.json")); p, m = r["prediction"], r["measurement"]
print("$TAG synth pred", round(p["step_ms"], 1), "meas", round(m["step_ms"], 1), "resident", m.get("resident_step_ms"),
      "peak", p["peak_pool_torch_bytes"], m.get("peak_pool_torch_bytes"), "h2d", p["h2d_bytes"], m["h2d_bytes"],
      "reloc", m.get("relocations"), m.get("warm_relocations"), "loss/grads", r.get("loss_match_reference"), r.get("grads_match_reference"))
PY
