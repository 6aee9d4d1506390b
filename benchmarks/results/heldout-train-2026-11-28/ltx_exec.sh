# As run on the lent H100 (OUT: the device tool's output folder), from the repository root.
# The whole diffusers LTX-2's LoRA step as the CLI runs it now (cuDNN's attention off), predicted
# from the synthesized trace (training attention rates) and executed at 16000.
M="model=ltx2_diffusers"
W="workload=train_lora workload.video_tokens=6144 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/ltx2.safetensors
T0=$(date +%s)
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1 || echo "MATERIALIZE FAILED"
echo "materialized $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth/trace.jsonl"), "$M $W".split())
PY
echo "synthesized $(( $(date +%s) - T0 )) s"
python -m engine $M $W $P mode=execute trace=/tmp/synth/trace.jsonl weights.file=$CK budget=16000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -2
cp /tmp/x/report.json $OUT/ltx2-16000-synth-execute-report.json; cp /tmp/x/report.md $OUT/ltx2-16000-synth-execute-report.md
echo "executed $(( $(date +%s) - T0 )) s"
rm -f $CK /dev/shm/*
python - <<PY
import json
r = json.load(open("$OUT/ltx2-16000-synth-execute-report.json")); p, m = r["prediction"], r["measurement"]
print("ltx2 synth pred", round(p["step_ms"], 1), "meas", round(m["step_ms"], 1), "resident", m.get("resident_step_ms"),
      "peak", p["peak_pool_torch_bytes"], m.get("peak_pool_torch_bytes"), "h2d", p["h2d_bytes"], m["h2d_bytes"],
      "reloc", m.get("relocations"), m.get("warm_relocations"), "loss/grads", r.get("loss_match_reference"), r.get("grads_match_reference"))
PY
