"""Pallas-Triton router: fp32 GEMV + sigmoid (kernel 1), grouped top-k by masked argmax passes (kernel 2).

Kernel 1 (`router_fwd_kernel_gemv`), grid (E / BE, NP / BN): each program streams a [D, BE] slab of the fp32 router
in [BK, BE] tiles and writes s = sigmoid(x·W) for BN tokens. The router stays fp32 (5.2 MB for Flash, +1.2 µs over
a bf16 copy at 4.3 TB/s) so that the logits are the reference's up to fp32 summation order and the selection is
the reference's. Kernel 2 (`router_fwd_kernel_topk`), grid (NP,): one token per program, one warp: group scores
(top-2 sums), top groups and top experts with argmax-by-min-index passes, so ties go to the lower index exactly as
`lax.top_k` breaks them. The GEMV stays out of the top-k program: one program cannot stream 5 MB quickly.
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


@dataclasses.dataclass(frozen=True)
class RouterTuning:
    block_e: int = 16  # BE: experts per GEMV program
    block_k: int = 256  # BK: hidden-dim chunk per GEMV step
    block_n: int = 16  # BN: tokens per GEMV program (N = 1 uses a single row)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_e", "block_k", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RouterTuning.{name}={v} must be a power of two")


def _pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def router_fwd_kernel_gemv(x_ref, w_ref, s_ref, *, BK, n_chunks):
    # x_ref [BN, D] compute dtype; w_ref [D, BE] fp32; s_ref [BN, BE] fp32
    bn, be = s_ref.shape

    def body(c, acc):
        o_k = pl.multiple_of(c * BK, BK)
        b_x = x_ref[:, pl.ds(o_k, BK)].astype(jnp.float32)  # [BN, BK]
        b_w = w_ref[pl.ds(o_k, BK), :]  # [BK, BE]
        if bn == 1:
            return acc + jnp.sum(b_x[0][:, None] * b_w, axis=0)[None, :]
        return acc + jnp.dot(b_x, b_w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((bn, be), jnp.float32))
    s_ref[...] = jax.nn.sigmoid(acc)


def _argmax_low(v, iota, n):
    """Index of the max of v, the lowest such index on ties (what lax.top_k returns first)."""
    m = jnp.max(v)
    return m, jnp.min(jnp.where(v == m, iota, n))


def router_fwd_kernel_topk(s_ref, b_ref, w_ref, i_ref, *, n_group, topk_group, top_k, scale, norm):
    # s_ref [1, E] fp32 (sigmoid scores); b_ref [E] fp32; w_ref [1, K] fp32; i_ref [1, K] int32
    e = s_ref.shape[1]
    gsz = e // n_group
    s = s_ref[0, :]
    choice = s + b_ref[...]
    i_e = lax.iota(jnp.int32, e)
    gid = i_e // gsz
    i_g = lax.iota(jnp.int32, n_group)
    neg = jnp.float32(-jnp.inf)
    g_score = jnp.zeros((n_group,), jnp.float32)
    for g in range(n_group):
        v = jnp.where(gid == g, choice, neg)
        m1, i1 = _argmax_low(v, i_e, e)
        m2 = jnp.max(jnp.where(i_e == i1, neg, v))
        g_score = jnp.where(i_g == g, m1 + m2, g_score)
    keep = jnp.zeros((e,), jnp.bool_)
    g_taken = jnp.zeros((n_group,), jnp.bool_)
    for _ in range(topk_group):
        _, gi = _argmax_low(jnp.where(g_taken, neg, g_score), i_g, n_group)
        g_taken = g_taken | (i_g == gi)
        keep = keep | (gid == gi)
    masked = jnp.where(keep, choice, neg)
    i_k = lax.iota(jnp.int32, top_k)
    ids = jnp.zeros((top_k,), jnp.int32)
    w = jnp.zeros((top_k,), jnp.float32)
    for k in range(top_k):
        _, ik = _argmax_low(masked, i_e, e)
        ids = jnp.where(i_k == k, ik, ids)
        w = jnp.where(i_k == k, jnp.sum(jnp.where(i_e == ik, s, 0.0)), w)
        masked = jnp.where(i_e == ik, neg, masked)
    if norm:
        w = w / (jnp.sum(w) + 1e-20)
    w_ref[0, :] = w * scale
    i_ref[0, :] = ids


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "tuning"))
def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True,
          tuning: RouterTuning = RouterTuning()):
    """Same contract as `reference.route`; shapes already validated by the dispatcher."""
    n, d = x.shape
    e = router.shape[1]
    be = min(tuning.block_e, e)
    bk = min(tuning.block_k, d & -d)  # largest power of two dividing D, capped
    for name, v in (("E", e), ("E/n_group", e // n_group), ("top_k", top_k)):
        if v & (v - 1):
            raise ValueError(f"the Pallas router needs power-of-two sizes: {name}={v}")
    if bk < 16:
        raise ValueError(f"the Pallas router needs D={d} divisible by 16")
    bn = 1 if n == 1 else min(tuning.block_n, max(16, _pow2(n)))
    n_pad = -(-n // bn) * bn
    xp = x if n_pad == n else jnp.pad(x, ((0, n_pad - n), (0, 0)))
    interpret = interpret_mode()
    s = pl.pallas_call(
        functools.partial(router_fwd_kernel_gemv, BK=bk, n_chunks=d // bk),
        grid=(e // be, n_pad // bn),
        in_specs=[pl.BlockSpec((bn, d), lambda j, i: (i, 0)), pl.BlockSpec((d, be), lambda j, i: (0, j))],
        out_specs=pl.BlockSpec((bn, be), lambda j, i: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, e), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="router_fwd_kernel_gemv",
    )(xp, router)
    w, ids = pl.pallas_call(
        functools.partial(router_fwd_kernel_topk, n_group=n_group, topk_group=topk_group, top_k=top_k,
                          scale=float(routed_scaling_factor), norm=bool(norm_topk_prob)),
        grid=(n,),
        in_specs=[pl.BlockSpec((1, e), lambda i: (i, 0)), pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((1, top_k), lambda i: (i, 0)), pl.BlockSpec((1, top_k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, top_k), jnp.float32), jax.ShapeDtypeStruct((n, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="router_fwd_kernel_topk",
    )(s, expert_bias)
    return w, ids
