#!/bin/bash
# The validate reports of the shipped measurements, rebuilt on a CPU into data/calibration/
# (NAME_default_h200.md: the config's own prediction; NAME_h200.md: the model's recording's; the
# 8-block spec recordings' H100 reports under h100_pcie5 and h100_calibrated).
# FLUX.1-dev's measurements (both backends) and the spec Llama decode's for the config's prediction
# are link-gap-2026-11-29's calls 5 and 6, which record the pool's events and the link.
set -eu
cd "$(dirname "$0")/../../.."
T=data/traces/h200
one() {  # NAME ARGS...: the report, from its "## Calibration report" heading on (hardware=h200 unless ARGS say)
  local name=$1; shift
  local dir; dir=$(mktemp -d)
  .venv/bin/python -m engine hardware=h200 mode=validate "$@" hydra.run.dir=$dir > $dir/out 2>/dev/null
  sed -n '/^## Calibration report/,$p' $dir/out | grep -v '^report: \|^plot: ' | cat -s > data/calibration/$name.md
  cp $dir/report.json /tmp/validate-$name.json
  rm -rf $dir
}
one ltx2_full_default_h200 +model=ltx measurements=$T/validate/ltx2-full.measurements.json
one llama8b_decode_full_default_h200 +model=llama8b workload=decode \
    measurements=$T/validate/llama8b-decode-default.measurements.json
one flux_diffusers_default_h200 model=flux_diffusers workload.video_tokens=4096 workload.text_tokens=512 \
    measurements=$T/modules/flux.trace.measurements.json
one flux_diffusers_vmm_default_h200 model=flux_diffusers workload.video_tokens=4096 workload.text_tokens=512 \
    measurements=$T/validate/flux-vmm.measurements.json
one flux_diffusers_h200 model=flux_diffusers workload.video_tokens=4096 workload.text_tokens=512 \
    workload.audio_tokens=0 trace=$T/modules/flux.trace.jsonl.gz
one wan14b_diffusers_default_h200 model=wan14b_diffusers workload.video_tokens=6144 workload.text_tokens=512 \
    measurements=$T/modules/wan14b.trace.measurements.json
one wan14b_diffusers_h200 model=wan14b_diffusers workload.video_tokens=6144 workload.text_tokens=512 \
    workload.audio_tokens=0 trace=$T/modules/wan14b.trace.jsonl.gz
one llama8b_hf_prefill_default_h200 model=llama8b_hf workload.text_tokens=2048 \
    measurements=$T/validate/llama8b-hf-prefill.measurements.json
one llama8b_hf_prefill_vmm_default_h200 model=llama8b_hf workload.text_tokens=2048 \
    measurements=$T/validate/llama8b-hf-prefill-vmm.measurements.json
one llama8b_hf_decode_default_h200 model=llama8b_hf workload=decode \
    measurements=$T/modules/llama8b.trace.measurements.json
one llama8b_hf_decode_h200 model=llama8b_hf workload=decode trace=$T/modules/llama8b.trace.jsonl.gz
# The LoRA steps' grids (every frozen weight resident, then streamed):
# benchmarks/results/validate-train-2026-11-29/ (the earlier five-row Llama file stays for its results).
one llama8b_hf_train_default_h200 model=llama8b_hf workload=train_lora workload.text_tokens=2048 \
    workload.checkpointing=true measurements=$T/validate/llama8b-hf-train-stall.measurements.json
one flux_diffusers_train_default_h200 model=flux_diffusers workload=train_lora workload.video_tokens=4096 \
    workload.text_tokens=256 workload.checkpointing=true measurements=$T/validate/flux-train-stall.measurements.json
one flux_diffusers_train_h200 model=flux_diffusers workload=train_lora workload.video_tokens=4096 \
    workload.text_tokens=256 workload.checkpointing=true trace=$T/validate/flux-train-c.jsonl.gz
one wan14b_diffusers_train_default_h200 model=wan14b_diffusers workload=train_lora workload.video_tokens=6144 \
    workload.text_tokens=512 workload.checkpointing=true measurements=$T/validate/wan14b-train-stall.measurements.json
one zimage_diffusers_train_default_h200 model=zimage_diffusers workload=train_lora workload.video_tokens=4096 \
    workload.text_tokens=256 workload.checkpointing=true measurements=$T/validate/zimage-train.measurements.json
one wan14b_diffusers_train_h200 model=wan14b_diffusers workload=train_lora workload.video_tokens=6144 \
    workload.text_tokens=512 workload.checkpointing=true trace=$T/modules/wan14b-train.jsonl.gz \
    measurements=$T/validate/wan14b-train-stall.measurements.json
one ltx2_full_h200 +model=ltx trace=$T/validate/ltx2-full.jsonl.gz
one llama8b_decode_full_h200 +model=llama8b workload=decode trace=$T/validate/llama8b-decode.jsonl.gz
for hw in h100_pcie5 h100_calibrated; do
  one ltx2_infer_$hw +model=ltx model.num_layers=8 hardware=$hw trace=data/traces/ltx2_infer.jsonl.gz
  one ltx2_train_lora_$hw +model=ltx model.num_layers=8 workload=train_lora workload.lora_rank=32 \
      workload.video_tokens=16384 hardware=$hw trace=data/traces/ltx2_train_lora.jsonl.gz
done
one llama_decode_h100_pcie5 +model=llama8b model.num_layers=8 workload=decode hardware=h100_pcie5 \
    trace=data/traces/llama_decode.jsonl.gz
