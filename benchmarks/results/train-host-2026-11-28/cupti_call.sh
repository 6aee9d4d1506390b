# As run on the lent H100s (OUT: the device tool's output folder), from the repository root.
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
for i in 1 2; do
python benchmarks/results/train-host-2026-11-28/cupti.py default
TEARDOWN_CUPTI=1 python benchmarks/results/train-host-2026-11-28/cupti.py TEARDOWN_CUPTI=1
TEARDOWN_CUPTI=0 python benchmarks/results/train-host-2026-11-28/cupti.py TEARDOWN_CUPTI=0
done
python -c "import torch; print(torch.__version__)"
