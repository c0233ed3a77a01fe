#!/bin/bash
# Session 5's call 6: the experts' PDL trigger options in the production bench (T = 1 profile only): off and in
# the down kernel twice each, in gate/up + down once.
# Run on the GPU from the repo root: `bash experiments/gpu_s5_pdl.sh` (about 4 minutes).
source experiments/gpu_moe_t1.sh
run() { bench_moe_t1 bench_moe_s5c6_ "$@"; }
run none_a early_launch_down=false
run down_a early_launch_down=true
run both_a early_launch_gate_up=true,early_launch_down=true
run none_b early_launch_down=false
run down_b early_launch_down=true
