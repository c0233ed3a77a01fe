"""Pallas-Triton router: split-K fp32 GEMV (kernel 1), then sigmoid + grouped top-k by masked argmax (kernel 2).

Kernel 1 (`router_fwd_kernel_gemv`), grid (E / BE, KS, NP / BN): program (j, k, n) streams rows
[k·D/KS, (k+1)·D/KS) of the [D, BE] slab j of the fp32 router in [BK, BE] tiles into fp32 `dot`s (pipelined
loads) and writes partial logits for BN tokens. Split-K gives E/BE·KS programs, enough loads in flight. The
router stays fp32 (5.2 MB for Flash, +1.2 µs over a bf16 copy at 4.3 TB/s) so the logits equal the reference's
up to fp32 summation order and the selection is the reference's (a bf16 copy would move near-ties).

At T = 1 (`gemv_dot=False`, the default) the single token's products are plain FMAs into a [BK, BE] fp32 tile
reduced once at the end; `gemv_dot=True` broadcasts it to 16 rows for a tensor-core dot instead (1.1 µs slower at
the same split, H200).

Kernel 2 (`router_fwd_kernel_topk`), grid (N,), one program per token over the scores laid out [G, E/G]: sums the
KS partials in order, sigmoid, then few serial reductions: per-group top-2 sums for all groups at once (row max,
row argmax, row max without that argmax), the best groups by rank counting on the G scores (a group is kept when
fewer than topk_group groups beat it: larger, or equal at a lower index), then K argmax passes over the kept
experts (argmax returns the first maximum) and the K weights in one [K, E] reduction. Every tie goes to the lower
index, exactly as `lax.top_k`. ~14 serial reductions instead of ~50 (per-group and per-pick loops before). The GEMV
stays out of this program: one program cannot stream 5 MB fast.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import interpret_mode
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2


@dataclasses.dataclass(frozen=True)
class RouterTuning:
    # Defaults: best of the H200 sweeps by device time (experiments/RESULTS.md, "MoE, session 3": GEMV 3.8 µs +
    # top-k 3.8 µs at T = 1, against 5.3 + 4.4 for dot / KS 8 / BK 64 / one top-k warp).
    block_e: int = 16  # BE: experts per GEMV program
    block_k: int = 32  # BK: hidden-dim chunk per GEMV step
    k_splits: int = 16  # KS: hidden-dim splits (partial logits summed by the top-k kernel)
    block_n: int = 16  # BN: tokens per GEMV program (N = 1 uses a single row)
    num_warps: int = 4
    num_stages: int = 3
    gemv_dot: bool = False  # T = 1: dot on a 16-row broadcast (pipelined loads) vs elementwise FMA + one reduction
    topk_warps: int = 4  # warps of the top-k program (one token per program)

    def __post_init__(self):
        check_pow2_fields(self, ("block_e", "block_k", "k_splits", "block_n", "topk_warps"))


def _gemv_block(x_ref, w_ref, cols, o_split, *, BK, n_chunks, bn, use_dot):
    """Partial logits [bn, BE] of x_ref [bn, D] rows [o_split, o_split + n_chunks·BK) · w_ref[:, cols] (fp32)."""
    be = cols.size
    if bn == 1 and not use_dot:
        # One token: x[k]·w[k, :] products accumulate in a [BK, BE] fp32 tile (plain FMAs, no 16-row broadcast),
        # reduced over BK once at the end.
        def body_fma(c, acc):
            ks = pl.ds(pl.multiple_of(o_split + c * BK, BK), BK)
            return acc + x_ref[0, ks].astype(jnp.float32)[:, None] * w_ref[ks, cols]

        acc = lax.fori_loop(0, n_chunks, body_fma, jnp.zeros((BK, be), jnp.float32))
        return jnp.sum(acc, axis=0)[None, :]
    rows = max(16, bn)  # dot tiles need >= 16 rows

    def body(c, acc):
        ks = pl.ds(pl.multiple_of(o_split + c * BK, BK), BK)
        b_x = jnp.broadcast_to(x_ref[:, ks].astype(jnp.float32), (rows, BK))  # [rows, BK]
        return acc + jnp.dot(b_x, w_ref[ks, cols], precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((rows, be), jnp.float32))
    if bn == 1:
        acc = jnp.sum(jnp.where((lax.iota(jnp.int32, rows) == 0)[:, None], acc, 0.0), axis=0)[None, :]
    return acc


def router_fwd_kernel_gemv(x_ref, w_ref, p_ref, *, BK, n_chunks, use_dot):
    # x_ref [BN, D] compute dtype (BN = 1: one token); w_ref [D, E] fp32; p_ref [BN, BE] fp32 partial logits
    bn, be = p_ref.shape
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * be, be), be)
    p_ref[...] = _gemv_block(x_ref, w_ref, cols, pl.program_id(1) * (n_chunks * BK), BK=BK, n_chunks=n_chunks,
                             bn=bn, use_dot=use_dot)


def _select_topk(logits, bias, *, topk_group, top_k, scale, norm):
    """In-kernel grouped top-k of one token: logits, bias [G, E/G] fp32 -> (weights [K] fp32, ids [K] int32)."""
    n_group, gsz = logits.shape
    e = n_group * gsz
    s = jax.nn.sigmoid(logits)  # [G, E/G]
    choice = s + bias
    neg = jnp.float32(-jnp.inf)
    # Group scores for all groups at once: top-2 sum = max + max with the first argmax removed (a duplicated
    # maximum counts twice, as in lax.top_k). Three row reductions, no per-group loop.
    col = lax.broadcasted_iota(jnp.int32, (n_group, gsz), 1)
    m1 = jnp.max(choice, axis=1)
    i1 = jnp.argmax(choice, axis=1).astype(jnp.int32)  # first index of the maximum
    m2 = jnp.max(jnp.where(col == i1[:, None], neg, choice), axis=1)
    g_score = m1 + m2  # [G]
    # Best groups by rank counting on G values: group g is kept when fewer than topk_group groups beat it (a
    # larger score, or an equal one at a lower index: lax.top_k's tie order).
    gi = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 0)
    gj = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 1)
    sc_g, sc_h = g_score[:, None], g_score[None, :]
    beats = (sc_h > sc_g) | ((sc_h == sc_g) & (gj < gi))  # [g, h]: h beats g
    rank = jnp.sum(beats.astype(jnp.int32), axis=1)
    masked = jnp.where((rank < topk_group)[:, None], choice, neg).reshape(e)
    # Top-k among the kept experts: K argmax passes (one reduction each; argmax returns the first maximum).
    i_e = lax.iota(jnp.int32, e)
    i_k = lax.iota(jnp.int32, top_k)
    ids = jnp.zeros((top_k,), jnp.int32)
    for k in range(top_k):
        ik = jnp.argmax(masked).astype(jnp.int32)
        ids = jnp.where(i_k == k, ik, ids)
        masked = jnp.where(i_e == ik, neg, masked)
    # Weights: the unbiased scores of the K picks in one [K, E] reduction.
    w = jnp.sum(jnp.where(i_e[None, :] == ids[:, None], s.reshape(e)[None, :], 0.0), axis=1)
    if norm:
        w = w / (jnp.sum(w) + 1e-20)
    return w * scale, ids


def _sum_partials(p_ref):
    """p_ref [KS, G, E/G] fp32 split-K partial logits -> [G, E/G], summed in split order."""
    logits = p_ref[0]
    for k in range(1, p_ref.shape[0]):
        logits = logits + p_ref[k]
    return logits


def router_fwd_kernel_topk(p_ref, b_ref, w_ref, i_ref, **select_kw):
    # p_ref [KS, G, E/G] fp32 partial logits; b_ref [G, E/G] fp32; w_ref [1, K] fp32; i_ref [1, K] int32
    w, ids = _select_topk(_sum_partials(p_ref), b_ref[...], **select_kw)
    w_ref[0, :] = w
    i_ref[0, :] = ids


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "tuning"))
def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True,
          tuning: RouterTuning = RouterTuning()):
    """Same contract as `reference.route`; shapes already validated by the dispatcher."""
    n, d = x.shape
    e = router.shape[1]
    be = min(tuning.block_e, e)
    for name, v in (("E", e), ("E/n_group", e // n_group), ("top_k", top_k)):
        if v & (v - 1):
            raise ValueError(f"the Pallas router needs power-of-two sizes: {name}={v}")
    ks = tuning.k_splits
    while ks > 1 and (d % ks or (d // ks) % 16):
        ks //= 2
    bk = min(tuning.block_k, (d // ks) & -(d // ks))
    if bk < 16:
        raise ValueError(f"the Pallas router needs D={d} divisible by 16")
    bn = 1 if n == 1 else min(tuning.block_n, max(16, next_pow2(n)))
    n_pad = -(-n // bn) * bn
    xp = x if n_pad == n else jnp.pad(x, ((0, n_pad - n), (0, 0)))
    interpret = interpret_mode()
    partial = pl.pallas_call(
        functools.partial(router_fwd_kernel_gemv, BK=bk, n_chunks=d // ks // bk, use_dot=tuning.gemv_dot),
        grid=(e // be, ks, n_pad // bn),
        in_specs=[pl.BlockSpec((bn, d), lambda j, k, i: (i, 0)), pl.no_block_spec],
        out_specs=pl.BlockSpec((None, bn, be), lambda j, k, i: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((ks, n_pad, e), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="router_fwd_kernel_gemv",
    )(xp, router)
    gsz = e // n_group
    w, ids = pl.pallas_call(
        functools.partial(router_fwd_kernel_topk, topk_group=topk_group, top_k=top_k,
                          scale=float(routed_scaling_factor), norm=bool(norm_topk_prob)),
        grid=(n,),
        in_specs=[pl.BlockSpec((ks, None, n_group, gsz), lambda i: (0, i, 0, 0)),
                  pl.BlockSpec((n_group, gsz), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((1, top_k), lambda i: (i, 0)), pl.BlockSpec((1, top_k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, top_k), jnp.float32), jax.ShapeDtypeStruct((n, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.topk_warps, num_stages=1),
        interpret=interpret,
        name="router_fwd_kernel_topk",
    )(partial.reshape(ks, n_pad, n_group, gsz), expert_bias.reshape(n_group, gsz))
    return w, ids
