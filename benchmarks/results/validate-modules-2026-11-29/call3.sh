#!/bin/bash
# pytest -m cuda on this code, then Llama-3.1-8B (transformers) decode validated from its
# config alone (a 4096-token KV cache; the all-resident row is the host's).
set -u
OUT=$1
timeout 330 python -m pytest -q -p no:cacheprovider -m cuda tests/ > $OUT/pytest-cuda.log 2>&1
echo "pytest -m cuda rc=$?: $(tail -1 $OUT/pytest-cuda.log)"
timeout 230 bash benchmarks/results/validate-modules-2026-11-29/call1.sh $OUT llama8b_hf:workload=decode
