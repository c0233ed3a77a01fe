"""Pure-jnp projections of a few tokens and the greedy lm_head: the specification the Pallas kernels are tested
against.

Layout (ling_jax/params.py): dense projections are stored [in, out], so `w` is [K, N] (a [D, H, K] projection is
its [D, H·K] reshape, free on the contiguous array). `gemv` is `ling_jax.layers.linear.proj` for a [T, K] input:
the weight cast to x's dtype, fp32 accumulation at full precision, rounded once to the compute dtype; the optional
residual is added after that rounding, in the compute dtype, as a pre-norm block's `h + proj(x)`.

`greedy_head` is the model's head followed by greedy sampling: logits = x·w (fp32 accumulation) rounded to
`logits_dtype` (default x's dtype: the model's `proj(...).astype(float32)` rounds them so), widened to fp32, and
`jnp.argmax` over the vocabulary: the first maximum wins a tie, and a NaN counts as larger than any number.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _logits_f32(x, w):
    """x [T, K] · w [K, N] -> [T, N] fp32 accumulation (w cast to x's dtype first, as `proj` does)."""
    return lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=_HI)


def gemv(x, w, residual=None):
    """x [T, K], w [K, N] ([in, out]), residual None or [T, N] -> [T, N] in x's dtype."""
    y = _logits_f32(x, w).astype(x.dtype)
    return y if residual is None else residual + y


def greedy_logits(x, w, logits_dtype=None):
    """The logits greedy_head takes the argmax of: [T, V] fp32 holding values of `logits_dtype` (None: x's)."""
    dt = x.dtype if logits_dtype is None else jnp.dtype(logits_dtype)
    return _logits_f32(x, w).astype(dt).astype(jnp.float32)


def greedy_head(x, w, logits_dtype=None):
    """x [T, K], w [K, V] -> (ids [T] int32: the argmax of greedy_logits, max_logit [T] fp32: its value)."""
    logits = greedy_logits(x, w, logits_dtype)
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return ids, jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
