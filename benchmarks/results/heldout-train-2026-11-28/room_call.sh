# As run on the lent H100 (OUT: the device tool's output folder), from the repository root.
# HunyuanVideo's LoRA step recorded with 30 GiB of the GPU held by another process: the room
# check then decides whether the all-resident steps run (before the fix it counted the recompute's
# weight copies and skipped them).
M="model=hunyuan_video_diffusers"
W="workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true"
CK=/dev/shm/hv.safetensors
T0=$(date +%s)
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1 || echo "MATERIALIZE FAILED"
echo "materialized $(( $(date +%s) - T0 )) s"
python -c "import torch, time; x = torch.empty(30 * 2**30, dtype=torch.uint8, device='cuda'); print('holding', flush=True); time.sleep(400)" &
HOG=$!
sleep 8
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | grep -i "skipped\|report\|error" | head -5
kill $HOG
echo "recorded $(( $(date +%s) - T0 )) s"
rm -f $CK /dev/shm/*
python - <<PY
import gzip, json
h = json.loads(open("/tmp/rec/trace.jsonl").readline())
print({k: h.get(k) for k in ("pipelined_step_ns", "compute_scale", "host_scale", "activation_peak_bytes", "record_stages_s")})
PY
cp /tmp/rec/trace.jsonl $OUT/hv-train-room.jsonl && gzip $OUT/hv-train-room.jsonl
