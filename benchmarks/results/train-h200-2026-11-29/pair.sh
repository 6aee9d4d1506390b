# Host pace of a training step against an inference on one lease: each model recorded
# (mode=record) as an inference forward and as a LoRA step (rank 32, checkpointed), same tokens,
# one process after the other. Usage: bash pair.sh NAME... (repo root; OUT: the device tool's output folder).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
START=$(date +%s); T=/tmp/pair; mkdir -p $T
R="workload.lora_rank=32 workload.checkpointing=true hardware=h200"
for name in "$@"; do
  case $name in
    sd35) M=model=sd35_large_diffusers; W="workload.video_tokens=4096 workload.text_tokens=333" ;;
    llama) M=model=llama8b_hf; W="workload.text_tokens=2048 workload.video_tokens=0 workload.audio_tokens=0" ;;
    flux) M=model=flux_diffusers; W="workload.video_tokens=4096" ;;
  esac
  left=$(( 585 - $(date +%s) + START ))
  if [ $left -lt 150 ]; then echo "$name skipped: $left s left"; continue; fi
  CK=/dev/shm/$name.safetensors; T0=$(date +%s)
  timeout 120 python3 -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat-$name > /dev/null 2>&1
  echo "$name materialized rc=$? $(( $(date +%s) - T0 )) s"
  for kind in infer train_lora infer; do
    left=$(( 585 - $(date +%s) + START ))
    if [ $left -lt 60 ]; then echo "$name $kind skipped"; continue; fi
    d=$T/$name-$kind; [ -d $d ] && d=$d-2
    timeout $(( left - 20 )) python3 -m engine $M workload=$kind $W $R mode=record weights.file=$CK \
      hydra.run.dir=$d > $d.log 2>&1
    echo "$name $kind record rc=$? $(( $(date +%s) - T0 )) s"; gzip -f $d/trace.jsonl
  done
  rm -f $CK
done
rm -f /dev/shm/*
(cd $T && tar czf $OUT/pair-$(echo "$@" | tr ' ' '-').tgz $(find . -name "trace.jsonl.gz" -o -name report.md -o -name "*.log"))
ls -la $OUT
