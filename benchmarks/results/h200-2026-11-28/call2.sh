set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
F=/tmp/fm; mkdir -p $F
timeout 290 python3 benchmarks/full_models.py --models ltx --budgets ltx=8000,16000,24000,null --no-record --out $F 2>&1 | grep -v Warning | tail -20
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $F && tar czf $OUT/ltx.tgz $(find . -name report.json -o -name "*.md" -o -name "*.jsonl.gz" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
G=/tmp/fm2; mkdir -p $G
timeout 260 python3 benchmarks/full_models.py --models wan14b --budgets wan14b=8000,16000,24000,null --no-record --out $G 2>&1 | grep -v Warning | tail -20
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $G && tar czf $OUT/wan.tgz $(find . -name report.json -o -name "*.md" -o -name "*.jsonl.gz" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
ls -la $OUT
