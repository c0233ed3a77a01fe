"""Pallas-Triton MLA flash prefill: causal softmax attention over the expanded heads, online softmax in fp32.

The T queries sit at positions start .. start+T-1 and attend to keys k [L, Dqk], v [L, Dv] of their head (a
one-shot prefill: start 0, L = T; a prefill chunk: the keys of the earlier chunks too). Grid (NQ, H, B), one
program per block of BQ queries of one head. The query blocks vary fastest and run heaviest first (program 0 takes
the last block): the programs resident together read one head's keys, so they hit L2, and the short causal blocks
make the tail of the launch rather than its end.

Each program walks key blocks of BK in two loops (FlashAttention-2's running max m_i and sum l_i carried across
both): first the blocks that every query row of the block sees whole (no mask, plain loads), then the diagonal
blocks up to the causal bound min(start + T, start + q0 + BQ), masked per row. Blocks past the bound are never
loaded. The diagonal loads are masked to positions < start + T (other = 0), so garbage or NaN in the rows past the
chunk never enters a dot, and L need not be a multiple of BK; query rows past T load as zeros and are not stored.

Head dims: Triton tiles are powers of two and Ling's Dqk = 192 is not. Dqk is split into its power-of-two pieces
(192 = 128 + 64, q_nope | q_rope), each a dot accumulated into the one score tile, and Dv likewise (Ling's 128 is
one piece); padding 192 to 256 would load and multiply a third more zeros.

Numerics against the reference's eager attention: scores are rounded to the compute dtype, scaled in fp32 and
rounded again, exactly as there; the softmax is fp32. What flash cannot copy: the reference rounds the normalised
probabilities to the compute dtype before ·V, flash rounds the unnormalised exp(s - m_i) (m_i the running max, its
rescale factors fp32) and divides by the fp32 row sum at the end. Each probability is still rounded once (2^-9
relative in bf16), at another point: errors of that size, not the reference's bits (tests/ops/test_mla_prefill.py
states the measured error). In fp32 the roundings are exact and the dots run at full precision.
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

_M_INIT = -1e30  # finite start for the running max: exp(m_old - m_new) stays 1, never NaN, on fully masked rows
SMEM_LIMIT = 227 * 1024  # shared memory one program may take on sm_90 (the H100's and H200's opt-in maximum)


@dataclasses.dataclass(frozen=True)
class MLAPrefillTuning:
    """Tiling knobs of the prefill kernel: the result depends on them only through the order of the fp32 sums and,
    in bf16, the running max each probability is rounded against.

    block_q and block_k are capped at the next power of two of T and L (>= 16), so short prompts get small tiles.
    """

    # Defaults: the usual FlashAttention-2 tiling on sm_90 for head dims of 128-256: a 128-query block over 8 warps
    # holds q (128 × 192 bf16) and o (128 × 128 fp32) in registers; a 64-key step is 40 KiB of k | v in shared
    # memory per stage. Three stages measured best on the H200 (experiments/bench_mla_prefill.py --sweep,
    # experiments/RESULTS.md "Prefill"): 2646 µs one-shot at T = 8192 and 4472 µs for a 2048-token chunk over
    # L = 32768, against 2960 and 5804 with two.
    block_q: int = 128  # BQ: queries per program
    block_k: int = 64  # BK: keys per step
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_pow2_fields(self, ("block_q", "block_k"), 16)
        check_pow2_fields(self, ("num_warps",))
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"MLAPrefillTuning.num_stages={self.num_stages} must be an integer >= 1")


def smem_bytes(tuning: MLAPrefillTuning, dtype, dqk: int, dv: int) -> int:
    """Shared memory a program of `tuning` takes: `num_stages` buffered key blocks of k | v (BK x (Dqk + Dv)) and
    the query block (BQ x Dqk), in `dtype`. Exact for bf16 (sm_90 compiles at Ling's widths: 172032 bytes with the
    defaults, 110592 with BK 32, 90112 with one stage); an upper bound for float32, whose compile shares some buffers
    (295424 bytes against 344064 with the defaults, 197120 against 221184 with BK 32: experiments/triton_resources.py
    --mla-prefill, tests/test_experiments.py)."""
    return jnp.dtype(dtype).itemsize * (tuning.num_stages * tuning.block_k * (dqk + dv) + tuning.block_q * dqk)


def fitting_tuning(dtype, dqk: int, dv: int, base: MLAPrefillTuning = MLAPrefillTuning()) -> MLAPrefillTuning | None:
    """`base`, or the first smaller tiling whose `smem_bytes` fits SMEM_LIMIT: key blocks halved down to 16, then
    fewer stages, then query blocks halved (with their warps); None if even 16 x 16 tiles of one stage do not fit.
    float32 at Ling's widths: BK 32 (221184 bytes; the defaults' 344064 do not fit)."""
    tu = base
    while smem_bytes(tu, dtype, dqk, dv) > SMEM_LIMIT:
        if tu.block_k > 16:
            tu = dataclasses.replace(tu, block_k=tu.block_k // 2)
        elif tu.num_stages > 1:
            tu = dataclasses.replace(tu, num_stages=tu.num_stages - 1)
        elif tu.block_q > 16:
            tu = dataclasses.replace(tu, block_q=tu.block_q // 2, num_warps=max(1, tu.num_warps // 2))
        else:
            return None
    return tu


def pow2_pieces(d: int) -> tuple[tuple[int, int], ...]:
    """d's power-of-two parts, largest first, as (offset, width): 192 -> ((0, 128), (128, 64))."""
    pieces, offset = [], 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(pieces)


