# The README's CLI path on SD3.5 Large after the fixes: execute records first and compares
# with the plain module loaded from weights.file; then a sweep of that recording (no GPU needed).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/nm; mkdir -p $T
M="model=sd35_large_diffusers workload.video_tokens=4096 workload.text_tokens=333 hardware=h200"
timeout 60 python3 -m engine $M mode=materialize out=/dev/shm/sd35.safetensors hydra.run.dir=$T/mat > /dev/null 2>&1
echo "materialize rc=$?"
timeout 200 python3 -m engine $M budget=8000 mode=execute weights.file=/dev/shm/sd35.safetensors workload.steps=6 \
  hydra.run.dir=$T/exec > $T/exec.log 2>&1; echo "execute rc=$?"
grep -E "^\| (step time|H2D|peak)|^predicted|^outputs|^error" $T/exec.log
timeout 120 python3 -m engine -m $M trace=$T/exec/trace.jsonl budget=4000,8000,12000,null hydra.sweep.dir=$T/sweep \
  > $T/sweep.log 2>&1; echo "sweep rc=$?"; grep -E "^\[|^Fastest|^Pareto" $T/sweep.log
rm -f /dev/shm/*
tar czf $OUT/nm5.tgz -C $T exec/report.md exec/report.json exec/trace.jsonl exec/timeline.png sweep/summary.md exec.log sweep.log
