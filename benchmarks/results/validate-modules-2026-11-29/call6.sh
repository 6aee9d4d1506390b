#!/bin/bash
# The link probe in mode=validate's measurements, on the GPU: an 8-layer tiny Llama (transformers).
set -u
OUT=$1
python -m engine model=tiny_llama_hf model.module.config.num_hidden_layers=8 mode=materialize \
    out=/dev/shm/tiny.safetensors hydra.run.dir=$OUT/mat > $OUT/mat.log 2>&1
python -m engine model=tiny_llama_hf model.module.config.num_hidden_layers=8 mode=validate hardware=h200 \
    weights.file=/dev/shm/tiny.safetensors workload.text_tokens=16 hydra.run.dir=$OUT/validate > $OUT/validate.log 2>&1
echo "validate rc=$?"
grep -E "^- the link|^- (fit|held)|rror" $OUT/validate.log
python -c "import json; print(json.load(open('$OUT/validate/measurements.json'))['link'])"
rm -f /dev/shm/tiny.safetensors
