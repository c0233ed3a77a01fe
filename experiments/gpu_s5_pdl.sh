#!/bin/bash
# Session 5's call 6: the experts' PDL trigger options in the production bench (T = 1 profile only): off and in
# the down kernel twice each, in gate/up + down once.
# Run on the GPU from the repo root: `bash experiments/gpu_s5_pdl.sh` (about 4 minutes).
export PYTHONPATH=.:experiments
run() {  # label, --experts fields
  echo "== $1 ($2)"
  timeout 100 python3 experiments/bench_moe.py --quick --no-ts --iters 3 --experts "$2" 2>&1 \
    | grep -E "profile T=1|check|µs/layer" | head -12
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s5c6_$1.json" 2>/dev/null
}
run none_a early_launch_down=false
run down_a early_launch_down=true
run both_a early_launch_gate_up=true,early_launch_down=true
run none_b early_launch_down=false
run down_b early_launch_down=true
