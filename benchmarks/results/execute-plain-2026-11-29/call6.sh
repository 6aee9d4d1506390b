# After the recorder's all-resident steps moved to engine/modules/resident_steps.py and the kernel
# table's fit to engine/calibrate_kernels.py: the CUDA tests, then the tiny transformers Llama
# through record and execute on the GPU (decode and a LoRA step, weights streamed at 0.35 MB).
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
T=/tmp/c6; mkdir -p $T
timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
W=$T/tiny.safetensors
python3 -m engine model=tiny_llama_hf mode=materialize out=$W hydra.run.dir=$T/mat > /dev/null 2>&1; echo "materialize rc=$?"
for args in "workload=decode workload.context_tokens=16" "workload=train_lora"; do
  name=$(echo $args | cut -d' ' -f1 | cut -d= -f2)
  timeout 120 python3 -m engine model=tiny_llama_hf $args budget=0.35 workload.steps=8 mode=execute weights.file=$W \
    hydra.run.dir=$T/$name > $T/$name.log 2>&1; echo "$name rc=$?"
  grep -E "^\| (step time|H2D|peak pool \+)|bitwise|against the same" $T/$name.log
done
cd $T && rm -f */timeline.json */trace.jsonl && tar czf $OUT/runs.tgz $(find . -name report.json -o -name report.md -o -name "*.log")