def _dot(a, b, trans_b=False):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def mla_prefill_fwd_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, scale, T, NQ, BQ, BK, QK, DV):
    # start_ref [1] int32; q_ref [T, Dqk]; k_ref [L, Dqk]; v_ref [L, Dv]; o_ref [T, Dv]. Grid (NQ, H, B).
    # QK, DV: the (offset, width) pieces of Dqk and Dv.
    dt = q_ref.dtype
    q0 = (NQ - 1 - pl.program_id(0)) * BQ  # heaviest block first
    start = start_ref[0]
    end = start + T  # key positions < end hold real data
    rows = q0 + lax.iota(jnp.int32, BQ)
    row_ok = (rows < T)[:, None]
    lim = (start + rows)[:, None]  # [BQ, 1] last visible key position per query row
    q = [pltriton.load(q_ref.at[pl.ds(q0, BQ), pl.ds(off, w)], mask=row_ok, other=0) for off, w in QK]
    i_k = lax.iota(jnp.int32, BK)

    def scores(ks):
        s = None
        for a, b in zip(q, ks):  # written as acc + dot so that Triton folds the add into the dot's accumulator
            d = _dot(a, b, trans_b=True)
            s = d if s is None else s + d
        # The reference's roundings: scores to the compute dtype, then the fp32 product with the scale.
        s = s.astype(dt).astype(jnp.float32)
        return (s * scale).astype(dt).astype(jnp.float32)

    def update(carry, s, vs):
        o, m_i, l_i = carry
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        p = p.astype(vs[0].dtype)
        o_new = tuple(o_j * alpha[:, None] + _dot(p, v_j) for o_j, v_j in zip(o, vs))
        return o_new, m_new, l_new

    def full_block(blk, carry):
        k0 = pl.multiple_of(blk * BK, BK)
        ks = [k_ref[pl.ds(k0, BK), pl.ds(off, w)] for off, w in QK]
        vs = [v_ref[pl.ds(k0, BK), pl.ds(off, w)] for off, w in DV]
        return update(carry, scores(ks), vs)

    def diagonal_block(blk, carry):
        k0 = pl.multiple_of(blk * BK, BK)
        pos = k0 + i_k
        live = (pos < end)[:, None]
        ks = [pltriton.load(k_ref.at[pl.ds(k0, BK), pl.ds(off, w)], mask=live, other=0) for off, w in QK]
        vs = [pltriton.load(v_ref.at[pl.ds(k0, BK), pl.ds(off, w)], mask=live, other=0) for off, w in DV]
        s = jnp.where(pos[None, :] <= lim, scores(ks), -jnp.inf)
        return update(carry, s, vs)

    # Full blocks end at or before the first row's last visible key, start + q0 (< end, so inside the chunk).
    n_full = lax.div(start + q0 + 1, BK)
    n_blocks = pl.cdiv(jnp.minimum(end, start + q0 + BQ), BK)
    o0 = tuple(jnp.zeros((BQ, w), jnp.float32) for _, w in DV)
    carry = (o0, jnp.full((BQ,), _M_INIT, jnp.float32), jnp.zeros((BQ,), jnp.float32))
    carry = lax.fori_loop(0, n_full, full_block, carry)
    o, _, l_i = lax.fori_loop(n_full, n_blocks, diagonal_block, carry)
    for (off, w), o_j in zip(DV, o):
        pltriton.store(o_ref.at[pl.ds(q0, BQ), pl.ds(off, w)], (o_j / l_i[:, None]).astype(o_ref.dtype),
                       mask=row_ok)


