"""Pallas-Triton absorbed MLA decode: T new queries × H heads over the latent cache [L, R + P], split-K.

Rows are the T·H (token, head) queries of one sequence, all attending to the one shared latent cache (MQA-like).
Grid (row blocks of BH, NS splits of the valid length, B): each program streams its split of the cache
[c_kv | k_rope] in blocks of BL positions, online softmax in fp32 (FlashAttention-2's running max m_i and
sum l_i), and writes the unnormalised partial o [BH, R], m, l; `_combine` merges the NS partials in XLA
(flash-decoding). The register file holds o [BH, R] fp32; the query pieces are re-read per BK-wide chunk of R (they
stay in L1/L2) rather than held for the whole loop, which frees the registers for two programs per SM at 4 warps:
what hides the latency of each block's chain of dependent steps (the default's tuning note below). The split count
NS is one wave of programs.

Only blocks below start + T are read (the loop bounds come from the device scalar `start`); inside the last block
the ·V operand's rows past start + T are zeroed and those scores replaced (a select) by -inf, so NaN/garbage there
cannot leak through 0·NaN.

Precision: the cache is bf16 in serving. Its values are exact in bf16, so fp32·bf16 products are taken as three
bf16 tensor-core dots of the fp32 operand split into hi + lo + lo2 bf16 pieces (error ~2^-24 relative, like fp32;
the same trick as BF16_BF16_F32_X3 with an exact second operand). The query pieces are split once in XLA, the
probabilities in-kernel; a bf16 q_rope is a single exact piece. An fp32 cache (tests) uses plain fp32 dots. One
bf16 piece per product (the usual flash-attention practice, ~2e-3 error) was at most ~5 % faster on the H200, so
the kernel stays exact (experiments/FINDINGS.md).
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
from pallas_kernels.common.sizes import check_pow2_fields

_M_INIT = -1e30  # finite start for the running max: exp(m_old - m_new) stays 1, never NaN, on empty blocks


@dataclasses.dataclass(frozen=True)
class MLADecodeTuning:
    """Tiling knobs of the decode kernel (all exact).

    programs_per_sm is what the default split count plans for, not a launch setting: a tuning that fits only once
    per SM (by registers or shared memory; or a GPU with less shared memory than 2 × 97 KiB) should set it to 1,
    or its splits make two waves.
    """

    # Defaults: the best of the H200 sweeps by device time (experiments/RESULTS.md, "MLA" table; the tilings that
    # lost are in experiments/FINDINGS.md). A program walks its cache blocks one after another, each a chain of
    # dependent steps (score dots, cross-warp softmax reductions, layout changes, ·V dots) whose latency most
    # likely sets the time (inferred, not profiled per instruction). What helps is hiding that latency behind a
    # second program per SM: 4 warps with the query pieces re-read per 128-wide chunk (block_k) need 255
    # registers (16 B spilled) and 97 KiB of shared memory (sm_90), so two fit; against the removed tiling that
    # held the query pieces in registers (8 warps, block_l 64, one program per SM; experiments/FINDINGS.md): 50 vs 56 µs at L = 32k, T = 1, 205 vs 250 at 32k, T = 6, 60 vs 70 at 8k,
    # T = 6, 11.1 vs 11.8 at 1k, T = 1; 23.4 vs 21.5 at 8k, T = 1 and 17.7 vs 16.9 at 1k, T = 6 are its losses
    # (from the doubled split count: the same tiling at programs_per_sm 1 took 22.6 and 15.0 there).
    block_h: int = 16  # BH: query rows (token, head) per program
    block_l: int = 32  # BL: cache positions per step
    block_k: int = 128  # BK: chunk of R per score dot and ·V dot, with in-loop query loads (capped at R)
    num_splits: int | None = None  # NS: None = one wave of programs_per_sm × SMs (see _num_splits)
    programs_per_sm: int = 2  # programs resident per SM that the default split count plans for (registers, smem)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_pow2_fields(self, ("block_h", "block_l", "block_k"), 16)
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"MLADecodeTuning.num_splits={self.num_splits} must be >= 1")
        if self.programs_per_sm < 1:
            raise ValueError(f"MLADecodeTuning.programs_per_sm={self.programs_per_sm} must be >= 1")


def _trunc_bf16(a):
    """fp32 -> fp32 with the low 16 mantissa bits cleared: exactly representable in bf16."""
    bits = lax.bitcast_convert_type(a, jnp.int32) & jnp.int32(-65536)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _split(a):
    """fp32 -> three bf16 pieces hi + lo + lo2 summing to a within ~2^-24 relative (fp32-exact).

    hi and lo come from truncation (bit masks), not from rounding through bf16: XLA's excess-precision rewrites
    may drop an f32 -> bf16 -> f32 round trip, which would make lo = a - hi vanish (seen on the H200: 3e-4 error).
    hi and lo are exact in bf16, so their casts below are exact whatever the compiler does; only lo2 rounds.
    """
    hi = _trunc_bf16(a)
    r = a - hi  # exact
    lo = _trunc_bf16(r)
    lo2 = r - lo  # exact; its bf16 cast rounds the last ~8 bits
    return hi.astype(jnp.bfloat16), lo.astype(jnp.bfloat16), lo2.astype(jnp.bfloat16)


def _dot(a, b, trans_b):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    if trans_b:
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
    return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


def _dot_pieces(pieces, b, trans_b, acc=None):
    """acc + sum_i a_i · b, written as acc + dot so that Triton folds each add into the dot's accumulator: one
    live fp32 accumulator however many pieces (separate dot results were 3 extra [BH, BK] fp32 tiles)."""
    for a in pieces:
        d = _dot(a, b, trans_b)
        acc = d if acc is None else acc + d
    return acc


def mla_decode_fwd_kernel(start_ref, ql_ref, qr_ref, kv_ref, o_ref, m_ref, l_ref, *, scale, T, H, R, P, BL, BK, NS):
    # start_ref [1] int32; ql_ref [NQ, BH, R]; qr_ref [NQR, BH, P] (query pieces); kv_ref [L, R + P];
    # o_ref [BH, R] fp32; m_ref, l_ref [BH] fp32. Grid (NHB, NS, B).
    bh = o_ref.shape[0]
    i_h, i_s = pl.program_id(0), pl.program_id(1)
    start = start_ref[0]
    end = start + T  # positions < end hold real data
    rows = i_h * bh + lax.iota(jnp.int32, bh)
    lim = start + jnp.minimum(rows // H, T - 1)  # [BH] last visible position per query row
    nq = ql_ref.shape[0]
    b_qr = [qr_ref[p] for p in range(qr_ref.shape[0])]  # NQR × [BH, P], held for the whole loop
    n_blocks = pl.cdiv(end, BL)
    per_split = pl.cdiv(n_blocks, NS)
    lo_blk = jnp.minimum(i_s * per_split, n_blocks)
    hi_blk = jnp.minimum(lo_blk + per_split, n_blocks)
    i_l = lax.iota(jnp.int32, BL)

    def body(blk, carry):
        # o is carried as R / BK column chunks [BH, BK], each updated by its own ·V dot whose operand is the
        # cache chunk already loaded for the scores.
        o, m_i, l_i = carry
        o_l = pl.multiple_of(blk * BL, BL)
        pos = o_l + i_l  # [BL]
        # Score operands are not zeroed past `end`: those columns are replaced by -inf below (a select, so a NaN
        # score there is dropped). The ·V operand is zeroed, since 0 · NaN = NaN.
        s = _dot_pieces(b_qr, kv_ref[pl.ds(o_l, BL), pl.ds(R, P)], True)  # [BH, BL]
        chunks = []
        for k in range(0, R, BK):  # static: R / BK chunks, the query pieces re-read each time
            chunks.append(kv_ref[pl.ds(o_l, BL), pl.ds(k, BK)])  # [BL, BK]
            s = _dot_pieces([ql_ref[p, :, pl.ds(k, BK)] for p in range(nq)], chunks[-1], True, acc=s)
        s = jnp.where(pos[None, :] <= lim[:, None], s * scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        pieces = _split(p) if kv_ref.dtype == jnp.bfloat16 else (p,)
        live = (pos < end)[:, None]
        o_new = tuple(_dot_pieces(pieces, jnp.where(live, c, 0), False, acc=o_j * alpha[:, None])
                      for o_j, c in zip(o, chunks))
        return o_new, m_new, l_new

    o0 = tuple(jnp.zeros((bh, BK), jnp.float32) for _ in range(R // BK))
    init = (o0, jnp.full((bh,), _M_INIT, jnp.float32), jnp.zeros((bh,), jnp.float32))
    o, m_i, l_i = lax.fori_loop(lo_blk, hi_blk, body, init)
    for j, o_j in enumerate(o):
        o_ref[:, pl.ds(j * BK, BK)] = o_j
    m_ref[...] = m_i
    l_ref[...] = l_i


def _combine(o, m, l):
    # o [B, NS, TH, R], m/l [B, NS, TH] -> [B, TH, R]
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_max)  # [B, NS, TH]
    num = jnp.einsum("bsh,bshr->bhr", w, o, precision=lax.Precision.HIGHEST)
    return num / jnp.sum(w * l, axis=1)[..., None]


def _n_sms() -> int:
    """Streaming multiprocessors of the device the kernel compiles for (132 on an H100/H200 SXM); interpret mode
    and CPU lowering tests have no GPU, so they plan for an H200."""
    dev = jax.devices()[0]
    return (getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132


def _num_splits(length, bl, n_other, per_sm):
    """Splits of the cache length: one wave, i.e. as many programs as the SMs hold at once (per_sm each, n_other
    programs per split), and never more splits than blocks. Planned on the capacity L, not on start + T (a traced
    value). Two waves measured slower on the H200 (61 vs 57 µs at 32k, T = 1; experiments/FINDINGS.md): a program
    walks its blocks one after another, so a second wave only adds partials to combine and a tail."""
    return max(1, min(length // bl, -(-_n_sms() * per_sm // n_other)))


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
    bk = min(tuning.block_k, r)
    th = t * h
    thp = -(-th // 16) * 16
    bh = min(tuning.block_h, thp & -thp)
    n_hb = thp // bh
    ql = q_latent.reshape(b, th, r).astype(jnp.float32)
    qr = q_rope.reshape(b, th, p)
    if thp != th:
        ql = jnp.pad(ql, ((0, 0), (0, thp - th), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, thp - th), (0, 0)))
    if kv_cache.dtype == jnp.bfloat16:
        ql = jnp.stack(_split(ql), 1)  # [B, 3, THP, R]
        # A bf16 q_rope is one exact piece; an fp32 one is split like q_latent.
        qr = qr[:, None] if qr.dtype == jnp.bfloat16 else jnp.stack(_split(qr), 1)
    else:
        ql, qr, kv_cache = ql[:, None], qr.astype(jnp.float32)[:, None], kv_cache.astype(jnp.float32)
    nq, nqr = ql.shape[1], qr.shape[1]
    ns = tuning.num_splits
    if ns is None:
        ns = _num_splits(length, bl, b * n_hb, tuning.programs_per_sm)
    start_arr = jnp.reshape(start, (1,)).astype(jnp.int32)
    kernel = functools.partial(mla_decode_fwd_kernel, scale=float(scale), T=t, H=h, R=r, P=p, BL=bl, BK=bk, NS=ns)
    # Grid (NHB, NS, B): the row blocks of one split read the same cache blocks and are adjacent in launch order,
    # so their cache reads after the first hit L2.
    o, m, l = pl.pallas_call(
        kernel,
        grid=(n_hb, ns, b),
        in_specs=[
            pl.BlockSpec((1,), lambda j, k, i: (0,)),
            pl.BlockSpec((None, nq, bh, r), lambda j, k, i: (i, 0, j, 0)),
            pl.BlockSpec((None, nqr, bh, p), lambda j, k, i: (i, 0, j, 0)),
            pl.BlockSpec((None, length, r + p), lambda j, k, i: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda j, k, i: (i, k, j, 0)),
            pl.BlockSpec((None, None, bh), lambda j, k, i: (i, k, j)),
            pl.BlockSpec((None, None, bh), lambda j, k, i: (i, k, j)),
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
