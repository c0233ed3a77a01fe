"""Pallas-Triton projections of T = 1..16 tokens (decode, verify) and the greedy lm_head: each weight read once.

Layout (ling_jax/params.py): a dense projection is stored [in, out], w [K, N], so a weight row is N contiguous
values. A program owns BN output columns and streams its [K, BN] column panel in [BK, BN] tiles: every tile row is
BN·itemsize contiguous bytes (128 at the default BN = 64 in bf16), the program's threads lie along it, and the
programs of one K-split launch next to each other read neighbouring stripes of the same rows. The tokens are read
from the whole [T, K] input (a few KB, served by L2 after the first program).

Products: at T = 1 each tile adds x[k]·w[k, n] into a [BK, BN] fp32 accumulator by FMAs, reduced over BK once at the
end (no cross-thread reduction per step). At T > 1 every step is a tensor-core dot [16, BK]·[BK, BN] over the
tokens padded to 16 rows (masked loads: the padding is zeros, never read from memory); bf16·bf16 products are exact
in fp32, an fp32 operand takes the full-precision dot. Accumulation is fp32; the order differs from XLA's, so the
result equals the reference up to fp32 summation order (then rounded once to the compute dtype).

Grid (N / BN, KS), the column block fastest. With KS = 1 the program rounds its [T, BN] block to the compute dtype
and adds the optional residual (the `h + proj(x)` of a pre-norm block) in its epilogue. With KS > 1 (more programs
for a short N: the 2560 x 576 MLA kv_a projection has only 9 blocks of 64 columns) each program sums a K/KS slice
into a fp32 partial [KS, T, N] and one small XLA fusion sums the KS partials, rounds once and adds the residual.
N need not be a multiple of BN (the last block's loads and stores are masked); K must be a multiple of 16, and BK is
capped at the largest power of two dividing K/KS.

`greedy_head` (lm_head + greedy sampling): grid (V / BN,), no K-split; each program computes its [T, BN] logits in
fp32, rounds them to `logits_dtype` (the model's logits are rounded to the compute dtype) and writes only its block
maximum and the lowest column index reaching it, per token ([NB, 16] each, 2·NB·64 bytes at T = 16); no logits
reach HBM. A NaN counts as larger than every number (as in `jnp.argmax`). An XLA reduce over the NB block maxima
then takes the first block holding the largest (jnp.argmax: ties to the lower block, whose own index is its lowest),
so the global pick is the lowest index among equal maxima, exactly `jnp.argmax` over the logits.

Tunings: `default_tuning` is a heuristic to be replaced by a sweep (experiments/bench_gemv.py): the widest BN of
(64, 32, 16) and the fewest power-of-two K-splits that give at least MIN_PROGRAMS programs.
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

MAX_TOKENS = 16  # the tokens fill one 16-row dot; more would want blocks of tokens too (a GEMM kernel)
DOT_ROWS = 16  # tensor-core dots take >= 16 rows: T > 1 tokens are padded to this
# Programs a launch should have to keep the H200's HBM busy: 4 per SM of its 132 (a heuristic until swept).
MIN_PROGRAMS = 528
# The shortest K-slice default_tuning makes: shorter slices write more fp32 partials per weight byte (a heuristic).
MIN_SPLIT_ROWS = 256
_NO_INDEX = 2 ** 31 - 1  # larger than every column index: the min-index reduction's identity


@dataclasses.dataclass(frozen=True)
class GemvTuning:
    block_n: int = 64  # BN: output columns per program (BN·itemsize contiguous bytes per weight row)
    block_k: int = 64  # BK: weight rows per step (capped at the largest power of two dividing K / KS)
    k_splits: int = 1  # KS: K-slices summed by an XLA fusion (gemv only; greedy_head takes 1)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_pow2_fields(self, ("block_n", "block_k"), 16)  # the T > 1 dot's minimum; sectors are 32 bytes
        check_pow2_fields(self, ("num_warps",))
        for name in ("k_splits", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GemvTuning.{name}={getattr(self, name)} must be an integer >= 1")


def _split_ok(k, ks):
    return k % ks == 0 and (k // ks) % 16 == 0


def default_tuning(n_tokens: int, k: int, n: int) -> GemvTuning:
    """The heuristic tuning of a [T, K] x [K, N] projection (module docstring); T is unused until a sweep tells
    tokens apart."""
    del n_tokens
    max_ks = 1
    while _split_ok(k, 2 * max_ks) and k // (2 * max_ks) >= MIN_SPLIT_ROWS:
        max_ks *= 2
    bn = 64
    while bn > 16 and pl.cdiv(n, bn) * max_ks < MIN_PROGRAMS:
        bn //= 2
    ks = 1
    while ks < max_ks and pl.cdiv(n, bn) * ks < MIN_PROGRAMS:
        ks *= 2
    return GemvTuning(block_n=bn, k_splits=ks)


# lm_head: 157184 / 128 = 1228 programs at Flash size without a K-split (greedy_head cannot split K).
GREEDY_TUNING = GemvTuning(block_n=128)


def _load(ref, idx, mask):
    """ref[idx], the entries outside `mask` read as zeros and not fetched (mask None: a plain load)."""
    return ref[idx] if mask is None else pltriton.load(ref.at[idx], mask=mask, other=0)


def _block_products(x_ref, w_ref, *, k0, n_steps, BK, n0, BN, n_cols, n_tok, rows):
    """fp32 products of x_ref [T, K] (compute dtype) with w_ref [K, N] over rows [k0, k0 + n_steps·BK) and columns
    [n0, n0 + BN) -> [rows, BN] (rows = 1 at T = 1, else DOT_ROWS; padded rows are zero). Columns past n_cols are
    loaded as zeros."""
    col_ok = None if n_cols % BN == 0 else (n0 + lax.broadcasted_iota(jnp.int32, (BK, BN), 1)) < n_cols
    row_ok = None if n_tok == rows else lax.broadcasted_iota(jnp.int32, (rows, BK), 0) < n_tok

    def load_w(k):
        return _load(w_ref, (pl.ds(k, BK), pl.ds(n0, BN)), col_ok)

    def k_at(c):
        return pl.multiple_of(k0 + c * BK, BK)

    if rows == 1:
        def body_fma(c, acc):
            k = k_at(c)
            return acc + x_ref[0, pl.ds(k, BK)].astype(jnp.float32)[:, None] * load_w(k).astype(jnp.float32)

        acc = lax.fori_loop(0, n_steps, body_fma, jnp.zeros((BK, BN), jnp.float32))
        return jnp.sum(acc, axis=0)[None, :]

    exact_bf16 = x_ref.dtype == jnp.bfloat16 and w_ref.dtype == jnp.bfloat16

    def body_dot(c, acc):
        k = k_at(c)
        xs = _load(x_ref, (pl.ds(0, rows), pl.ds(k, BK)), row_ok)
        w = load_w(k)
        if exact_bf16:
            return acc + lax.dot_general(xs, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + lax.dot_general(xs.astype(jnp.float32), w.astype(jnp.float32), (((1,), (0,)), ((), ())),
                                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, n_steps, body_dot, jnp.zeros((rows, BN), jnp.float32))


def _out_mask(n0, *, BN, n_cols, n_tok, rows):
    """Which of a [rows, BN] output block's entries exist (None: all of them)."""
    masks = []
    if n_cols % BN:
        masks.append(n0 + lax.broadcasted_iota(jnp.int32, (rows, BN), 1) < n_cols)
    if n_tok != rows:
        masks.append(lax.broadcasted_iota(jnp.int32, (rows, BN), 0) < n_tok)
    return functools.reduce(jnp.logical_and, masks) if masks else None


