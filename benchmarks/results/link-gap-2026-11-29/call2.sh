#!/bin/bash
# The CUDA pool against the vmm backend on rows whose blocks take turns: each row's step, the link's
# idle time, the pool's reserve releases and relocations, and the device bytes reserved at most.
# FLUX.1-dev (two block sizes) and Llama-3.1-8B (embedding and head beside the layers), weights in
# /dev/shm, deleted after.
set -u
OUT=$1
run() {  # MODEL ROWS OVERRIDES...
  local model=$1 rows=$2; shift 2
  local w=/dev/shm/$model.safetensors
  python -m engine model=$model mode=materialize out=$w hydra.run.dir=$OUT/$model-mat > $OUT/$model-mat.log 2>&1 \
    || tail -5 $OUT/$model-mat.log
  for backend in cuda vmm; do
    echo "## $model, weights.backend=$backend"
    python benchmarks/link_timeline.py --out $OUT/$model-$backend --rows $rows \
      model=$model weights.file=$w weights.backend=$backend "$@" 2>&1 | tee $OUT/$model-$backend.txt | grep "^|\|pinned\|Error"
    gzip $OUT/$model-$backend/timelines.json
  done
  rm -f $w
}
run flux_diffusers 8331:lru:1,14282:lru:1,20232:lru:1,8331:belady:1,14282:belady:1,8331:priority:1,14282:priority:1 \
  workload.video_tokens=4096 workload.text_tokens=512
run llama8b_hf 5621:lru:1,9636:lru:1,5621:belady:1,9636:belady:1,5621:priority:1,9636:priority:1 workload.text_tokens=2048
