# 8 blocks of spec LTX-2, a LoRA rank 32 step at 6144 tokens, recorded on the H200: the
# training forward's and the backward's kernel rates and host times the h200 table lacks.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/tr; mkdir -p $T
timeout 60 python3 -m engine model=ltx model.num_layers=8 workload=train_lora mode=materialize out=/dev/shm/ltx8.ptd \
  hydra.run.dir=$T/mat > /dev/null 2>&1
date
timeout 520 python3 -m engine model=ltx model.num_layers=8 workload=train_lora weights.file=/dev/shm/ltx8.ptd \
  budget=2500 weights=priority mode=record hydra.run.dir=$T/rec 2>&1 | grep -v Warning | tail -5
date
rm -f /dev/shm/*
gzip -c $T/rec/trace.jsonl > $OUT/ltx2-train-8blocks.jsonl.gz
(cd $T/rec && tar czf $OUT/rec.tgz report.md report.json engine.log 2>/dev/null)
ls -la $OUT
