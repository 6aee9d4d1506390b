set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,power.limit,clocks.max.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import torch;f,t=torch.cuda.mem_get_info();print('cuda total',t/1e9,'free',f/1e9)" | tee -a $OUT/gpu.txt
rm -f /dev/shm/*
F=/tmp/fm; mkdir -p $F
timeout 380 python3 benchmarks/full_models.py --models flux --budgets flux=8000,12000,16000,null --out $F 2>&1 | grep -v Warning | tail -40
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $F && tar czf $OUT/flux.tgz $(find . -name report.json -o -name "*.md" -o -name "*.jsonl.gz" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
G=/tmp/fm2; mkdir -p $G
timeout 150 python3 benchmarks/full_models.py --models llama8b --budgets llama8b=4000,8000,null --no-record --out $G 2>&1 | grep -v Warning | tail -20
pkill -f "python3 -m engine"; sleep 1; rm -f /dev/shm/full-*
(cd $G && tar czf $OUT/llama.tgz $(find . -name report.json -o -name "*.md" -o -name "*.jsonl.gz" -o -name "full_models.json" -o -name measured.json -o -name engine.log))
ls -la $OUT
