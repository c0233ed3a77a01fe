#!/bin/bash
# Session 12: the T = 1 MoE layer with the router held in bf16, as the BF16 release stores it. Run on the GPU from
# the repo root, arguments in order:
#   s12c1, s12c2        experiments/probe_router_bf16.py --set ... (fp32 / bf16 router, bf16 GEMV tunings, ~80 s)
#   bench16 / bench32   the production bench's direct chain, NL = 8, with bf16 / fp32 routers (~60 s each);
#                       bench16:FIELDS passes `--router FIELDS` (e.g. bench16:block_e=2)
#   period16            bench16 with the default tunings at NL = 8, 8 and 16 (~3 min)
#   norm16, norm32, direct16   the "norm" chain (the model's case: an XLA fusion before every layer) with bf16 /
#                       fp32 routers, the direct chain with bf16 ones; NL = 8 (~60 s each)
#   tests_router        compiled tests/ops/test_moe.py -k route (~60 s); tests: the whole file (~190 s)
export PYTHONPATH=.:experiments
for arg in "$@"; do
  case "$arg" in
    s12c*)
      timeout 200 python3 experiments/probe_router_bf16.py --set "$arg" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
      cp "experiments/results/probe_router_bf16_$arg.json" "${OUT:-/tmp}/probe_router_bf16_${arg}_$((++run)).json" ;;
    bench16*|bench32*)
      dt=$([ "${arg:0:7}" = bench16 ] && echo bfloat16 || echo float32)
      fields=$([ "${arg#*:}" != "$arg" ] && echo "${arg#*:}")
      timeout 200 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain direct --layers 8 \
        --router-dtype $dt --router "$fields" 2>&1 | grep -E "profile T=1|µs/layer|check router" | head -8
      cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s12_${dt}_$((++run)).json" ;;
    period16)  # the default tuning by router dtype (bf16: DECODE_TUNING_BF16), NL = 8 twice and 16 once
      for nl in 8 8 16; do
        timeout 200 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain direct --layers $nl \
          --router-dtype bfloat16 2>&1 | grep -E "profile T=1|µs/layer" | head -6
        cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s12_period16_nl${nl}_$((++run)).json"
      done ;;
    norm16|norm32|direct16)  # the "norm" chain (an XLA RMSNorm fusion before every layer, as in the model), NL = 8
      dt=$([ "${arg: -2}" = 16 ] && echo bfloat16 || echo float32)
      chain=$([ "${arg:0:4}" = norm ] && echo norm || echo direct)
      timeout 200 python3 experiments/bench_moe.py --quick --no-ts --iters 1 --chain $chain --layers 8 \
        --router-dtype $dt 2>&1 | grep -E "profile T=1|µs/layer" | head -8
      cp experiments/results/bench_moe.json "${OUT:-/tmp}/bench_moe_s12_${chain}_${dt}_$((++run)).json" ;;
    tests_router)
      XLA_FLAGS=--xla_allow_excess_precision=false timeout 200 python3 -m pytest -q tests/ops/test_moe.py -k route \
        2>&1 | tee "${OUT:-/tmp}/pytest_moe_route_s12.log" | tail -4 ;;
    tests)
      XLA_FLAGS=--xla_allow_excess_precision=false timeout 300 python3 -m pytest -q tests/ops/test_moe.py 2>&1 \
        | tee "${OUT:-/tmp}/pytest_moe_s12.log" | tail -4 ;;
  esac
done