@functools.partial(jax.jit, static_argnames=("scale", "tuning"))
def mla_prefill_attention(q, k, v, start, *, scale, tuning: MLAPrefillTuning | None = None):
    """Same contract as `reference.mla_prefill_attention`; shapes already validated by the dispatcher. `tuning`
    None: the defaults where they fit the shared memory for q's dtype, else `fitting_tuning`'s."""
    b, t, h, dqk = q.shape
    length, dv = k.shape[1], v.shape[3]
    for name, d in (("Dqk", dqk), ("Dv", dv)):
        if d % 16:
            raise ValueError(f"the Pallas MLA prefill kernel needs {name} to be a multiple of 16 (power-of-two "
                             f"pieces >= 16), got {name}={d}")
    tuning = _fitting(tuning, q.dtype, dqk, dv, t, length)
    bq = min(tuning.block_q, max(16, next_pow2(t)))
    bk = min(tuning.block_k, max(16, next_pow2(length)))
    nq = pl.cdiv(t, bq)
    kernel = functools.partial(mla_prefill_fwd_kernel, scale=float(scale), T=t, NQ=nq, BQ=bq, BK=bk,
                               QK=pow2_pieces(dqk), DV=pow2_pieces(dv))
    start_arr = jnp.reshape(start, (1,)).astype(jnp.int32)
    # A row count below one block (a short prompt) is padded to it: a masked load or store may overrun the rows,
    # but not by more than the array holds (the interpreter slices the whole block). Rows past T and keys past
    # start + T are masked, so the padding never reaches the result.
    t_rows, length = max(t, bq), max(length, bk)
    q = jnp.pad(q, ((0, 0), (0, t_rows - t), (0, 0), (0, 0)))
    k, v = (jnp.pad(a, ((0, 0), (0, length - a.shape[1]), (0, 0), (0, 0))) for a in (k, v))
    # Whole per-(sequence, head) rows as blocks: the kernel slices its query block and key blocks itself, with masks
    # where they overrun T or the chunk (a block spec would read and write past them unmasked).
    return pl.pallas_call(
        kernel,
        grid=(nq, h, b),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, n: (0,)),
            pl.BlockSpec((None, t_rows, None, dqk), lambda i, j, n: (n, 0, j, 0)),
            pl.BlockSpec((None, length, None, dqk), lambda i, j, n: (n, 0, j, 0)),
            pl.BlockSpec((None, length, None, dv), lambda i, j, n: (n, 0, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, t_rows, None, dv), lambda i, j, n: (n, 0, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_rows, h, dv), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="mla_prefill_fwd_kernel",
    )(start_arr, q, k, v)[:, :t]


def _fitting(tuning, dtype, dqk, dv, t, length):
    """The tuning to run: the given one if its blocks, capped at T and L as the kernel caps them, fit SMEM_LIMIT,
    else a clear error; None: `fitting_tuning`'s."""
    if tuning is None:
        tuning = fitting_tuning(dtype, dqk, dv)
        if tuning is None:
            raise ValueError(f"the Pallas MLA prefill kernel cannot tile Dqk={dqk}, Dv={dv} in "
                             f"{jnp.dtype(dtype).name} within {SMEM_LIMIT} bytes of shared memory: use the "
                             "reference (mla_prefill=reference)")
        return tuning
    capped = dataclasses.replace(tuning, block_q=min(tuning.block_q, max(16, next_pow2(t))),
                                 block_k=min(tuning.block_k, max(16, next_pow2(length))))
    need = smem_bytes(capped, dtype, dqk, dv)
    if need > SMEM_LIMIT:
        fit = fitting_tuning(dtype, dqk, dv, tuning)
        raise ValueError(f"{tuning} needs {need} bytes of shared memory for Dqk={dqk}, Dv={dv} in "
                         f"{jnp.dtype(dtype).name}, over the {SMEM_LIMIT} a program may take: "
                         + (f"use {fit}, or tuning=None" if fit else "use the reference"))
    return tuning
