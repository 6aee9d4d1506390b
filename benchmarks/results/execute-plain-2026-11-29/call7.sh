# The spec Llama-3.1-8B (model=llama8b) decode under belady through mode=execute: where the
# simulator says the steps vary, the measured step is now the warm steps' mean, as the prediction's.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=/tmp/c7; mkdir -p $T
W=/dev/shm/llama8b.ptd
timeout 120 python3 -m engine model=llama8b mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
for B in 12000 4000; do
  timeout 100 python3 -m engine model=llama8b workload=decode hardware=h200 budget=$B weights.eviction=belady \
    workload.steps=16 mode=execute weights.file=$W hydra.run.dir=$T/belady-$B > $T/belady-$B.log 2>&1
  echo "belady-$B rc=$?"
  python3 - $T/belady-$B <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1] + "/report.json")); m = r["measurement"]; p = r["prediction"]
s = m["steps_ms"]
print(f"  predicted mean {p['mean_step_ms']:.2f} range {p['step_ms_range'][0]:.1f}-{p['step_ms_range'][1]:.1f}; "
      f"measured {m['step_ms']:.2f} (median after the first {statistics.median(s[1:]):.2f}); H2D last {m['h2d_bytes']/1e9:.3f} "
      f"predicted last {p['h2d_bytes']/1e9:.3f}; bitwise {m.get('outputs_bitwise')}")
print("  steps", " ".join(f"{x:.1f}" for x in s))
PY
done
rm -rf /dev/shm/*
cd $T && rm -f */timeline.json && tar czf $OUT/runs.tgz $(find . -name report.json -o -name report.md -o -name "*.log")
