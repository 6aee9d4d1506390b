# The full-mask attention probe (engine/measure/compute.py probe_full_mask, each point timed on the
# GPU alone), from the fullmask branch's engine (carried as .probe/engine, run from there so it
# is the engine imported).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
cd .probe
python3 -c "import engine; print(engine.__file__)"
timeout 240 python3 -m engine.measure.compute --only attention_full_mask --out $OUT/probes-h200-2026-11-29-full-mask.json 2>&1 | tail -2
python3 -c "
import json; d = json.load(open('$OUT/probes-h200-2026-11-29-full-mask.json'))
for r in d['probes']['compute']['attention_full_mask']:
    if r[3] == 128: print(r[:4], round(r[4] / 1e3, 1), 'us')"
