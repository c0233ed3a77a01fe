"""Pure-jnp projections of a few tokens and the greedy lm_head: the specification the Pallas kernels are tested
against.

Layout (ling_jax/params.py): dense projections are stored [in, out], so `w` is [K, N] (a [D, H, K] projection is
its [D, H·K] reshape, free on the contiguous array). `gemv` is `ling_jax.layers.linear.proj` for a [T, K] input:
the weight cast to x's dtype, fp32 accumulation at full precision, rounded once to the compute dtype; the optional
residual is added after that rounding, in the compute dtype, as a pre-norm block's `h + proj(x)`.

An FP8 weight (`fp8.Fp8Weight`, layout IN_OUT: E4M3 q [K, N], fp32 scale [ceil(K/128), N]; or ROWS: q [N, K],
scale [N, ceil(K/128)], transposed after dequantising) is dequantised in float32 (`fp8.dequantize(w, float32)`:
q·scale, never rounded to the compute dtype) and multiplied by x widened to float32, at full precision with fp32
accumulation; then the path above (one rounding of the output to x's dtype, the residual after it; a norm first,
with its roundings in x's dtype). The Pallas kernels compute the same sums, scale · (sum over a 128-wide block of
x[k]·q[k, n]), so they equal this up to fp32 rounding and summation order.

`norm=(weight, eps)` makes the input `rms_norm(x, weight, eps)` first, with `ling_jax.layers.norms.rms_norm`'s
roundings: normalised in fp32, rounded to x's dtype, then times the weight cast to x's dtype (a compute-dtype
multiply, rounded again): the RMSNorm that precedes every projection reading a block's input.

`greedy_head` is the model's head followed by greedy sampling: logits = x·w (fp32 accumulation) rounded to
`logits_dtype` (default x's dtype: the model's `proj(...).astype(float32)` rounds them so), widened to fp32, and
`jnp.argmax` over the vocabulary: the first maximum wins a tie, and a NaN counts as larger than any number.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import fp8

_HI = lax.Precision.HIGHEST


def rms_norm(x, weight, eps):
    """`ling_jax.layers.norms.rms_norm`, restated so that pallas_kernels does not import the model: x [T, K],
    weight [K] any float dtype -> [T, K] in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _normed(x, norm):
    return x if norm is None else rms_norm(x, *norm)


def _logits_f32(x, w):
    """x [T, K] · w [K, N] -> [T, N] fp32 accumulation (w cast to x's dtype first, as `proj` does)."""
    return lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=_HI)


def gemv(x, w, residual=None, *, norm=None):
    """x [T, K], w [K, N] ([in, out]; or an IN_OUT Fp8Weight of that shape, or a ROWS one [N, K]), residual None or
    [T, N], norm None or (weight [K], eps) -> [T, N] in x's dtype."""
    xn = _normed(x, norm)
    if isinstance(w, fp8.Fp8Weight):
        y = _logits_f32(xn.astype(jnp.float32), fp8.as_in_out(w, jnp.float32)).astype(x.dtype)
    else:
        y = _logits_f32(xn, w).astype(x.dtype)
    return y if residual is None else residual + y


def greedy_logits(x, w, logits_dtype=None, *, norm=None):
    """The logits greedy_head takes the argmax of: [T, V] fp32 holding values of `logits_dtype` (None: x's)."""
    dt = x.dtype if logits_dtype is None else jnp.dtype(logits_dtype)
    return _logits_f32(_normed(x, norm), w).astype(dt).astype(jnp.float32)


def greedy_head(x, w, logits_dtype=None, *, norm=None):
    """x [T, K], w [K, V], norm None or (weight [K], eps) -> (ids [T] int32: the argmax of greedy_logits,
    max_logit [T] fp32: its value)."""
    logits = greedy_logits(x, w, logits_dtype, norm=norm)
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return ids, jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
