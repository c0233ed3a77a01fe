#!/bin/bash
# Session 6's call 7: the engine's T = 1 experts kernels (20.2 / 13.0 µs per layer in S6 4, against 18.5 / 11.1 in
# the MoE chain) with XLA's command buffers (CUDA graphs) on (default) and off.
# Run on the GPU from the repo root: `bash experiments/gpu_s6_engine.sh` (about 4 minutes).
export PYTHONPATH=.:experiments
for mode in default no_cmd_buffer; do
  echo "== $mode"
  flags=""
  [ "$mode" = no_cmd_buffer ] && flags="--xla_gpu_enable_command_buffer="
  XLA_FLAGS="$flags" timeout 250 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 65 \
    --block-size 16 --repeats 2 --backends pallas --profile --out "${OUT:-/tmp}/bench_decode_s6c7_$mode.json" 2>&1 \
    | grep -E "experts|router|profile|tpot_us|^pallas" | head -12
done
