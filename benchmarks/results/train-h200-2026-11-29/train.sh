# LoRA steps (rank 32, checkpointed) of real diffusers/transformers models on the lent H200:
# `mode=execute` without trace= records the step, then runs it all resident and streamed at the
# budget, beside the prediction from that recording. Usage: bash train.sh NAME... (from the repo root;
# OUT: the device tool's output folder). Each model is skipped when under 200 s of the call remain.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
START=$(date +%s); T=/tmp/train; mkdir -p $T
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current --format=csv,noheader
R="workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off hardware=h200"
for name in "$@"; do
  case $name in
    sd35) M=model=sd35_large_diffusers; W="workload.video_tokens=4096 workload.text_tokens=333"; B=8000 ;;
    llama) M=model=llama8b_hf; W="workload.text_tokens=2048"; B=8000 ;;
    flux) M=model=flux_diffusers; W="workload.video_tokens=4096"; B=12000 ;;
    wan) M=model=wan14b_diffusers; W="workload.video_tokens=6144 workload.text_tokens=512"; B=16000 ;;
    hv) M=model=hunyuan_video_diffusers; W="workload.video_tokens=4096"; B=12000 ;;
    auraflow) M=model=auraflow_diffusers; W="workload.video_tokens=4096"; B=8000 ;;
    qwen) M=model=qwen_image_diffusers; W="workload.video_tokens=4096"; B=16000 ;;
  esac
  left=$(( 590 - $(date +%s) + START ))
  if [ $left -lt 200 ]; then echo "$name skipped: $left s left"; continue; fi
  CK=/dev/shm/$name.safetensors; T0=$(date +%s)
  timeout 120 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
  echo "$name materialized rc=$? $(( $(date +%s) - T0 )) s"
  timeout $(( left - 40 )) python3 -m engine $M $R $W $P budget=$B mode=execute weights.file=$CK \
    hydra.run.dir=$T/$name > $T/$name.log 2>&1
  echo "$name execute rc=$? $(( $(date +%s) - T0 )) s"
  grep -E "^\| (step|H2D|peak)|^against|rror" $T/$name.log | head -10
  rm -f $CK; gzip -f $T/$name/trace.jsonl 2>/dev/null
done
rm -f /dev/shm/*
(cd $T && tar czf $OUT/train-$(echo "$@" | tr ' ' '-').tgz $(find . -name "trace.jsonl.gz" -o -name report.json -o -name report.md -o -name telemetry.jsonl -o -name "*.log"))
ls -la $OUT
