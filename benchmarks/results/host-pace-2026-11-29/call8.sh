# The bound training step on CUDA: tiny Llama LoRA through the CLI with no budget and with one
# every weight fits (both bound now), each compared with the plain module's steps; then the GPU tests.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
python3 -m engine model=tiny_llama_hf mode=materialize out=/tmp/tiny.safetensors hydra.run.dir=/tmp/m > /dev/null 2>&1
for b in null 100000; do
  timeout 60 python3 -m engine model=tiny_llama_hf workload=train_lora workload.lora_rank=4 workload.text_tokens=64 \
    activations=sync activations.num_offload_layers=1 activations.min_tensor_bytes=0 budget=$b mode=execute \
    weights.file=/tmp/tiny.safetensors sim.timeline=false hydra.run.dir=/tmp/t-$b 2>&1 | grep -E "^\| step|^against|rror"
  echo "budget=$b rc=${PIPESTATUS[0]}"
done
timeout 140 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -2
