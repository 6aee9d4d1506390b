# Why the two held-out LoRA steps ran slower than synthesized (call 3: AuraFlow -4.9%, Mochi -11.8%):
# each recorded (mode=record), then executed at call 3's budget from its own recording.
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; rm -f /dev/shm/*
rec() {  # model tokens budget timeout
  timeout $4 python3 benchmarks/module_train.py --model $1 --tokens $2 --budgets $3 --activations off --steps 4 \
    --override workload.text_tokens=256 --out $OUT/$1 2>&1 | grep -v "Warn\|warn" | grep -E "^\[|^\|" | tail -8
  rm -f /dev/shm/*; rm -rf $OUT/$1/record $OUT/$1/materialize
}
rec mochi_diffusers 6144 12000 330
rec auraflow_diffusers 4096 8000 230
