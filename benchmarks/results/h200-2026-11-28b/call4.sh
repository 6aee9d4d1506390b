# Two H200s of one host: what their copies share (conf/node/h200x2.yaml), and two replicas
# of the diffusers LTX-2 at 16000, alone and at once.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
nvidia-smi topo -m > $OUT/topo.txt 2>&1
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv >> $OUT/topo.txt
grep MemTotal /proc/meminfo >> $OUT/topo.txt
timeout 120 python3 benchmarks/node_probe.py --gib 4 --repeats 3 2>&1 | grep -v Warning | tee $OUT/node_probe.txt | tail -14
N=/tmp/nr; mkdir -p $N
timeout 300 python3 benchmarks/node_replicas.py --model ltx2 --budget 16000 --out $N 2>&1 | grep -v Warning | tail -14
rm -f /dev/shm/*
(cd $N && tar czf $OUT/replicas.tgz $(find . -type f))
ls -la $OUT
