#!/bin/bash
# Session 8's call 6: the production MoE bench at T = 1 with the top-k launch's L2 prefetch of the shared expert
# (router.DECODE_TUNING.prefetch_chunk_bytes = 120 KiB) against the same code with it off, twice each, then the
# prefetch with an evict_last policy. Run on the GPU from the repo root: `bash experiments/gpu_s8.sh` (~5 min).
export PYTHONPATH=.:experiments
run() {  # label, --router fields
  echo "== $1 ($2)"
  timeout 110 python3 experiments/bench_moe.py --quick --no-ts --iters 3 --router "$2" 2>&1 \
    | grep -E "profile T=1|check|µs/layer|span" | head -14
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s8c6_$1.json" 2>/dev/null
}
run off_a prefetch_chunk_bytes=0
run on_a ""
run off_b prefetch_chunk_bytes=0
run on_b ""
run last prefetch_evict_last=true
