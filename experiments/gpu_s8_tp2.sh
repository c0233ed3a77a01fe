#!/bin/bash
# Session 8's call 9, on nvidia-h200-x2: the TP2 Pallas test compiled on two GPUs (fp32 toy model, sharded logits
# against one device's), then the engine's 6-layer Flash slice with its weights sharded two ways.
# Run on the GPU machine from the repo root: `bash experiments/gpu_s8_tp2.sh` (~6 min).
export PYTHONPATH=.:experiments
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS=--xla_allow_excess_precision=false timeout 150 \
  python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py 2>&1 | tail -3
echo "== engine, TP2"
timeout 330 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
  --repeats 2 --backends pallas --tp 2 --out experiments/results/bench_decode_tp2.json 2>&1 \
  | grep -v "^WARNING\|^I0000\|^E0000" | tail -8
cp experiments/results/bench_decode_tp2.json "${OUT:-/tmp}/bench_decode_tp2_s8c9.json" 2>/dev/null
