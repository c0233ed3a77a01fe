#!/bin/bash
# Session 8's call 8: tests/ops/test_moe.py compiled on the H200 (the router's L2 prefetch included), then the
# engine with it. Run on the GPU from the repo root: `bash experiments/gpu_s8_tests.sh` (~7 min).
export PYTHONPATH=.:experiments
XLA_FLAGS=--xla_allow_excess_precision=false timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_moe.py 2>&1 | tail -3
echo "== engine"
timeout 300 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
  --repeats 2 --backends pallas --profile 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -40
cp experiments/results/bench_decode.json "${OUT:-/tmp}/bench_decode_s8c8.json" 2>/dev/null
