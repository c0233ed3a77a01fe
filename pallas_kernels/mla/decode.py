"""Pallas-Triton absorbed MLA decode: T new queries × H heads over the latent cache [L, R + P], split-K.

Rows are the T·H (token, head) queries of one sequence, all attending to the one shared latent cache (MQA-like).
Grid (B, row blocks of BH, NS splits of the valid length): program (b, i, j) streams its share of the cache
[c_kv | k_rope] in blocks of BL positions, online softmax in fp32 (FlashAttention-2 §3.1.1: running max m_i and
sum l_i), and writes the unnormalised partial o, m, l; `_combine` merges the NS partials in XLA (flash-decoding).

Only positions < start + T are read (the loop bounds are computed from the device scalar `start`); inside the last
block the rows past start + T are zeroed before use, so NaN/garbage there cannot leak through 0·NaN.

Precision: the cache is bf16 in serving. Its values are exact in bf16, so fp32·bf16 products are taken as three
bf16 tensor-core dots of the fp32 operand split into hi + lo + lo2 bf16 pieces (error ~2^-24 relative, like fp32;
the same trick as BF16_BF16_F32_X3 with an exact second operand). The query pieces are split once in XLA, the
probabilities in-kernel. An fp32 cache (tests) uses plain fp32 dots.
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

_M_INIT = -1e30  # finite start for the running max: exp(m_old - m_new) stays 1, never NaN, on empty blocks


@dataclasses.dataclass(frozen=True)
class MLADecodeTuning:
    block_h: int = 32  # BH: query rows (token, head) per program
    block_l: int = 32  # BL: cache positions per step
    num_splits: int | None = None  # NS: None = enough programs to fill ~2 waves of SMs
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_h", "block_l"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MLADecodeTuning.{name}={v} must be a power of two >= 16")


def _trunc_bf16(a):
    """fp32 -> fp32 with the low 16 mantissa bits cleared: exactly representable in bf16."""
    bits = lax.bitcast_convert_type(a, jnp.int32) & jnp.int32(-65536)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _split3(a):
    """fp32 -> (hi, lo, lo2) bf16 with hi + lo + lo2 = a to ~2^-24 relative.

    hi and lo come from truncation (bit masks), not from rounding through bf16: XLA's excess-precision rewrites
    may drop an f32 -> bf16 -> f32 round trip, which would make lo = a - hi vanish (seen on the H200: 3e-4 error).
    hi and lo are exact in bf16, so their casts below are exact whatever the compiler does.
    """
    hi = _trunc_bf16(a)
    r = a - hi  # exact
    lo = _trunc_bf16(r)
    lo2 = r - lo  # exact; its bf16 cast rounds the last ~8 bits
    return hi.astype(jnp.bfloat16), lo.astype(jnp.bfloat16), lo2.astype(jnp.bfloat16)


def _dot_pieces(pieces, b, trans_b):
    acc = None
    for a in pieces:
        prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        if trans_b:
            d = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        else:
            d = jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)
        acc = d if acc is None else acc + d
    return acc


def mla_decode_fwd_kernel(start_ref, ql_ref, qr_ref, kv_ref, o_ref, m_ref, l_ref, *, scale, T, H, R, P, BL, NS):
    # start_ref [1] int32; ql_ref [NP, BH, R]; qr_ref [NP, BH, P] (NP = query pieces); kv_ref [L, R + P];
    # o_ref [BH, R] fp32; m_ref, l_ref [BH] fp32
    bh = o_ref.shape[0]
    i_h, i_s = pl.program_id(1), pl.program_id(2)
    start = start_ref[0]
    end = start + T  # positions < end hold real data
    rows = i_h * bh + lax.iota(jnp.int32, bh)
    lim = start + jnp.minimum(rows // H, T - 1)  # [BH] last visible position per query row
    n_pieces = ql_ref.shape[0]
    b_ql = [ql_ref[p] for p in range(n_pieces)]  # NP × [BH, R]
    b_qr = [qr_ref[p] for p in range(n_pieces)]  # NP × [BH, P]
    n_blocks = pl.cdiv(end, BL)
    per_split = pl.cdiv(n_blocks, NS)
    lo_blk = jnp.minimum(i_s * per_split, n_blocks)
    hi_blk = jnp.minimum(lo_blk + per_split, n_blocks)
    i_l = lax.iota(jnp.int32, BL)

    def body(blk, carry):
        o, m_i, l_i = carry
        o_l = pl.multiple_of(blk * BL, BL)
        pos = o_l + i_l  # [BL]
        live = (pos < end)[:, None]
        b_c = jnp.where(live, kv_ref[pl.ds(o_l, BL), pl.ds(0, R)], 0)  # [BL, R]
        b_r = jnp.where(live, kv_ref[pl.ds(o_l, BL), pl.ds(R, P)], 0)  # [BL, P]
        s = (_dot_pieces(b_ql, b_c, True) + _dot_pieces(b_qr, b_r, True)) * scale  # [BH, BL]
        s = jnp.where(pos[None, :] <= lim[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        pieces = _split3(p) if b_c.dtype == jnp.bfloat16 else (p,)
        o_new = o * alpha[:, None] + _dot_pieces(pieces, b_c, False)
        return o_new, m_new, l_new

    init = (jnp.zeros((bh, R), jnp.float32), jnp.full((bh,), _M_INIT, jnp.float32), jnp.zeros((bh,), jnp.float32))
    o, m_i, l_i = lax.fori_loop(lo_blk, hi_blk, body, init)
    o_ref[...] = o
    m_ref[...] = m_i
    l_ref[...] = l_i


def _combine(o, m, l):
    # o [B, NS, TH, R], m/l [B, NS, TH] -> [B, TH, R]
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_max)  # [B, NS, TH]
    num = jnp.einsum("bsh,bshr->bhr", w, o, precision=lax.Precision.HIGHEST)
    return num / jnp.sum(w * l, axis=1)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "tuning"))
def mla_decode_attention(q_latent, q_rope, kv_cache, start, *, scale, tuning: MLADecodeTuning = MLADecodeTuning()):
    """Same contract as `reference.mla_decode_attention`; shapes already validated by the dispatcher."""
    b, t, h, r = q_latent.shape
    p = q_rope.shape[3]
    length = kv_cache.shape[1]
    for name, v in (("R", r), ("P", p)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"the Pallas MLA decode kernel needs power-of-two {name} >= 16, got {name}={v}")
    bl = min(tuning.block_l, length & -length)
    if bl < 16:
        raise ValueError(f"the Pallas MLA decode kernel needs the cache length L={length} to be a multiple of 16")
    th = t * h
    thp = -(-th // 16) * 16
    bh = min(tuning.block_h, thp & -thp)
    n_hb = thp // bh
    ql = q_latent.reshape(b, th, r).astype(jnp.float32)
    qr = q_rope.reshape(b, th, p).astype(jnp.float32)
    if thp != th:
        ql = jnp.pad(ql, ((0, 0), (0, thp - th), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, thp - th), (0, 0)))
    if kv_cache.dtype == jnp.bfloat16:
        ql, qr = jnp.stack(_split3(ql), 1), jnp.stack(_split3(qr), 1)  # [B, 3, THP, R], [B, 3, THP, P]
    else:
        ql, qr, kv_cache = ql[:, None], qr[:, None], kv_cache.astype(jnp.float32)
    n_pieces = ql.shape[1]
    ns = tuning.num_splits
    if ns is None:
        # Enough programs for ~2 per SM, but keep the partials' round trip (write + read of NS·TH·R fp32)
        # under half of the cache bytes, and >= 4 blocks per split.
        n_sms = 132
        traffic_cap = (length * (r + p) * kv_cache.dtype.itemsize) // (4 * th * r * 4)
        ns = max(1, min(length // (4 * bl), (2 * n_sms) // max(1, b * n_hb), traffic_cap))
    start_arr = jnp.reshape(start, (1,)).astype(jnp.int32)
    kernel = functools.partial(mla_decode_fwd_kernel, scale=float(scale), T=t, H=h, R=r, P=p, BL=bl, NS=ns)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, n_hb, ns),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, k: (0,)),
            pl.BlockSpec((None, n_pieces, bh, r), lambda i, j, k: (i, 0, j, 0)),
            pl.BlockSpec((None, n_pieces, bh, p), lambda i, j, k: (i, 0, j, 0)),
            pl.BlockSpec((None, length, r + p), lambda i, j, k: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, j, k: (i, k, j, 0)),
            pl.BlockSpec((None, None, bh), lambda i, j, k: (i, k, j)),
            pl.BlockSpec((None, None, bh), lambda i, j, k: (i, k, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns, thp, r), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, thp), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, thp), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="mla_decode_fwd_kernel",
    )(start_arr, ql, qr, kv_cache)
    return _combine(o, m, l)[:, :th].reshape(b, t, h, r)
