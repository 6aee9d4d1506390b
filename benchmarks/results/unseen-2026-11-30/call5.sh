# Z-Image's LoRA grid (rank 32, checkpointed, 4096 + 256 tokens) by mode=validate from its config
# alone: five activation policies all resident, then 3 budgets x 3 evictions streamed.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
timeout 540 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT \
    zimage_diffusers:workload=train_lora,workload.video_tokens=4096,workload.text_tokens=256,workload.checkpointing=true
grep -E "measured train" $OUT/zimage_diffusers.validate.log
cp $OUT/zimage_diffusers/validate/measurements.json $OUT/zimage-measurements.json
rm -rf $OUT/zimage_diffusers; rm -f /dev/shm/*
