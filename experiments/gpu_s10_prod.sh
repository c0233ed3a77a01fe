#!/bin/bash
# Session 10: the T = 1 row-fused down kernel in production (W_down stored [E, D, I]): tests/ops/test_moe.py
# compiled, then the production bench (T = 1 profile, T = 2..9 with profiles at T = 2, 3, 4).
# Run on the GPU from the repo root: `bash experiments/gpu_s10_prod.sh <tag>` (~5 min).
export PYTHONPATH=.:experiments
XLA_FLAGS=--xla_allow_excess_precision=false timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_moe.py 2>&1 | tail -3
timeout 200 python3 experiments/bench_moe.py --quick --iters 3 --ts 2,3,4,6,9 --profile-ts 2,3,4 2>&1 \
  | grep -E "^moe_layer|span|check |µs/layer" | head -50
cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s10_$1.json" 2>/dev/null
