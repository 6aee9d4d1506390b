# Masked attention probed again on the GPU alone, with a decode's folded query rows (DECODE_Q),
# from the fullmask branch's engine (.probe/engine, run from there); then decode's masked attention
# as transformers runs it, for the record.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
cd .probe
python3 -c "import engine; print(engine.__file__)"
timeout 400 python3 -m engine.measure.compute --only attention_masked --out $OUT/probes-h200-2026-11-29-masked-gpu.json 2>&1 | tail -2
python3 -c "
import json; d = json.load(open('$OUT/probes-h200-2026-11-29-masked-gpu.json'))
for r in d['probes']['compute']['attention_masked']:
    if r[3] == 128 and r[2] in (1024, 4096, 16384) and r[1] <= 64: print(r[:4], round(r[4] / 1e3, 1), 'us')"
