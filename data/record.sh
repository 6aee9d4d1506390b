#!/usr/bin/env bash
# Re-records the shipped traces and validation measurements on a CUDA GPU.
#
#     bash data/record.sh [DEST]          # DEST defaults to data/; SMOKE=1 for a small model run
#
# Needs the engine's dependencies (hydra, omegaconf, simpy, torch, cuda-python).
# Weight files go to /dev/shm (WEIGHTS=...): 6.3 GB for 8 LTX-2 blocks, 5.6 GB
# for 8 Llama-3.1-8B layers. Then, on any machine:
#     python -m engine.calibrate DEST/traces --out conf/hardware/NAME.yaml
# (the shipped h100_calibrated is fitted from data/traces/full: benchmarks/full_models.py)
set -euo pipefail
DEST=${1:-data}
WEIGHTS=${WEIGHTS:-/dev/shm}
RUNS=${RUNS:-/tmp/offload-record}
E="python3 -m engine"
mkdir -p "$DEST/traces" "$RUNS"

if [ "${SMOKE:-0}" = 1 ]; then
  LTX="+model=tiny workload.video_tokens=1024 workload.audio_tokens=64 workload.text_tokens=64"
  LTX_LOW="$LTX workload.video_tokens=256"
  LLAMA="+model=llama8b model.num_layers=2 workload=decode workload.context_tokens=512"
  LTX_BUDGET=2; LLAMA_BUDGET=3500; RANK=4
else
  LTX="+model=ltx model.num_layers=8"
  LTX_LOW="$LTX workload.video_tokens=1536"
  LLAMA="+model=llama8b model.num_layers=8 workload=decode"
  LTX_BUDGET=2500; LLAMA_BUDGET=4500; RANK=32
fi
# The training step at 16384 video tokens: at 6144 the H100's step is host-bound
# (cuBLAS costs 52-100 us of host time a matmul there: benchmarks/matmul_host_cost.py), at 16384 the GPU is the bottleneck.
LTX_TRAIN="$LTX workload=train_lora workload.lora_rank=$RANK"
[ "${SMOKE:-0}" = 1 ] || LTX_TRAIN="$LTX_TRAIN workload.video_tokens=16384"

weights() {  # weights NAME MODEL_ARGS...: a weight file, written once
  local f="$WEIGHTS/$1.ptd"; shift
  [ -f "$f" ] || $E "$@" mode=materialize out="$f" >"$RUNS/materialize.log" 2>&1
  echo "$f"
}
record() {  # record NAME MODEL_ARGS...
  local name=$1; shift
  $E "$@" mode=record hydra.run.dir="$RUNS/$name"
  gzip -9 -c "$RUNS/$name/trace.jsonl" >"$DEST/traces/$name.jsonl.gz"
}
validate() {  # validate NAME MODEL_ARGS...: measure on the GPU, keep the measurements beside the trace
  local name=$1; shift
  rm -f "$DEST/traces/$name.measurements.json"
  $E "$@" mode=validate trace="$DEST/traces/$name.jsonl.gz" hydra.run.dir="$RUNS/$name-validate"
  cp "$RUNS/$name-validate/measurements.json" "$DEST/traces/$name.measurements.json"
}

LTX_FILE=$(weights "ltx-$(echo $LTX | md5sum | cut -c1-8)" $LTX)
LLAMA_FILE=$(weights "llama-$(echo $LLAMA | md5sum | cut -c1-8)" $LLAMA)
record ltx2_infer $LTX weights.file="$LTX_FILE" budget=$LTX_BUDGET
validate ltx2_infer $LTX weights.file="$LTX_FILE"
record ltx2_infer_low $LTX_LOW weights.file="$LTX_FILE" budget=$LTX_BUDGET
record ltx2_train_lora $LTX_TRAIN weights.file="$LTX_FILE" budget=$LTX_BUDGET
validate ltx2_train_lora $LTX_TRAIN weights.file="$LTX_FILE"
record llama_decode $LLAMA weights.file="$LLAMA_FILE" budget=$LLAMA_BUDGET
validate llama_decode $LLAMA weights.file="$LLAMA_FILE"
