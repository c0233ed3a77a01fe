#!/bin/bash
# Session 9's call 10: the MoE layer at T = 2..9 with the T > 1 gate/up as per-token FMA programs
# (experts.ExpertsTuning.verify_gate_up="fma_tokens": the T = 1 path's 2-row 1-warp programs, each weight tile read
# once for all T tokens) against experts.VERIFY_TUNING's tensor-core dots over 16 padded rows.
# Run on the GPU from the repo root: `bash experiments/gpu_s9_verify.sh` (~5 min).
export PYTHONPATH=.:experiments
run() {  # label, --verify-experts fields
  echo "== $1 ($2)"
  timeout 120 python3 experiments/bench_moe.py --quick --iters 3 --ts 2,3,4,6,8,9 --profile-ts 2,4,8 \
    --verify-experts "$2" 2>&1 | grep -E "^moe_layer|span|check moe" | head -16
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s9c10_$1.json" 2>/dev/null
}
run dot "verify_gate_up=dot"
run fma512 "verify_gate_up=fma_tokens,block_i=2,warps_gate_up=1,block_k=512,routed_eviction=evict_first"
run fma256 "verify_gate_up=fma_tokens,block_i=2,warps_gate_up=1,block_k=256,routed_eviction=evict_first"
