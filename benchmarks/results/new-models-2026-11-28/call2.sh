# Why SD3.5 Large's offloaded output is not bitwise its plain module's (call 1: max diff 2.46 at
# every budget), then Qwen2.5-14B decode recorded and measured at all resident, 8000, 16000.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
rm -f /dev/shm/*
T=/tmp/nm; mkdir -p $T
timeout 240 python3 benchmarks/bitwise_probe.py --model sd35_large --steps 6 --budgets 0,8000 > $T/probe.log 2>&1
echo "probe rc=$?"; grep -v "materialize" $T/probe.log | tail -16
rm -f /dev/shm/*
timeout 300 python3 benchmarks/real_models.py --models qwen25_14b --budgets 0,8000,16000 --evictions priority \
  --lookahead 2 --hardware h200 --steps 16 --dir /dev/shm --out $T/qwen > $T/qwen.log 2>&1; echo "real_models rc=$?"
grep -v "materialize" $T/qwen.log | tail -12
rm -f /dev/shm/*
tar czf $OUT/nm2.tgz -C $T .
