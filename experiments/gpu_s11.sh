#!/bin/bash
# Session 11: the T = 1 experts kernels with their weight loads issued ahead of their math
# (experiments/probe_moe_down_inflight.py; sets s11c1, ...), then the production bench's direct chain when "bench"
# is among the arguments, and the compiled `tests/ops/test_moe.py` for "tests". Run on the GPU from the repo root:
# `bash experiments/gpu_s11.sh s11c1 bench` (~3 min), `bash experiments/gpu_s11.sh s11c2 tests` (~5 min);
# "prewait": experiments/probe_gemv_prewait.py's set s11c3 and its PTX report; "period": the production bench's
# direct chain at NL = 8 (twice) and 16 with its three per-layer measures (span / NL, from the first layer, the
# steady-state period).
export PYTHONPATH=.:experiments
for arg in "$@"; do
  if [ "$arg" = period ]; then  # span / NL and the steady-state period, NL = 8 twice and 16 once
    for nl in 8 8 16; do
      timeout 200 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain direct --layers $nl 2>&1 \
        | grep -E "profile T=1|µs/layer" | head -8
      cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s11_direct_nl${nl}_$((++run)).json" 2>/dev/null
    done
  elif [ "$arg" = prewait ]; then
    timeout 200 python3 experiments/probe_gemv_prewait.py --set s11c3 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
    cp experiments/results/probe_gemv_prewait_s11c3.json "${OUT:-/tmp}/" 2>/dev/null
    timeout 120 python3 experiments/probe_gemv_prewait.py --ptx /tmp/xla_dump_s11 2>&1 | grep -v "^WARNING\|^I0000" \
      | tail -40
  elif [ "$arg" = tests ]; then
    XLA_FLAGS=--xla_allow_excess_precision=false timeout 300 python3 -m pytest -q tests/ops/test_moe.py 2>&1 \
      | tee "${OUT:-/tmp}/pytest_moe_s11.log" | tail -5
  elif [ "$arg" = bench ]; then
    timeout 120 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain direct 2>&1 \
      | grep -E "span|µs/layer|T1|experts_fwd|router_fwd" | head -12
    cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s11_direct.json" 2>/dev/null
  else
    timeout 300 python3 experiments/probe_moe_down_inflight.py --set "$arg" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
    cp "experiments/results/probe_moe_down_inflight_$arg.json" "${OUT:-/tmp}/" 2>/dev/null
  fi
done
