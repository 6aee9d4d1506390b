# The final code on the GPU: the CUDA tests, then FLUX.1-dev (diffusers, 4096 tokens) through
# mode=execute at 12000 under belady (its plain module's outputs and steps beside; where the
# simulator says the steps vary, the measured step is the warm steps' mean).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/c5; mkdir -p $T
timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
W=/dev/shm/flux.safetensors
python3 -m engine model=flux_diffusers mode=materialize out=$W hydra.run.dir=/tmp/mat > /dev/null 2>&1; echo "materialize rc=$?"
timeout 260 python3 -m engine model=flux_diffusers hardware=h200 mode=execute weights.file=$W hydra.run.dir=$T/flux-12000 \
  workload.video_tokens=4096 budget=12000 weights.eviction=belady workload.steps=12 > $T/flux-12000.log 2>&1
echo "flux-12000 rc=$?"
grep -E "^\| (step|peak|H2D)|measured steps|bitwise|steps vary|mean" $T/flux-12000.log
python3 - <<'PY'
import json
r = json.load(open("/tmp/c5/flux-12000/report.json")); p, m = r["prediction"], r["measurement"]
print("steps_vary", p["steps_vary"], "range", p["step_ms_range"], "outcomes", r["outcomes"])
print("steps", " ".join(f"{x:.1f}" for x in m["steps_ms"]))
PY
rm -rf /dev/shm/*
cd $T && rm -f */timeline.json && gzip -f */trace.jsonl
tar czf $OUT/runs.tgz $(find . -name "trace.jsonl.gz" -o -name report.json -o -name report.md -o -name "*.log")
