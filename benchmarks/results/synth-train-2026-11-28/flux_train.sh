#!/bin/bash
# LoRA training of diffusers FLUX.1-dev: the synthesized trace's prediction (no recording), executed, then recorded.
set -x
M="model=flux_diffusers"
W="workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/flux-train.safetensors
T0=$(date +%s)
python -m engine $M mode=materialize out=$CK hydra.run.dir=$OUT/materialize 2>&1 | tail -2
echo "materialized $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("$OUT/synth/trace.jsonl"), "$M $W".split())
PY
echo "synthesized $(( $(date +%s) - T0 )) s"
python -m engine -m $M $W $P mode=execute trace=$OUT/synth/trace.jsonl weights.file=$CK budget=12000,16000 hydra.sweep.dir=$OUT/execute 2>&1 | grep -v Warning | tail -40
echo "executed $(( $(date +%s) - T0 )) s"
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=$OUT/record 2>&1 | tail -3
echo "recorded $(( $(date +%s) - T0 )) s"
rm -f $CK
python -m engine -m $M $W $P trace=$OUT/record/trace.jsonl budget=12000,16000 hydra.sweep.dir=$OUT/simulate_recorded 2>&1 | tail -3
python - <<PY
import json, glob
for d in sorted(glob.glob("$OUT/execute/*/report.json")):
    r = json.load(open(d)); p, m, c = r["prediction"], r["measurement"], r["config"]
    print("EXEC", c.get("budget_mb"), "pred", round(p["step_ms"], 1), "meas", round(m["step_ms"], 1), "resident", m.get("resident_step_ms"),
          "peak pred/meas", p["peak_pool_torch_bytes"], m.get("peak_pool_torch_bytes"), "h2d", p["h2d_bytes"], m["h2d_bytes"],
          "loss/grads", r.get("loss_match_reference"), r.get("grads_match_reference"))
for d in sorted(glob.glob("$OUT/simulate_recorded/*/report.json")):
    r = json.load(open(d)); p = r["prediction"]; print("RECPRED", r["config"].get("budget_mb"), round(p["step_ms"], 1), p["peak_pool_torch_bytes"])
PY
ls /dev/shm
