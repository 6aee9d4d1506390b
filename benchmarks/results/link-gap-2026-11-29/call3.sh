#!/bin/bash
# After the pool's first release of its reserve stopped waiting for the copy stream to drain: FLUX's
# rows again (as call 2 ran them on the CUDA pool), then the executor's CUDA tests.
set -u
OUT=$1
w=/dev/shm/flux_diffusers.safetensors
python -m engine model=flux_diffusers mode=materialize out=$w hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1 || tail -5 $OUT/mat.log
python benchmarks/link_timeline.py --out $OUT/flux --rows 8331:lru:1,8331:lru:4,14282:lru:1,14282:lru:4,8331:belady:1,14282:priority:1 \
  model=flux_diffusers weights.file=$w workload.video_tokens=4096 workload.text_tokens=512 2>&1 | tee $OUT/flux.txt | grep "^|\|pinned\|Error"
gzip $OUT/flux/timelines.json
rm -f $w
timeout 300 python -m pytest -q -p no:cacheprovider -m cuda tests/test_faults.py tests/test_executor_cuda.py \
  tests/test_modules_training.py tests/test_train_execute.py tests/test_soak.py 2>&1 | tail -4
