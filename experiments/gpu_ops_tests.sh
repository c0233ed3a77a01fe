#!/usr/bin/env bash
# The kernel test suite, compiled, on a GPU machine (the device tool): the same files CI runs in interpret mode.
# fla-core is not on the GPU image: carry its wheel (README of the device tool) as .whl/fla_core-0.6.0-*.whl.
#   device run, carry [".whl"]:  bash experiments/gpu_ops_tests.sh [pytest args]
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import jax; assert jax.default_backend() == "gpu", jax.default_backend()'
python3 -m pytest -q tests/ops "$@"
