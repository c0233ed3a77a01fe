"""Helpers shared by the ops in `pallas_kernels/`."""

from pallas_kernels.common.checks import BACKENDS, COMPUTE_DTYPES, check_backend, check_dtype, check_rank, check_shape
from pallas_kernels.common.interpret import interpret_mode

__all__ = ["BACKENDS", "COMPUTE_DTYPES", "check_backend", "check_dtype", "check_rank", "check_shape", "interpret_mode"]
