#!/usr/bin/env bash
# The benchmarks and the compiled kernel tests on a GPU machine, by suite (wheels the machine lacks, fla-core and
# einops for the fla comparisons, go in .whl/):   bash experiments/gpu.sh SUITE [SUITE...]
# Suites: tests engine decode moe moe_fp8 moe_fp8_ts moe_fp8_quick moe_tests kda mla spec prefill prefill_check fp8
# fp8_ops gemv_levers slices full flax crosscheck all.
# Each suite writes its log and results JSON into $OUT (default /tmp/out) and the JSON under its canonical name into
# experiments/results/ (what plot_results.py reads); the tail of every log is printed at the end. Every suite has
# its own timeout under the 600 s a device command may run; with several GPUs the suites run side by side, one
# lane per GPU, else one after another (then give a call one or two suites).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

suite_tests() {
  timeout 560 bash experiments/gpu_tests.sh -rf --tb=line -p no:cacheprovider
}
suite_engine() {  # the API checks and the engine's Pallas paths compiled; then TTFT after 1 vs 2 warm-ups
  timeout 300 python3 -m pytest -q -rf --tb=short -p no:cacheprovider tests/test_api_checks.py \
    tests/test_model.py -k "pallas or kernels"
  for w in 1 2; do
    echo "-- ling-jax generate --backend pallas --warmup $w"
    timeout 120 python3 -m ling_jax.cli generate --backend pallas --warmup "$w" --max-new-tokens 32 --block-size 8
  done
}
suite_decode() {  # the engine on the 6-layer exact-width Flash slice
  timeout 480 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 257 \
    --backends fast,reference --router-dtype bfloat16 --profile
}
suite_moe() {  # T = 1 in the model-like chain (an RMSNorm fusion between layers), then the T sweep, one file
  timeout 480 python3 experiments/bench_moe.py --quick --iters 1 --chain norm --layers 8 --router-dtype bfloat16 \
    --ts 1,2,3,4,6,9 --profile-ts 2,6
}
suite_kda() {  # compiled checks, then decode, verify and bf16 prefill against fla
  timeout 540 python3 experiments/bench_kda.py --sections check,decode,verify,prefill --prefill-dtypes bfloat16 \
    --budget 420
}
suite_spec() {  # the spec step against plain decode on the slice (oracle at planned accept lengths), then suffix timing
  timeout 480 python3 experiments/bench_spec.py --layers 6 --prompt-len 2048 --new-tokens 257 --ks 1,2,3,4,5,6,7,8 \
    --accepts 3:1,3:2,3:3.25,4:5 --profile-k 3 --backend fast --repeats 3
  timeout 60 python3 experiments/bench_suffix.py --time-propose 4096:5,4096:16,8192:5
}
suite_prefill() {  # the MoE and MLA prefill kernels with their tuning sweeps, then the slice's TTFT and profile
  timeout 170 python3 experiments/bench_moe_prefill.py --sweep
  timeout 150 python3 experiments/bench_mla_prefill.py --sweep --budget 110
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 250 python3 experiments/bench_prefill.py --layers 6 \
    --rows 2048:8192,8192:8192,8192:2048,32768:8192,32768:4096 --profile 8192:8192
}
suite_prefill_check() {  # the MoE layer and the slice with the tuned defaults, then the prefill tests compiled
  timeout 90 python3 experiments/bench_moe_prefill.py --ns 2048,8192 --no-xla
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 200 python3 experiments/bench_prefill.py --layers 6 \
    --rows 2048:8192,8192:8192,8192:2048,32768:8192,32768:4096 --profile 8192:8192
  JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS=--xla_allow_excess_precision=false timeout 200 \
    python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/ops/test_moe_grouped.py tests/ops/test_mla_prefill.py tests/test_prefill_chunked.py -k "not cli"
}
suite_fp8() {  # the FP8 kernels compiled (GEMV: both layouts, W8A8, TMA; MoE decode / verify / grouped prefill)
  XLA_FLAGS="--xla_allow_excess_precision=false" timeout 230 python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider tests/ops/test_gemv.py tests/ops/test_gemv_rows.py tests/ops/test_gemv_w8a8.py \
    tests/ops/test_gemv_tma.py tests/ops/test_moe.py tests/ops/test_moe_grouped.py -k "fp8 or rows or w8a8 or tma"
}
suite_gemv_levers() {  # the FP8 GEMV levers side by side on every fused shape at T = 1, 4, 16, then the rows sweep
  timeout 560 python3 experiments/bench_gemv.py --fp8 --levers --budget 430 --hard-limit 500
}
suite_fp8_ops() {  # the FP8 GEMV shapes with their tuning sweep, then the FP8 MoE layer's T = 1 sweep
  timeout 230 python3 experiments/bench_gemv.py --fp8 --sweep
  timeout 330 python3 experiments/bench_moe.py --fp8 --no-ts --chain norm --layers 8 --router-dtype bfloat16 --iters 1
}
suite_moe_fp8() {  # the FP8 MoE layer's T = 1 sweep (device time), then the bf16 layer beside it
  local t0=$SECONDS
  timeout 330 python3 experiments/bench_moe.py --fp8 --no-ts --chain norm --layers 8 --router-dtype bfloat16 --iters 1
  cp experiments/results/bench_moe_fp8.json "$OUT"/bench_moe_fp8_sweep.json
  timeout $((450 - SECONDS + t0)) python3 experiments/bench_moe.py --quick --ts 1,2,4,9 --profile-ts 2,4,9 \
    --chain norm --layers 8 --router-dtype bfloat16 --iters 1
  cp experiments/results/bench_moe.json "$OUT"/
}
suite_moe_fp8_ts() {  # the FP8 MoE layer at T = 2, 4, 9
  timeout 170 python3 experiments/bench_moe.py --fp8 --quick --ts 2,4,9 --profile-ts 2,4,9 \
    --chain norm --layers 8 --router-dtype bfloat16 --iters 1
  cp experiments/results/bench_moe_fp8.json "$OUT"/bench_moe_fp8_ts.json
}
suite_moe_tests() {  # the MoE decode / verify kernels and the router compiled, every tuning the tests name
  XLA_FLAGS="--xla_allow_excess_precision=false" timeout 200 python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider tests/ops/test_moe.py -k "pallas or fp8"
}
suite_moe_fp8_quick() {  # one call: the compiled FP8 MoE tests, the T = 1 down forms, the FP8 layer by T
  local t0=$SECONDS
  XLA_FLAGS="--xla_allow_excess_precision=false" timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/ops/test_moe.py -k "test_experts_pallas_fp8 or slots_last"
  timeout $((370 - SECONDS + t0)) python3 experiments/bench_moe.py --fp8 --no-ts --chain norm --layers 8 \
    --router-dtype bfloat16 --iters 1 \
    --experts-sweep "default;down_t1=fused,block_d=2,warps_down=1;block_d=32;down_t1=slots"
  cp experiments/results/bench_moe_fp8.json "$OUT"/bench_moe_fp8_sweep.json
  timeout $((540 - SECONDS + t0)) python3 experiments/bench_moe.py --fp8 --quick --ts 2,4,9 --profile-ts 2,4,9 \
    --chain norm --layers 8 --router-dtype bfloat16 --iters 1
  cp experiments/results/bench_moe_fp8.json "$OUT"/bench_moe_fp8_ts.json
}
suite_slices() {  # `ling-jax bench` on SGLang's workload, the 6-layer exact-width slice in FP8 and in bf16
  timeout 200 python3 -m ling_jax.cli bench --preset ling-3.0-flash --random-weights --dtype fp8 --layers 6 --profile \
    --results experiments/results/
  timeout 200 python3 -m ling_jax.cli bench --preset ling-3.0-flash --random-weights --dtype bfloat16 --layers 6 \
    --profile --results experiments/results/
  cp experiments/results/bench_ling-3.0-flash-6layers_*.json "$OUT"/
}
suite_full() {  # `ling-jax bench` on SGLang's workload: all 42 layers in FP8 on one GPU, the MTP layer loaded
  timeout 540 python3 -m ling_jax.cli bench --preset ling-3.0-flash --random-weights --dtype fp8 --profile \
    --results experiments/results/
  cp experiments/results/bench_ling-3.0-flash_fp8.json "$OUT"/
}
suite_flax() {  # the slice decoding through the Flax NNX module and through params, alternating in one run
  timeout 420 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 257 --backends fast \
    --router-dtype bfloat16 --flax
}
# `ling-jax crosscheck` on the exact-width 6-layer slice (random weights, official layout); bf16 and the fast ops
# unless CROSSCHECK_DTYPE / CROSSCHECK_BACKENDS say otherwise
suite_crosscheck() {
  timeout 240 python3 -c "from conversion.synthetic import write_synthetic; from ling_jax.bench import slice_config
write_synthetic('/tmp/slice6', slice_config(6), with_mtp=False, workers=8)" 2>&1 | tail -n 1
  local ids
  ids=$(python3 -c "import numpy as np; print(','.join(map(str, np.random.default_rng(0).integers(2, 157184, 70))))")
  for backend in ${CROSSCHECK_BACKENDS:-fast}; do
    timeout 360 python3 -m ling_jax.cli crosscheck --hf-dir /tmp/slice6 --dtype "${CROSSCHECK_DTYPE:-bfloat16}" \
      --prompt-ids "$ids" --decode-steps 4 --backend "$backend" --json \
      > "$OUT/crosscheck_slice6_${CROSSCHECK_DTYPE:-bfloat16}_$backend.json"
    echo "-- crosscheck --backend $backend: exit $?"
  done
}
suite_mla() {  # device time per call from the profiler, then bench_mla's compiled checks and slopes
  timeout 240 python3 experiments/profile_ops.py --ops mla_1k_t1,mla_1k_t6,mla_8k_t1,mla_8k_t6,mla_32k_t1,mla_32k_t6 \
    --backends pallas,reference --n 8 --json mla_profile.json
  timeout 300 python3 experiments/bench_mla.py --budget 200
}

