#!/bin/bash
# Session 10: tests/ops/test_moe.py compiled on the H200 (the T = 2 per-token FMA default's first compiled check),
# then the T = 3 A/B of the FMA gate/up against the dots by device time (session 9 timed T = 3 by wall only).
# Run on the GPU from the repo root: `bash experiments/gpu_s10_checks.sh` (~6 min).
export PYTHONPATH=.:experiments
XLA_FLAGS=--xla_allow_excess_precision=false timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_moe.py 2>&1 | tail -3
run() {  # label, --verify-experts fields
  echo "== $1 ($2)"
  timeout 110 python3 experiments/bench_moe.py --quick --iters 3 --ts 2,3 --profile-ts 2,3 \
    --verify-experts "$2" 2>&1 | grep -E "^moe_layer|span|check moe" | head -16
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s10_$1.json" 2>/dev/null
}
run dot "verify_gate_up=dot"
run fma "verify_gate_up=fma_tokens,block_i=2,warps_gate_up=1,block_k=256,routed_eviction=evict_first"
