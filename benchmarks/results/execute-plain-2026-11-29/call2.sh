# mode=execute on Llama-3.1-8B after the outcomes change: decode at 8000 (call 1 read "False": its
# plain steps give more than one output), prefill of 4096 tokens (1.05 GB of logits a step) at 8000
# and all resident, for the process peak with the outputs no longer kept.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=$OUT
W=/dev/shm/llama8b.safetensors
python3 -m engine model=llama8b_hf mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
run() {  # NAME ARGS...
  local name=$1; shift
  timeout 200 python3 -m engine model=llama8b_hf hardware=h200 mode=execute weights.file=$W hydra.run.dir=$T/$name "$@" \
    > $T/$name.log 2>&1; echo "$name rc=$?"
  grep -E "^\| (step time|peak|H2D)|measured steps|bitwise" $T/$name.log
}
run decode-8000 workload=decode budget=8000 workload.steps=16
run prefill-8000 workload.text_tokens=4096 budget=8000 workload.steps=8
run prefill-null workload.text_tokens=4096 budget=null workload.steps=8
rm -rf /dev/shm/*