def gemv_kernel(x_ref, w_ref, *refs, k_rows, BK, BN, n_cols, n_tok, rows, split_out, with_residual):
    # x_ref [T, K], w_ref [K, N], r_ref [T, N] (with_residual) in the compute dtype; o_ref [T, N] compute dtype, or
    # [KS, T, N] fp32 partials (split_out). Program (j, s): columns [j·BN, (j+1)·BN), K rows [s, s + 1)·k_rows.
    r_ref = refs[0] if with_residual else None
    o_ref = refs[-1]
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    acc = _block_products(x_ref, w_ref, k0=s * k_rows, n_steps=k_rows // BK, BK=BK, n0=n0, BN=BN, n_cols=n_cols,
                          n_tok=n_tok, rows=rows)
    mask = _out_mask(n0, BN=BN, n_cols=n_cols, n_tok=n_tok, rows=rows)
    idx = (pl.ds(0, rows), pl.ds(n0, BN))
    if split_out:
        pltriton.store(o_ref.at[(s,) + idx], acc, mask=mask)
        return
    y = acc.astype(o_ref.dtype)
    if with_residual:
        y = _load(r_ref, idx, mask) + y
    pltriton.store(o_ref.at[idx], y, mask=mask)


def greedy_kernel(x_ref, w_ref, m_ref, i_ref, *, K, BK, BN, n_cols, n_tok, rows, logits_dtype):
    # x_ref [T, K], w_ref [K, V] compute dtype; m_ref [rows] fp32 and i_ref [rows] int32: this block's maximum
    # logit per token and the lowest column index holding it.
    n0 = pl.program_id(0) * BN
    acc = _block_products(x_ref, w_ref, k0=0, n_steps=K // BK, BK=BK, n0=n0, BN=BN, n_cols=n_cols, n_tok=n_tok,
                          rows=rows)
    logits = acc.astype(logits_dtype).astype(jnp.float32)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (rows, BN), 1)
    valid = cols < n_cols
    is_nan = logits != logits
    # The key has no NaN, so the max and the compares below do not depend on how the target's max treats one.
    key = jnp.where(valid, jnp.where(is_nan, jnp.inf, logits), -jnp.inf)
    m = jnp.max(key, axis=1)
    any_nan = jnp.max(jnp.where(valid & is_nan, 1, 0), axis=1) > 0
    hit = jnp.where(any_nan[:, None], valid & is_nan, valid & (key == m[:, None]))
    i_ref[...] = jnp.min(jnp.where(hit, cols, _NO_INDEX), axis=1)
    m_ref[...] = jnp.where(any_nan, jnp.nan, m)