SUITES="tests engine decode moe moe_fp8 moe_fp8_ts moe_fp8_quick moe_tests kda mla spec prefill prefill_check fp8 \
fp8_ops gemv_levers slices full flax crosscheck"
suites=()
for s in "$@"; do
  if [ "$s" = all ]; then
    suites+=(tests engine decode moe kda mla spec prefill)
  elif [[ " $SUITES " == *" $s "* ]]; then
    suites+=("$s")
  else
    echo "unknown suite '$s' ($SUITES all)"; exit 2
  fi
done
[ ${#suites[@]} -gt 0 ] || { sed -n 2,8p "$0"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "no fla-core wheel in .whl/: the fla comparisons and the tests that need fla will fail"
export PYTHONPATH=/tmp/site:$PWD

lane() {  # GPU, then its suites in order
  local gpu=$1; shift
  for s in "$@"; do
    echo "== $s on GPU $gpu"
    CUDA_VISIBLE_DEVICES=$gpu "suite_$s" > "$OUT/$s.log" 2>&1
    echo "== $s: exit $?" >> "$OUT/$s.log"
  done
}
n_gpu=$(nvidia-smi -L | wc -l)
n_gpu=$(( n_gpu < 1 ? 1 : (n_gpu > ${#suites[@]} ? ${#suites[@]} : n_gpu) ))
for ((g = 0; g < n_gpu; g++)); do
  mine=()
  for ((i = g; i < ${#suites[@]}; i += n_gpu)); do mine+=("${suites[i]}"); done
  lane "$g" "${mine[@]}" &
done
wait
for s in "${suites[@]}"; do
  echo; echo "==== $s (tail of $OUT/$s.log)"
  grep -v -E "^(WARNING|I0000|E0000)" "$OUT/$s.log" | tail -n 40
done
