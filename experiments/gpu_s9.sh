#!/bin/bash
# Session 9's call 6: the router's shared-expert L2 prefetch at T > 1 (verify), off (router.VERIFY_TUNING as is)
# and on (120 KiB chunks, as DECODE_TUNING), twice each: bench_moe.py's wall slopes at T = 2, 4, 6, 9 and the
# profiler's timeline spans at T = 2 and 6. Run on the GPU from the repo root: `bash experiments/gpu_s9.sh` (~8 min).
export PYTHONPATH=.:experiments
run() {  # label, --verify-router fields
  echo "== $1 ($2)"
  timeout 140 python3 experiments/bench_moe.py --quick --iters 3 --ts 2,4,6,9 --profile-ts 2,6 \
    --verify-router "$2" 2>&1 | grep -E "^moe_layer|span|check moe" | head -14
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s9c6_$1.json" 2>/dev/null
}
run off_a prefetch_chunk_bytes=0
run on_a prefetch_chunk_bytes=122880
run off_b prefetch_chunk_bytes=0
run on_b prefetch_chunk_bytes=122880
