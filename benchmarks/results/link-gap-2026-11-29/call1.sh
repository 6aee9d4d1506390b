#!/bin/bash
# FLUX.1-dev's lru rows read 2-8% under the profile's link: where does the time go?
# The link's facts, copies at page offsets 0 and 64 (link_reach.py), then FLUX's rows with each
# copy's span marked (link_timeline.py). Weights in /dev/shm, deleted after.
set -u
OUT=$1
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,clocks.mem --format=csv
ls /sys/devices/system/node | grep -c node; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled
for off in 0 64; do
  python benchmarks/link_reach.py --gib 8 --pool-gib 4 --rounds 3 --offset $off > $OUT/reach-offset$off.txt 2>&1
  echo "reach offset $off:"; tail -6 $OUT/reach-offset$off.txt
done
w=/dev/shm/flux_diffusers.safetensors
python -m engine model=flux_diffusers mode=materialize out=$w hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1 || tail -5 $OUT/mat.log
python benchmarks/link_timeline.py --out $OUT/flux \
  --rows 8331:lru:4,14282:lru:4,14282:lru:1,20232:lru:1,8331:priority:1,14282:priority:1,8331:lru:4 \
  model=flux_diffusers weights.file=$w workload.video_tokens=4096 workload.text_tokens=512 2>&1 | tee $OUT/flux.txt | grep -v Warning
rm -f $w
