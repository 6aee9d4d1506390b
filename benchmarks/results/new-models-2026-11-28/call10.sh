# After execute's LoRA reference became the plain module: the GPU tests, then a LoRA step of a
# small Llama through the CLI on CUDA (its losses and gradients against the plain module's).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1; export PYTHONPATH=$PWD/.site:$PWD
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -1
M="model=llama8b_hf model.module.config.num_hidden_layers=4 workload=train_lora workload.text_tokens=1024 workload.checkpointing=true activations=off"
timeout 60 python3 -m engine $M mode=materialize out=/dev/shm/l4.safetensors hydra.run.dir=/tmp/m > /dev/null 2>&1
timeout 120 python3 -m engine $M budget=2000 mode=execute weights.file=/dev/shm/l4.safetensors hydra.run.dir=/tmp/e 2>&1 \
  | grep -E "^\| step|plain module|^error"
rm -f /dev/shm/l4.safetensors
