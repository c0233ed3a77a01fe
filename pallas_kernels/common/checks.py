"""Validation helpers shared by the op dispatchers: each raises ValueError naming the value and the expectation."""

from __future__ import annotations

import jax.numpy as jnp

BACKENDS = ("reference", "pallas")
COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")


def check_rank(name, a, rank, layout):
    if a.ndim != rank:
        raise ValueError(f"{name}.shape={tuple(a.shape)} must be {layout}")


def check_dtype(name, a, allowed):
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(a.dtype) not in allowed:
        raise ValueError(f"{name}.dtype={jnp.dtype(a.dtype)} must be one of {[str(d) for d in allowed]}")


def check_shape(name, a, expected, layout):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name}.shape={tuple(a.shape)} must be {layout} = {tuple(expected)}")
