# Sourced by the session scripts (gpu_s5_pdl.sh, gpu_s6.sh): one T = 1 run of the production MoE bench with the
# given experts-tuning fields, its device-time lines printed and its JSON kept as $OUT/<prefix><label>.json.
export PYTHONPATH=.:experiments
bench_moe_t1() {  # prefix, label, --experts fields
  echo "== $2 ($3)"
  timeout 100 python3 experiments/bench_moe.py --quick --no-ts --iters 3 --experts "$3" 2>&1 \
    | grep -E "profile T=1|check|µs/layer" | head -12
  cp experiments/results/bench_moe.json "${OUT:-/tmp}/$1$2.json" 2>/dev/null
}
