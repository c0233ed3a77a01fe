#!/bin/bash
# Session 10's call 1: the T = 1 down projection over whole W_down rows with the combine in the same launch, against
# the production layer (experiments/probe_moe_down_rows_fused.py). Run on the GPU from the repo root:
# `bash experiments/gpu_s10.sh` (~9 min).
export PYTHONPATH=.:experiments
timeout 570 python3 experiments/probe_moe_down_rows_fused.py --set s10c1 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
