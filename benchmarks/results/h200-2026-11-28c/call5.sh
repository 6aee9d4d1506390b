# The diffusers LTX-2 LoRA step's synthesized trace as the GPU machine's packages build it (meta
# device, no GPU work), to set beside the one this project's CPU machine builds.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers, transformers, peft, accelerate; print(torch.__version__, diffusers.__version__, transformers.__version__, peft.__version__, accelerate.__version__)"
timeout 200 python3 - <<PY
import sys; sys.path.insert(0, "benchmarks")
import module_train
from pathlib import Path
module_train.synthesized(Path("$OUT/ltx2-diffusers-train-synth.jsonl"), "model=ltx2_diffusers workload=train_lora workload.checkpointing=true workload.steps=4 hardware=h200".split())
PY
gzip $OUT/ltx2-diffusers-train-synth.jsonl
ls -la $OUT
