# mode=execute on real modules, inference, on the GPU: the plain module's steps beside the offloaded
# ones (Llama-3.1-8B decode: all resident and at 8000, each from the recording the run makes first);
# then the CUDA tests.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -rf /dev/shm/*
T=$OUT
W=/dev/shm/llama8b.safetensors
python3 -m engine model=llama8b_hf mode=materialize out=$W hydra.run.dir=$T/mat > $T/mat.log 2>&1; echo "materialize rc=$?"
for B in null 8000; do
  timeout 200 python3 -m engine model=llama8b_hf workload=decode hardware=h200 budget=$B mode=execute \
    workload.steps=16 weights.file=$W hydra.run.dir=$T/exec-$B > $T/exec-$B.log 2>&1; echo "execute $B rc=$?"
  tail -40 $T/exec-$B.log | grep -E "^\||step|pace|plain" | head -30
done
rm -rf /dev/shm/*
timeout 280 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ -x 2>&1 | tail -5
