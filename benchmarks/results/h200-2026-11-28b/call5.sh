# The CUDA tests of what changed (relocation inside training steps, the census on CUDA), and
# LTX-2 (8 blocks) LoRA training recorded on the H200: the kernel table's training rates.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_synthesize.py -k "on_cuda or rms_norm" \
  tests/test_executor_cuda.py tests/test_vmm_cuda.py tests/test_modules_training.py tests/test_executor_activations_cuda.py 2>&1 | tail -4
T=/tmp/rec; mkdir -p $T
L="+model=ltx model.num_layers=8"
timeout 60 python3 -m engine $L mode=materialize out=/dev/shm/ltx8.ptd hydra.run.dir=$T/mat > /dev/null 2>&1
timeout 300 python3 -m engine $L workload=train_lora weights.file=/dev/shm/ltx8.ptd budget=2500 weights=priority \
  mode=record hydra.run.dir=$T/record-ltx-train 2>&1 | grep -v Warning | tail -3
rm -f /dev/shm/*
gzip -9 -c $T/record-ltx-train/trace.jsonl > $OUT/ltx2-train-8blocks.jsonl.gz
ls -la $OUT