def check_sizes(t, k, n):
    """Raise unless the kernels take T tokens and a [K, N] weight (any tuning)."""
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"the Pallas GEMV takes 1 <= T <= {MAX_TOKENS} tokens; got T={t} (more tokens: "
                         "backend='reference')")
    if k % 16:
        raise ValueError(f"the Pallas GEMV needs K={k} (w.shape[0]) divisible by 16")
    if k * n >= 2 ** 31:
        raise ValueError(f"w.shape={(k, n)} has K·N >= 2^31 elements: the kernel's int32 offsets would overflow")


def _split_rows(x, w, tuning, k_splits):
    """(T, K, N, rows per K-split, BK) after checking the sizes and the split."""
    t, k = x.shape
    n = w.shape[1]
    check_sizes(t, k, n)
    if not _split_ok(k, k_splits):
        raise ValueError(f"GemvTuning.k_splits={k_splits} must split K={k} into equal slices of a multiple of 16 rows")
    k_rows = k // k_splits
    return t, k, n, k_rows, min(tuning.block_k, k_rows & -k_rows)


def _params(tuning):
    return pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)


@functools.partial(jax.jit, static_argnames=("tuning",))
def gemv(x, w, residual=None, *, tuning: GemvTuning | None = None):
    """Same contract as `reference.gemv` (w [K, N] in x's dtype); shapes validated by the dispatcher.
    `tuning` None: `default_tuning(T, K, N)`."""
    tuning = tuning or default_tuning(x.shape[0], *w.shape)
    t, _, n, k_rows, bk = _split_rows(x, w, tuning, tuning.k_splits)
    bn, ks = tuning.block_n, tuning.k_splits
    rows = 1 if t == 1 else DOT_ROWS
    split_out = ks > 1
    with_residual = residual is not None and not split_out
    out_shape = (jax.ShapeDtypeStruct((ks, t, n), jnp.float32) if split_out
                 else jax.ShapeDtypeStruct((t, n), x.dtype))
    y = pl.pallas_call(
        functools.partial(gemv_kernel, k_rows=k_rows, BK=bk, BN=bn, n_cols=n, n_tok=t, rows=rows,
                          split_out=split_out, with_residual=with_residual),
        grid=(pl.cdiv(n, bn), ks),
        out_shape=out_shape,
        compiler_params=_params(tuning),
        interpret=interpret_mode(),
        name="gemv_fwd_kernel",
    )(x, w, *([residual] if with_residual else []))
    if not split_out:
        return y
    y = y.sum(0).astype(x.dtype)
    return y if residual is None else residual + y


@functools.partial(jax.jit, static_argnames=("logits_dtype", "tuning"))
def greedy_head(x, w, logits_dtype=None, *, tuning: GemvTuning | None = None):
    """Same contract as `reference.greedy_head` (w [K, V] in x's dtype); shapes validated by the dispatcher.
    `tuning` None: GREEDY_TUNING (k_splits must be 1: no logits are written to sum)."""
    tuning = tuning or GREEDY_TUNING
    if tuning.k_splits != 1:
        raise ValueError(f"GemvTuning.k_splits={tuning.k_splits}: greedy_head keeps its logits in registers, so it "
                         "cannot sum K-split partials; use k_splits=1")
    t, k, v, _, bk = _split_rows(x, w, tuning, 1)
    bn = tuning.block_n
    rows = 1 if t == 1 else DOT_ROWS
    nb = pl.cdiv(v, bn)
    dt = x.dtype if logits_dtype is None else jnp.dtype(logits_dtype)
    block_max, block_idx = pl.pallas_call(
        functools.partial(greedy_kernel, K=k, BK=bk, BN=bn, n_cols=v, n_tok=t, rows=rows, logits_dtype=dt),
        grid=(nb,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=[pl.BlockSpec((None, rows), lambda j: (j, 0)), pl.BlockSpec((None, rows), lambda j: (j, 0))],
        out_shape=[jax.ShapeDtypeStruct((nb, rows), jnp.float32), jax.ShapeDtypeStruct((nb, rows), jnp.int32)],
        compiler_params=_params(tuning),
        interpret=interpret_mode(),
        name="greedy_head_fwd_kernel",
    )(x, w)
    block_max, block_idx = block_max[:, :t].T, block_idx[:, :t].T  # [T, NB]
    best = jnp.argmax(block_max, axis=1)[:, None]  # first block holding the maximum (NaN first)
    return (jnp.take_along_axis(block_idx, best, axis=1)[:, 0],
            jnp.take_along_axis(block_max, best, axis=1)[:, 0])
