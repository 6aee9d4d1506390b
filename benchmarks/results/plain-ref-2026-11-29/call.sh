# LoRA steps (rank 32, checkpointed) through mode=execute with more steps, each plain step's time
# kept (measurement.resident_steps_ms). Usage: bash call.sh NAME:BUDGET:STEPS... (BUDGET null: no budget).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
START=$(date +%s); T=/tmp/train; mkdir -p $T
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current --format=csv,noheader
R="workload=train_lora workload.lora_rank=32 workload.checkpointing=true"
P="weights.eviction=priority weights.lookahead=2 activations=off hardware=h200"
last=""
for spec in "$@"; do
  IFS=: read name B S <<< "$spec"
  case $name in
    sd35) M=model=sd35_large_diffusers; W="workload.video_tokens=4096 workload.text_tokens=333" ;;
    llama) M=model=llama8b_hf; W="workload.text_tokens=2048" ;;
    flux) M=model=flux_diffusers; W="workload.video_tokens=4096" ;;
    auraflow) M=model=auraflow_diffusers; W="workload.video_tokens=4096" ;;
  esac
  left=$(( ${LIMIT:-590} - $(date +%s) + START ))
  if [ $left -lt 150 ]; then echo "$spec skipped: $left s left"; continue; fi
  CK=/dev/shm/$name.safetensors; T0=$(date +%s)
  if [ "$last" != "$name" ]; then
    rm -f /dev/shm/*
    timeout 120 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
    echo "$name materialized rc=$? $(( $(date +%s) - T0 )) s"
  fi
  last=$name; D=$T/$name-$B-$S
  timeout $(( left - 20 )) python3 -m engine $M $R $W $P budget=$B workload.steps=$S mode=execute weights.file=$CK \
    hydra.run.dir=$D > $D.log 2>&1
  echo "$spec execute rc=$? $(( $(date +%s) - T0 )) s"
  python3 - $D <<'PY'
import json, sys, gzip
d = json.load(open(sys.argv[1] + "/report.json")); m = d["measurement"]; p = d["prediction"]
print(f"  predicted {p['step_ms']:.1f} measured {m['step_ms']:.1f} plain {m.get('resident_step_ms')}")
for run in m.get("resident_steps_ms", []):
    print("  plain steps", " ".join(f"{x:.1f}" for x in run))
tel = [json.loads(l) for l in open(sys.argv[1] + "/telemetry.jsonl")]
print("  streamed steps", " ".join(f"{r['weight_step_ms']:.1f}" for r in tel))
PY
  gzip -f $D/trace.jsonl 2>/dev/null
done
rm -f /dev/shm/*
(cd $T && tar czf $OUT/runs.tgz $(find . -name "trace.jsonl.gz" -o -name report.json -o -name report.md -o -name telemetry.jsonl -o -name "*.log"))
