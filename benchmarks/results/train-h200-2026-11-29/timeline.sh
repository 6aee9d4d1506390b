# SD3.5 Large's and Llama-3.1-8B's LoRA steps again at 8000 from their recordings (runs/), with
# the measured timeline: where the streamed SD3.5 step's 150 ms over the plain module go, and
# whether Llama's plain module runs slower than its streamed step again. Repo root; OUT as above.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
R=benchmarks/results/train-h200-2026-11-29/runs; T=/tmp/tl; mkdir -p $T
P="workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4 weights.eviction=priority weights.lookahead=2 activations=off hardware=h200 budget=8000 mode=execute"
for run in "sd35 model=sd35_large_diffusers workload.video_tokens=4096 workload.text_tokens=333" "llama model=llama8b_hf workload.text_tokens=2048"; do
  set -- $run; name=$1; shift; T0=$(date +%s)
  timeout 60 python3 -m engine $1 mode=materialize out=/dev/shm/$name.safetensors hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
  timeout 120 python3 -m engine "$@" $P trace=$R/$name/trace.jsonl.gz weights.file=/dev/shm/$name.safetensors \
    hydra.run.dir=$T/$name > $T/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - T0 )) s"; grep -E "^\| (step|H2D)" $T/$name.log | head -3
  rm -f /dev/shm/*
done
(cd $T && tar czf $OUT/timeline.tgz $(find . -name "timeline.json" -o -name report.json -o -name report.md -o -name telemetry.jsonl -o -name "*.log"))
ls -la $OUT
