#!/usr/bin/env bash
# Every kernel benchmark of experiments/RESULTS.md in one device call. On a 2-GPU machine the KDA benches run on
# GPU 0 while MoE and MLA run on GPU 1 (separate processes, no shared GPU); on one GPU they run one after another.
# Carry .whl (the fla-core wheel, for fla's kernels). Logs and JSON land in $OUT (and experiments/results/).
#   device run, kind nvidia-h200-x2, carry [".whl"]:  bash experiments/gpu_bench_kernels.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
n_gpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv

kda() {
  # Decode/verify (compiled checks first), then prefill (fla's chunk_kda was timed in an earlier lease:
  # --no-fla keeps this call inside its time; see RESULTS.md).
  timeout 170 python3 experiments/bench_kda.py --sections check_default,check_quick,decode,verify --budget 135 \
    > "$OUT/kda_rec.log" 2>&1
  cp "$OUT/kda_bench.json" "$OUT/kda_rec.json"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 python3 experiments/bench_kda.py --sections prefill \
    --prefill-dtypes bfloat16 --prefill-configs 9 --no-fla --budget 115 > "$OUT/kda_prefill.log" 2>&1
  mv "$OUT/kda_bench.json" "$OUT/kda_prefill.json"
}
moe_mla() {
  timeout 170 python3 experiments/bench_moe.py > "$OUT/moe.log" 2>&1
  timeout 170 python3 experiments/bench_mla.py > "$OUT/mla.log" 2>&1
}
if [ "$n_gpu" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; kda) & (export CUDA_VISIBLE_DEVICES=1; moe_mla) & wait
else
  kda; moe_mla
fi
tail -n 25 "$OUT"/kda_rec.log "$OUT"/kda_prefill.log "$OUT"/moe.log "$OUT"/mla.log
