#!/bin/bash
# Session 10: the T = 1 down projection over whole W_down rows with the combine in the same launch, against the
# production layer (experiments/probe_moe_down_rows_fused.py; set s10c1, s10c2, ...). Run on the GPU from the repo
# root: `bash experiments/gpu_s10.sh <set>` (~1 min per set).
export PYTHONPATH=.:experiments
for set in "$@"; do
  timeout 300 python3 experiments/probe_moe_down_rows_fused.py --set "$set" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
done
