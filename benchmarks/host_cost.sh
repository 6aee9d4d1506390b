#!/usr/bin/env bash
# The host's share of a step, recorded and measured: LTX-2 (8 blocks) LoRA training at the
# default 6144 video tokens, where the lent H100's host bounds the step, and Llama-3.1-8B
# (8 layers) decode, where the host bounds it all resident. Records each (mode=record: the
# host per kernel of the forward and the backward, and the pipelined step through the
# executor), then runs mode=execute at a few budgets beside it. Writes OUT/{traces,runs}/.
#
#     bash benchmarks/host_cost.sh OUT          # on a CUDA GPU; weight files go to /dev/shm
#
# Then, on any machine: fit a profile from OUT/traces with data/traces/full, replay each
# execute's configuration against its measured step (benchmarks/results/ says how).
set -euo pipefail
OUT=${1:?usage: host_cost.sh OUT}
WEIGHTS=${WEIGHTS:-/dev/shm}
E="python3 -m engine"
RUNS=${RUNS:-/tmp/host-cost-runs}  # the engine's run folders; OUT keeps each run's log and report
mkdir -p "$OUT/traces" "$OUT/runs" "$RUNS"
LTX="+model=ltx model.num_layers=8"
LLAMA="+model=llama8b model.num_layers=8 workload=decode"
LTX_FILE=$WEIGHTS/host-cost-ltx8.ptd
LLAMA_FILE=$WEIGHTS/host-cost-llama8.ptd
trap 'rm -f "$LTX_FILE" "$LLAMA_FILE"' EXIT

run() {  # run NAME ARGS...: one engine run, its report kept, its time printed
  local name=$1; shift
  local t0=$SECONDS
  # A run that fails (an execute whose outputs differ) is reported and the rest still run.
  $E "$@" hydra.run.dir="$RUNS/$name" >"$OUT/runs/$name.log" 2>&1 || { echo "$name failed:"; tail -3 "$OUT/runs/$name.log"; }
  echo "$name: $((SECONDS - t0)) s"
  cp "$RUNS/$name/report.json" "$OUT/runs/$name.report.json" 2>/dev/null || true
}
run materialize-ltx $LTX mode=materialize out="$LTX_FILE"
run record-ltx-train $LTX workload=train_lora weights.file="$LTX_FILE" budget=2500 weights=priority mode=record
gzip -9 -c "$RUNS/record-ltx-train/trace.jsonl" >"$OUT/traces/ltx2_train_lora_6144.jsonl.gz"
for cfg in "none belady cuda" "500 belady cuda" "500 belady vmm" "2000 priority cuda"; do
  set -- $cfg
  run "train-$1-$2-$3" $LTX workload=train_lora weights.file="$LTX_FILE" \
    budget=$([ "$1" = none ] && echo null || echo "$1") weights=$2 weights.backend=$3 mode=execute workload.steps=12
done
rm -f "$LTX_FILE"
run materialize-llama $LLAMA mode=materialize out="$LLAMA_FILE"
run record-llama $LLAMA weights.file="$LLAMA_FILE" budget=3500 weights=priority mode=record
gzip -9 -c "$RUNS/record-llama/trace.jsonl" >"$OUT/traces/llama_decode_8.jsonl.gz"
for cfg in "none priority" "3500 belady" "5000 priority"; do
  set -- $cfg
  run "decode-$1-$2" $LLAMA weights.file="$LLAMA_FILE" budget=$([ "$1" = none ] && echo null || echo "$1") \
    weights=$2 mode=execute workload.steps=30
done
