# As run on the lent H100s (OUT: the device tool's output folder), from the repository root.
# FLUX.1-dev LoRA (rank 32, checkpointed, 4096 tokens): recorded with the fixed recorder, then
# executed at 16000 against the recording and against the synthesized trace, on one lease.
M="model=flux_diffusers"
W="workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/flux-train.safetensors
T0=$(date +%s)
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
echo "materialized $(( $(date +%s) - T0 )) s"
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | grep -v "Warn\|warn" | tail -2
cp /tmp/rec/trace.jsonl $OUT/flux-diffusers-train.jsonl && gzip $OUT/flux-diffusers-train.jsonl
echo "recorded $(( $(date +%s) - T0 )) s"
python - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("/tmp/synth/trace.jsonl"), "$M $W".split())
PY
for T in rec synth; do
  python -m engine $M $W $P mode=execute trace=/tmp/$T/trace.jsonl weights.file=$CK budget=16000 hydra.run.dir=/tmp/x$T 2>&1 | grep -v "Warn\|warn" | tail -1
  cp /tmp/x$T/report.json $OUT/flux-16000-$T-execute-report.json
  echo "executed $T $(( $(date +%s) - T0 )) s"
done
rm -f $CK /dev/shm/*
python - <<PY
import json
for t in ("rec", "synth"):
    r = json.load(open("$OUT/flux-16000-%s-execute-report.json" % t)); p, m = r["prediction"], r["measurement"]
    print(t, "pred", round(p["step_ms"], 1), "meas", round(m["step_ms"], 1), "resident", m.get("resident_step_ms"),
          "peak", p["peak_pool_torch_bytes"], m.get("peak_pool_torch_bytes"), "h2d", p["h2d_bytes"], m["h2d_bytes"],
          "reloc", m.get("relocations"), m.get("warm_relocations"))
PY
