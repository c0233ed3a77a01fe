#!/bin/bash
# Session 10's last call: the row-fused T = 1 down kernel with the residual add in its epilogue (the model's and the
# bench chain's `residual`): tests/ops/test_moe.py compiled, the production bench (T = 1 profile; T = 2, 3 with a
# profile at T = 3), then the engine. Run on the GPU from the repo root: `bash experiments/gpu_s10_final.sh` (~9 min).
export PYTHONPATH=.:experiments
XLA_FLAGS=--xla_allow_excess_precision=false timeout 230 python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_moe.py 2>&1 | tail -2
timeout 130 python3 experiments/bench_moe.py --quick --iters 3 --ts 2,3 --profile-ts 3 2>&1 \
  | grep -E "^moe_layer|span|check |µs/layer" | head -40
cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s10_final.json" 2>/dev/null
echo "== engine"
timeout 200 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
  --repeats 2 --backends pallas --profile 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -30
cp experiments/results/bench_decode.json "${OUT:-/tmp}/bench_decode_s10_final.json" 2>/dev/null
