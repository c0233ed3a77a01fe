#!/bin/bash
# Session 6's call 4: the routed experts' L2 evict_first policy (experts.DECODE_TUNING.routed_eviction) in the
# production bench, off and on twice each (T = 1 profile only), then the engine with the new defaults.
# Run on the GPU from the repo root: `bash experiments/gpu_s6.sh` (about 6 minutes).
source experiments/gpu_moe_t1.sh
run() { bench_moe_t1 bench_moe_s6c4_ "$@"; }
run none_a routed_eviction=none
run first_a routed_eviction=evict_first
run none_b routed_eviction=none
run first_b routed_eviction=evict_first
echo "== engine"
timeout 270 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
  --repeats 2 --backends pallas --profile 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -40
cp experiments/results/bench_decode.json "${OUT:-/tmp}/bench_decode_s6c4.json" 2>/dev/null
