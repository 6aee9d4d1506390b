# As run on the lent H100s (OUT: the device tool's output folder), from the repository root.
# Llama-3.1-8B LoRA (rank 32, all-linear, checkpointed, 2048 tokens): the plain step profiled,
# then recorded (training), then executed at 8000 against its recording.
M="model=llama8b_hf"
W="workload=train_lora workload.text_tokens=2048 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/llama-train.safetensors
T0=$(date +%s)
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python benchmarks/results/train-host-2026-11-28/llama_prof.py 2>&1 | grep -v "Warn\|warn\|^\s*$" > $OUT/llama_prof.txt; head -12 $OUT/llama_prof.txt
echo "profiled $(( $(date +%s) - T0 )) s"
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
echo "materialized $(( $(date +%s) - T0 )) s"
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | grep -v "Warn\|warn" | tail -4
cp /tmp/rec/trace.jsonl $OUT/llama8b-hf-train.jsonl && gzip $OUT/llama8b-hf-train.jsonl
cp /tmp/rec/report.json $OUT/llama-record-report.json 2>/dev/null
echo "recorded $(( $(date +%s) - T0 )) s"
python -m engine $M $W $P mode=execute trace=/tmp/rec/trace.jsonl weights.file=$CK budget=8000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -3
cp /tmp/x/report.json $OUT/llama-8000-execute-report.json
cp /tmp/x/report.md $OUT/llama-8000-execute-report.md 2>/dev/null
echo "executed $(( $(date +%s) - T0 )) s"
rm -f $CK /dev/shm/*
