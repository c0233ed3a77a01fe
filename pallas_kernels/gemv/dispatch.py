"""Public projection entry points: validate shapes and dtypes, then run the chosen backend (never a silent fallback).

`backend="reference"` runs `reference.py` (pure jnp, any T). `backend="pallas"` runs the Pallas-Triton kernels of
`kernel.py` (compiled on a GPU, interpreted on CPU) for 1 <= T <= kernel.MAX_TOKENS tokens and K divisible by 16;
anything else is an error naming the limit. `gemv` also takes a block-FP8 weight (`fp8.Fp8Weight`): layout IN_OUT
(q [K, N], kernel.py) or ROWS (q [N, K], the rows kernel of rows.py); `greedy_head` does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import COMPUTE_DTYPES, check_backend, check_dtype, check_rank, check_shape, fp8
from pallas_kernels.common.norm import GroupRMS
from pallas_kernels.gemv import reference


def _check_inputs(x, w, out_letter):
    """x [T, K] compute dtype, w [K, out] in x's dtype or an IN_OUT Fp8Weight (or a ROWS one, [out, K]) -> (T, K,
    out)."""
    check_rank("x", x, 2, "[T, K]")
    check_dtype("x", x, COMPUTE_DTYPES)
    is_fp8 = isinstance(w, fp8.Fp8Weight)
    if is_fp8:  # first: the shape hints below are for plain arrays
        _check_fp8_weight(w)
    t, k = x.shape
    if is_fp8 and w.layout == fp8.ROWS:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"w.shape={tuple(w.shape)} must be [{out_letter}, K] (a {fp8.ROWS} weight: [out, in]) "
                             f"with K = x.shape[1] = {k}")
        return t, k, w.shape[0]
    layout = f"[K, {out_letter}]"
    if w.ndim != 2:
        raise ValueError(f"w.shape={tuple(w.shape)} must be {layout} (a [D, H, Dh] projection: reshape it to "
                         "[D, H·Dh], free on the contiguous array)")
    if w.shape[0] != k:
        hint = (" (torch's [out, in] layout: ling-jax stores projections [in, out], pass w.T)"
                if w.shape[1] == k and not is_fp8 else "")
        raise ValueError(f"w.shape={tuple(w.shape)} must be {layout} ([in, out]) with K = x.shape[1] = {k}{hint}")
    if not is_fp8:
        check_dtype("w", w, (x.dtype,))
    return t, k, w.shape[1]


def _check_fp8_weight(w):
    """An IN_OUT or ROWS Fp8Weight with one input axis, E4M3 values and its float32 scales ([ceil(K/128), N] or
    [N, ceil(K/128)])."""
    if w.layout in (fp8.IN_OUT, fp8.ROWS) and w.n_in != 1:
        shape = "[K, N]" if w.layout == fp8.IN_OUT else "[N, K]"
        raise ValueError(f"w.n_in={w.n_in} must be 1: the GEMV takes an Fp8Weight of one input axis, q {shape} "
                         f"(quantize the {shape} weight with n_in=1)")
    fp8.check_fp8("w", w, (fp8.IN_OUT, fp8.ROWS))


def _check_norm(norm, k):
    """None, or the (weight [K] any float dtype, eps a positive float) of the RMSNorm before the projection."""
    if norm is None:
        return
    if not isinstance(norm, (tuple, list)) or len(norm) != 2:
        raise ValueError(f"norm (a {type(norm).__name__}) must be None or a (weight [K], eps) pair")
    weight, eps = norm
    shape, dtype = tuple(getattr(weight, "shape", ())), getattr(weight, "dtype", None)
    if shape != (k,):
        raise ValueError(f"norm weight.shape={shape} must be [K] = ({k},): one scale per column of x")
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"norm weight.dtype={dtype} must be a float dtype")
    if isinstance(eps, bool) or not isinstance(eps, (float, np.floating)) or not 0 < eps < float("inf"):
        raise ValueError(f"norm eps={eps!r} must be a positive finite Python float (the kernel compiles it in), "
                         "e.g. the config's rms_norm_eps")


def _as_compute_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in COMPUTE_DTYPES:
        raise ValueError(f"logits_dtype={dtype!r} must be None (x's dtype) or one of "
                         f"{[str(d) for d in COMPUTE_DTYPES]}")
    return dt


def _check_pallas(t, k, n, w=None):
    """The kernel module for w (rows.py for a ROWS weight, else kernel.py) after checking its size limits."""
    from pallas_kernels.gemv import kernel, rows

    is_rows = isinstance(w, fp8.Fp8Weight) and w.layout == fp8.ROWS
    kernel.check_sizes(t, k, n, "w.shape[1]" if is_rows else "w.shape[0]")
    return rows if is_rows else kernel


def gemv(x, w, residual=None, *, norm=None, backend="reference"):
    """y = x·w (fp32 accumulation, rounded once to the compute dtype), plus `residual` after the rounding.

    Args:
      x: [T, K] compute dtype (float32 or bfloat16).
      w: [K, N] in x's dtype: the [in, out] layout ling-jax stores float projections in (ling_jax/params.py); or
        an `fp8.Fp8Weight` (n_in 1) of layout ROWS, ling-jax's block-FP8 projections: q [N, K] float8_e4m3fn,
        scale [N, ceil(K/128)] float32 (rows.py's kernel), or of layout IN_OUT: q [K, N], scale [ceil(K/128), N]
        (kernel.py's); dequantised in float32 and multiplied by x in float32 (never rounded to x's dtype; the
        Pallas kernels apply each 128-wide block's scale to its fp32 partial sums, reading half the weight bytes).
      residual: optional [T, N] in x's dtype, added last (a pre-norm block's h + proj(x)); the Pallas kernel adds it
        in its epilogue.
      norm: None, or (weight [K] any float dtype, eps a positive Python float): the input is first
        `ling_jax.layers.norms.rms_norm(x, weight, eps)`, its roundings exactly; the Pallas kernel does the norm in
        a prologue, saving the norm's own launch.
      backend: "reference" | "pallas" (1 <= T <= kernel.MAX_TOKENS, K % 16 == 0).
    x may also be a `pallas_kernels.common.norm.GroupRMS` (values [T, K] float32, sum_sq [T, G, P]; no `norm`):
    the projection of `x.apply()`, which the kernels apply in their prologue at T = 1 (`rows.takes_group_rms`,
    `kernel.takes_group_rms`), saving the scaling's own launch; elsewhere XLA applies it first.
    Returns:
      [T, N] in x's dtype; `ling_jax.layers.linear.proj("td,dn->tn", x, w)` (+ residual) for the reference with a
      plain weight.
    """
    check_backend(backend)
    grouped = isinstance(x, GroupRMS)
    if grouped:
        _check_group_rms(x, norm)
    t, k, n = _check_inputs(jax.ShapeDtypeStruct(x.values.shape, x.dtype) if grouped else x, w, "N")
    if residual is not None:
        check_shape("residual", residual, (t, n), "[T, N]")
        check_dtype("residual", residual, (x.dtype,))
    _check_norm(norm, k)
    if backend == "reference":
        return reference.gemv(x.apply() if grouped else x, w, residual, norm=norm)
    return _check_pallas(t, k, n, w).gemv(x, w, residual, norm=norm)


def _check_group_rms(x, norm):
    """A GroupRMS x: values float32 [T, K], sum_sq float32 [T, G, P] with G dividing K, a compute dtype, no norm."""
    check_rank("x.values", x.values, 2, "[T, K]")
    check_dtype("x.values", x.values, (jnp.float32,))
    check_rank("x.sum_sq", x.sum_sq, 3, "[T, G, P]")
    check_dtype("x.sum_sq", x.sum_sq, (jnp.float32,))
    t, k = x.values.shape
    if x.sum_sq.shape[0] != t or k % x.sum_sq.shape[1]:
        raise ValueError(f"x.sum_sq.shape={tuple(x.sum_sq.shape)} must be [T, G, P] with T = {t} and G dividing "
                         f"K = {k} (groups of K/G columns)")
    try:
        dtype = jnp.dtype(x.dtype)
    except TypeError:
        dtype = None
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"x.dtype={x.dtype!r} must name a compute dtype {[str(d) for d in COMPUTE_DTYPES]}")
    if isinstance(x.eps, bool) or not isinstance(x.eps, (float, np.floating)) or not 0 < x.eps < float("inf"):
        raise ValueError(f"x.eps={x.eps!r} must be a positive finite Python float (the kernel compiles it in)")
    if norm is not None:
        raise ValueError("a GroupRMS x carries its own norm: pass norm=None")


def greedy_head(x, w, *, norm=None, logits_dtype=None, backend="reference"):
    """Greedy next tokens from the lm_head: argmax over the vocabulary of x·w, without materialising the logits.

    Args:
      x: [T, K] compute dtype: the final-normed hidden states, or the hidden states before that norm with `norm`.
      w: [K, V] in x's dtype (the lm_head as ling-jax stores it, [D, V]); not an Fp8Weight.
      norm: None, or (weight [K], eps) of the model's final norm, applied first as in `gemv`.
      logits_dtype: the dtype the fp32 sums are rounded to before the argmax; None: x's dtype, which is what the
        model's logits hold (`proj` rounds them to the compute dtype before widening to fp32), so the ids are the
        model's greedy tokens; float32: the unrounded sums.
      backend: "reference" | "pallas" (1 <= T <= kernel.MAX_TOKENS, K % 16 == 0).
    Returns:
      ids [T] int32: `jnp.argmax` over the logits (the lowest index among equal maxima; a NaN counts as the
      largest); max_logit [T] float32: the logit at that index.
    """
    check_backend(backend)
    if isinstance(w, fp8.Fp8Weight):
        raise ValueError("greedy_head takes the lm_head w [K, V] in x's dtype (bfloat16 or float32), not an "
                         "Fp8Weight: the -fp8 checkpoint keeps the lm_head unquantised; pass "
                         "fp8.dequantize(w, x.dtype) if the head was quantised")
    t, k, v = _check_inputs(x, w, "V")
    if logits_dtype is not None:
        logits_dtype = _as_compute_dtype(logits_dtype)
    _check_norm(norm, k)
    if backend == "reference":
        return reference.greedy_head(x, w, logits_dtype, norm=norm)
    return _check_pallas(t, k, v).greedy_head(x, w, logits_dtype, norm=norm)

