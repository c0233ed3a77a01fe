#!/bin/bash
# Session 6's call 4: the routed experts' L2 evict_first policy (experts.DECODE_TUNING.routed_eviction) in the
# production bench, off and on twice each (T = 1 profile only), then the engine with the new defaults.
# Run on the GPU from the repo root: `bash experiments/gpu_s6.sh` (about 6 minutes).
export PYTHONPATH=.:experiments
run() {  # label, --experts fields
  echo "== $1 ($2)"
  timeout 100 python3 experiments/bench_moe.py --quick --no-ts --iters 3 --experts "$2" 2>&1 \
    | grep -E "profile T=1|check|µs/layer" | head -12
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s6c4_$1.json" 2>/dev/null
}
run none_a routed_eviction=none
run first_a routed_eviction=evict_first
run none_b routed_eviction=none
run first_b routed_eviction=evict_first
echo "== engine"
timeout 270 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
  --repeats 2 --backends pallas --profile 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -40
cp experiments/results/bench_decode.json "${OUT:-/tmp}/bench_decode_s6c4.json" 2>/dev/null
