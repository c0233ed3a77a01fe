"""Interpret mode: Pallas kernels run compiled on a GPU and through the interpreter anywhere else."""

import jax


def interpret_mode() -> bool:
    return jax.default_backend() == "cpu"
