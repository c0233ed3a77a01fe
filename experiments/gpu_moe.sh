#!/usr/bin/env bash
# The MoE numbers of experiments/RESULTS.md ("MoE, session 3") in one device call. GPU 0: bench_moe.py (T = 1
# sweeps, T = 1..9 and 16, XLA reference, per-kernel profiles), then profile_ops.py's MoE rows. GPU 1: the MoE
# kernel tests compiled, the 6-layer engine with per-kernel-family profile, then the other kernel tests for the
# time left. On one GPU everything runs in sequence. Carry .whl (the fla-core wheel, for the KDA tests).
#   device run, kind nvidia-h200-x2, carry [".whl"]:  bash experiments/gpu_moe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=(python3 -m pytest -q -rf --tb=line -p no:cacheprovider)

bench() {
  timeout 420 python3 experiments/bench_moe.py > "$OUT/bench_moe.log" 2>&1
  timeout 60 python3 experiments/profile_ops.py --ops moe,moe6 --backends pallas,reference --n 10 \
    > "$OUT/moe_profile.log" 2>&1
}
checks_and_engine() {
  XLA_FLAGS="--xla_allow_excess_precision=false" timeout 150 "${TESTS[@]}" tests/ops/test_moe.py > "$OUT/pytest_moe.log" 2>&1
  timeout 200 python3 experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 129 --block-size 16 \
    --repeats 2 --backends pallas --profile --out "$OUT/bench_decode.json" > "$OUT/engine.log" 2>&1
  XLA_FLAGS="--xla_allow_excess_precision=false" timeout "${TEST_S:-150}" "${TESTS[@]}" tests/ops/test_mla.py \
    tests/ops/test_kda.py > "$OUT/pytest_other.log" 2>&1
}
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; bench) & (export CUDA_VISIBLE_DEVICES=1; checks_and_engine) & wait
else
  bench; checks_and_engine
fi
(cd "$OUT" && tar czf json.tgz *.json && rm -f *.json)
tail -n 45 "$OUT/bench_moe.log"; tail -n 25 "$OUT/moe_profile.log"; tail -n 5 "$OUT/pytest_moe.log"
tail -n 30 "$OUT/engine.log"; tail -n 8 "$OUT/pytest_other.log"
