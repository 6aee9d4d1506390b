set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
G=/tmp/fl; mkdir -p $G
timeout 300 python3 benchmarks/full_models.py --models llama8b --budgets llama8b=4000,null --evictions priority --out $G 2>&1 | grep -v Warning | tail -12
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $G && tar czf $OUT/llama-rec.tgz $(find . -name report.json -o -name "*.md" -o -name "*.jsonl.gz" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
F=/tmp/ff; mkdir -p $F
timeout 110 python3 benchmarks/full_models.py --models flux --budgets flux=16000,null --evictions belady --no-record --out $F 2>&1 | grep -v Warning | tail -6
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $F && tar czf $OUT/flux-rest.tgz $(find . -name report.json -o -name "*.md" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
T=/tmp/tr; mkdir -p $T
timeout 40 python3 -m engine model=ltx mode=materialize out=/dev/shm/ltx.ptd hydra.run.dir=$T/mat > /dev/null 2>&1
timeout 130 python3 -m engine model=ltx workload=train_lora budget=16000 mode=execute weights.file=/dev/shm/ltx.ptd workload.steps=4 hydra.run.dir=$T/train 2>&1 | grep -v Warning | tail -30
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/*
(cd $T && tar czf $OUT/ltx-train.tgz $(find . -name report.json -o -name "*.md" -o -name engine.log))
ls -la $OUT
