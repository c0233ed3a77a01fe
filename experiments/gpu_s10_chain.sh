#!/bin/bash
# Session 10's call 8: the T = 1 layer's span in three chains of bench_moe.py (--chain residual / stacked / direct;
# the residual chain was then the default, now `--chain add` is), to find the per-layer memcpy the residual chain
# showed in S10 7. Run on the GPU from the repo root (~3 min).
export PYTHONPATH=.:experiments
for c in residual stacked direct; do
  echo "== $c"
  timeout 75 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain $c 2>&1 \
    | grep -E "span|µs/layer" | head -8
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s10_chain_$c.json" 2>/dev/null
done
