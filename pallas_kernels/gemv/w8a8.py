"""Pallas-Triton W8A8 projection: E4M3 activations times E4M3 ROWS weights on the tensor cores, T = 1..16 tokens.

SGLang's and DeepSeek's recipe for block-FP8 checkpoints. The activations are quantised per token and 128-column
group to E4M3 with the weights' convention (scale = group amax / 448; `fp8.quantize` of x as a ROWS [T, K] weight),
so both operands of every 128-column block are E4M3 with one fp32 scale each: the block's [16, 128] x [128, BN] dot
takes the loaded E4M3 tiles as they are, and its fp32 result is scaled by x's scale per token and the weight's per
row. (Triton for sm_90 lowers that dot to mma.sync with the operands widened to f16 in registers, not to the FP8
warpgroup MMA: compiled on a CPU by experiments/triton_resources.py, and on an H100 it was no faster than the
weight-only kernel, experiments/RESULTS.md "FP8 GEMV levers".) The activations' quantisation, and the RMSNorm
before it, run in one small XLA fusion ahead of the launch.

Numerics: NOT the weight-only path's. x is rounded to E4M3 (3 mantissa bits, ~2^-4 relative per element), so the
output moves ~2.5e-2 relative from `reference.gemv` (the weight-only reference, x in bf16); against `reference` below
(x and w both dequantised in fp32, then multiplied in fp32) it agrees to fp32 summation order. An option, never the
default.

Layout and grid as `rows.py`: q [N, K] E4M3 (each output row K contiguous bytes), scale [N, K/128] fp32; a program
owns BN rows and a K-slice of whole 128-column blocks, looped so that Triton pipelines the tiles feeding the dot
`num_stages` deep; K-splits write fp32 partials [KS, T, N] summed by one XLA fusion. K must be a multiple of 128 (every
Flash projection's is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import fp8, interpret_mode
from pallas_kernels.gemv import kernel, rows
from pallas_kernels.gemv.kernel import DOT_ROWS, _load, _norm_args

BLOCK = fp8.BLOCK


def quantize_activations(x: jax.Array) -> fp8.Fp8Weight:
    """x [T, K] -> its E4M3 values [T, K] and fp32 scales [T, ceil(K/128)] (one per token and 128 columns).

    x's own rounding is pinned first: inside a fusion XLA may otherwise keep the value that produced x in fp32
    (excess precision), which moves a group's amax and so every value of the group (8e-3 relative on CPU)."""
    return fp8.quantize(rows.pinned_f32(x), fp8.ROWS)


def reference(x, w, residual=None, *, norm=None):
    """The W8A8 product in fp32: x normed (`rms_norm`'s roundings), quantised, both operands dequantised in fp32
    and multiplied at full precision, rounded once to x's dtype, plus the residual."""
    xq = quantize_activations(x if norm is None else rows._rms_norm_pinned(x, norm[0], norm[1]))
    y = jnp.einsum("tk,nk->tn", fp8.dequantize(xq), fp8.dequantize(w), precision="highest",
                   preferred_element_type=jnp.float32).astype(x.dtype)
    return y if residual is None else residual + y


def w8a8_kernel(xq_ref, xs_ref, q_ref, s_ref, *refs, k_cols, BN, n_rows, n_tok, split_out, with_residual):
    # xq_ref [T, K] E4M3, xs_ref [T, K/128] fp32, q_ref [N, K] E4M3, s_ref [N, K/128] fp32, r_ref [T, N] (with
    # the residual); o_ref [T, N] in the output dtype or [KS, T, N] fp32 partials. Program (j, s): rows
    # [j·BN, (j+1)·BN), columns [s, s + 1)·k_cols.
    o_ref = refs[-1]
    r_ref = refs[0] if with_residual else None
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    k0 = s * k_cols
    tok = None if n_tok == DOT_ROWS else lax.broadcasted_iota(jnp.int32, (DOT_ROWS, BLOCK), 0) < n_tok
    tok1 = None if n_tok == DOT_ROWS else lax.broadcasted_iota(jnp.int32, (DOT_ROWS,), 0) < n_tok
    row = rows._row_mask(n0, (BN, BLOCK), BN=BN, n_rows=n_rows)
    row1 = rows._row_mask(n0, (BN,), BN=BN, n_rows=n_rows)

    def step(i, acc):
        k = pl.multiple_of(k0 + i * BLOCK, BLOCK)
        blk = lax.div(k, BLOCK)
        xq = _load(xq_ref, (pl.ds(0, DOT_ROWS), pl.ds(k, BLOCK)), tok)  # padded token rows read as zeros
        xs = _load(xs_ref, (pl.ds(0, DOT_ROWS), blk), tok1)
        wq = _load(q_ref, (pl.ds(n0, BN), pl.ds(k, BLOCK)), row)
        ws = _load(s_ref, (pl.ds(n0, BN), blk), row1)
        d = lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + d * xs[:, None] * ws[None, :]

    acc = lax.fori_loop(0, k_cols // BLOCK, step, jnp.zeros((DOT_ROWS, BN), jnp.float32))
    rows._store(o_ref, r_ref, acc, s, n0=n0, BN=BN, n_rows=n_rows, n_tok=n_tok, rows=DOT_ROWS, split_out=split_out)


def default_tuning(n_tokens: int, k: int, n: int) -> rows.RowsTuning:
    """The rows kernel's looped-dot rule: 64 rows on 4 warps, 3 stages, the fewest K-splits giving MIN_PROGRAMS / 2
    programs."""
    return rows.default_tuning(max(n_tokens, 2), k, n)


def gemv(x, w, residual=None, *, norm=None, tuning: rows.RowsTuning | None = None):
    """`reference`'s contract for a ROWS `fp8.Fp8Weight` (q [N, K] E4M3, scale [N, K/128] fp32) and x [T, K],
    1 <= T <= 16, K a multiple of 128; `norm` None or (weight [K], eps: a Python float)."""
    t, k = x.shape
    if tuning is not None and tuning.group != 1:
        raise ValueError(f"RowsTuning.group={tuning.group}: the W8A8 kernel steps one 128-column block at a time "
                         "(group=1)")
    if k % BLOCK:
        raise ValueError(f"x.shape[1]={k}: the W8A8 GEMV takes K a multiple of {BLOCK} (whole activation groups)")
    fp8.check_fp8("w", w, fp8.ROWS)
    kernel.check_sizes(t, k, w.shape[0], "w.shape[1]")
    norm_weight, eps = _norm_args(norm)
    return _gemv(x, w.q, w.scale, residual, *norm_weight, eps=eps, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("eps", "tuning"))
def _gemv(x, q, scale, residual, *norm_weight, eps, tuning):
    t, k = x.shape
    n = q.shape[0]
    tuning = tuning or default_tuning(t, k, n)
    k_cols = rows.check_split(k, tuning.k_splits)
    xn = rows._rms_norm_pinned(x, norm_weight[0], eps) if norm_weight else x
    xa = quantize_activations(xn)
    bn, ks = tuning.block_n, tuning.k_splits
    split_out = ks > 1
    with_residual = residual is not None and not split_out
    out_shape = rows.output_shape(ks, t, n, x.dtype)
    y = pl.pallas_call(
        functools.partial(w8a8_kernel, k_cols=k_cols, BN=bn, n_rows=n, n_tok=t, split_out=split_out,
                          with_residual=with_residual),
        grid=(pl.cdiv(n, bn), ks),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="gemv_w8a8",
    )(xa.q, xa.scale, q, scale, *((residual,) if with_residual else ()))
    return rows.finish(y, residual, x.dtype)
