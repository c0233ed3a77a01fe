"""Pallas-Triton projections of T = 1..16 tokens (decode, verify) and the greedy lm_head: each weight read once.

Layout (ling_jax/params.py): a dense projection is stored [in, out], w [K, N], so a weight row is N contiguous
values. A program owns BN output columns and streams its [K, BN] column panel in [BK, BN] tiles: every tile row is
BN·itemsize contiguous bytes (128 at the default BN = 64 in bf16), the program's threads lie along it, and the
programs of one K-split launch next to each other read neighbouring stripes of the same rows. The tokens are read
from the whole [T, K] input (a few KB, served by L2 after the first program).

Products: every step is a tensor-core dot [16, BK]·[BK, BN] over the tokens padded to 16 rows, one token included
(`GemvTuning.one_token_dot`; Triton pipelines only loads that feed a dot. With it off, T = 1 adds x[k]·w[k, n] into
a [BK, BN] fp32 accumulator by FMAs, reduced over BK once at the end) (masked loads: the padding is zeros, never read from memory); bf16·bf16 products are exact
in fp32, an fp32 operand takes the full-precision dot. Accumulation is fp32; the order differs from XLA's, so the
result equals the reference up to fp32 summation order (then rounded once to the compute dtype).

RMSNorm prologue (`norm=(weight, eps)`): every projection that reads a block's input follows an RMSNorm, and doing
the norm here saves its launch (one per layer on the decode path). Each program first streams x's K tiles (all of
K, a K-split program too: the norm needs the full row) summing squares per token in fp32, giving rsqrt(mean + eps)
per token; the main loop then normalises each loaded x tile before its products with `rms_norm`'s roundings
(ling_jax/layers/norms.py): x·rsqrt rounded to the compute dtype, times the weight in the compute dtype, rounded
again. The repeated prologue reads x from L2 (a few KB), small against the program's [K, BN] weight panel.

Grid (N / BN, KS), the column block fastest. With KS = 1 the program rounds its [T, BN] block to the compute dtype
and adds the optional residual (the `h + proj(x)` of a pre-norm block) in its epilogue. With KS > 1 (more programs
for a short N: the 2560 x 576 MLA kv_a projection has only 9 blocks of 64 columns) each program sums a K/KS slice
into a fp32 partial [KS, T, N] and one small XLA fusion sums the KS partials, rounds once and adds the residual.
N need not be a multiple of BN (the last block's loads and stores are masked); K must be a multiple of 16, and BK is
capped at the largest power of two dividing K/KS.

`greedy_head` (lm_head + greedy sampling, optionally the final norm as its prologue): grid (V / BN,), no K-split;
each program computes its [T, BN] logits in fp32, rounds them to `logits_dtype` (the model's logits are rounded to
the compute dtype) and writes only its block maximum and the lowest column index reaching it, per token ([NB, 16]
each, 2·NB·64 bytes at T = 16); no logits reach HBM. A NaN counts as larger than every number (as in `jnp.argmax`).
An XLA reduce over the NB block maxima then takes the first block holding the largest (jnp.argmax: ties to the lower
block, whose own index is its lowest), so the global pick is the lowest index among equal maxima, exactly
`jnp.argmax` over the logits.

Tunings: `default_tuning` is a heuristic, the widest BN of (64, 32, 16) and the fewest power-of-two K-splits that
give at least MIN_PROGRAMS programs. Against 12 swept tunings on the H200 (experiments/RESULTS.md, GEMV) it was the
fastest at KDA's o_proj and within 3 % at KDA's w_in; one K-split at w_in, 2 % faster alone, lost 130 µs per step
in the model, where the RMSNorm prologue of its 321 programs is not hidden (experiments/FINDINGS.md).
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
# Programs a launch should have to keep the H200's HBM busy: 4 per SM of its 132 (the heuristic's rule).
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
    # One token as a 16-row tensor-core dot (padded rows masked, never read) rather than FMAs: Triton pipelines only
    # the loads that feed a dot, and the lm_head streamed at 98-100 % of 4.3 TB/s through the dot at T = 4 against
    # 88 % by FMAs at T = 1 (experiments/RESULTS.md, GEMV).
    one_token_dot: bool = True

    def __post_init__(self):
        check_pow2_fields(self, ("block_n", "block_k"), 16)  # the T > 1 dot's minimum; sectors are 32 bytes
        check_pow2_fields(self, ("num_warps",))
        for name in ("k_splits", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GemvTuning.{name}={getattr(self, name)} must be an integer >= 1")


def _split_ok(k, ks):
    return k % ks == 0 and (k // ks) % 16 == 0


def default_tuning(n_tokens: int, k: int, n: int) -> GemvTuning:
    """The heuristic tuning of a [T, K] x [K, N] projection (module docstring); T is unused (T = 1 and 4 ranked
    the swept tunings alike)."""
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


# lm_head: 157184 / 128 = 1228 programs at Flash size without a K-split (greedy_head cannot split K); BK 128 was the
# fastest of 9 tunings on the H200 (183.6 µs, 101.9 % of 4.3 TB/s; experiments/RESULTS.md, GEMV).
GREEDY_TUNING = GemvTuning(block_n=128, block_k=128)


def _load(ref, idx, mask):
    """ref[idx], the entries outside `mask` read as zeros and not fetched (mask None: a plain load)."""
    return ref[idx] if mask is None else pltriton.load(ref.at[idx], mask=mask, other=0)


def _token_mask(*, BK, n_tok, rows):
    """Which rows of a [rows, BK] x tile are tokens (None: all of them, or the one token at T = 1)."""
    return None if n_tok == rows else lax.broadcasted_iota(jnp.int32, (rows, BK), 0) < n_tok


def _load_x(x_ref, k, *, BK, rows, row_ok):
    """x_ref's columns [k, k + BK): [BK] of the one token at T = 1, else [rows, BK] with the padded rows zero."""
    if rows == 1:
        return x_ref[0, pl.ds(k, BK)]
    return _load(x_ref, (pl.ds(0, rows), pl.ds(k, BK)), row_ok)


def _inv_rms(x_ref, *, K, BK, n_tok, rows, eps):
    """The norm prologue: rsqrt(mean(x²) + eps) over all K columns of x_ref [T, K], in fp32 -> [] at T = 1, else
    [rows] (a padded row's rsqrt(eps) only ever scales zeros)."""
    row_ok = _token_mask(BK=BK, n_tok=n_tok, rows=rows)

    def body(c, acc):
        xs = _load_x(x_ref, pl.multiple_of(c * BK, BK), BK=BK, rows=rows, row_ok=row_ok).astype(jnp.float32)
        return acc + xs * xs

    shape = (BK,) if rows == 1 else (rows, BK)
    sum_sq = jnp.sum(lax.fori_loop(0, K // BK, body, jnp.zeros(shape, jnp.float32)), axis=-1)
    return lax.rsqrt(sum_sq / K + eps)


def _rms_normed(xs, g, inv_rms):
    """`rms_norm` of an x tile ([BK] or [rows, BK]) given its tokens' inv_rms and the norm weight's tile g [BK]:
    x·inv_rms rounded to x's dtype, then g (rounded to x's dtype) times that, rounded again."""
    dt = xs.dtype
    if xs.ndim == 2:
        inv_rms, g = inv_rms[:, None], g[None, :]
    normed = (xs.astype(jnp.float32) * inv_rms).astype(dt)
    # A product of two bf16 values is exact in fp32, so one rounding of it is the reference's bf16 multiply.
    return (g.astype(dt).astype(jnp.float32) * normed.astype(jnp.float32)).astype(dt)


def _block_products(x_ref, w_ref, *, k0, n_steps, BK, n0, BN, n_cols, n_tok, rows, g_ref=None, inv_rms=None):
    """fp32 products of x_ref [T, K] (compute dtype) with w_ref [K, N] over rows [k0, k0 + n_steps·BK) and columns
    [n0, n0 + BN) -> [rows, BN] (rows = 1 at T = 1, else DOT_ROWS; padded rows are zero). Columns past n_cols are
    loaded as zeros. With g_ref (the norm weight [K]) each x tile is RMS-normed first, by the tokens' inv_rms."""
    col_ok = None if n_cols % BN == 0 else (n0 + lax.broadcasted_iota(jnp.int32, (BK, BN), 1)) < n_cols
    row_ok = _token_mask(BK=BK, n_tok=n_tok, rows=rows)

    def load_w(k):
        return _load(w_ref, (pl.ds(k, BK), pl.ds(n0, BN)), col_ok)

    def load_x(k):
        xs = _load_x(x_ref, k, BK=BK, rows=rows, row_ok=row_ok)
        return xs if g_ref is None else _rms_normed(xs, g_ref[pl.ds(k, BK)], inv_rms)

    def k_at(c):
        return pl.multiple_of(k0 + c * BK, BK)

    if rows == 1:
        def body_fma(c, acc):
            k = k_at(c)
            return acc + load_x(k).astype(jnp.float32)[:, None] * load_w(k).astype(jnp.float32)

        acc = lax.fori_loop(0, n_steps, body_fma, jnp.zeros((BK, BN), jnp.float32))
        return jnp.sum(acc, axis=0)[None, :]

    exact_bf16 = x_ref.dtype == jnp.bfloat16 and w_ref.dtype == jnp.bfloat16

    def body_dot(c, acc):
        k = k_at(c)
        xs = load_x(k)
        w = load_w(k)
        if exact_bf16:
            return acc + lax.dot_general(xs, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + lax.dot_general(xs.astype(jnp.float32), w.astype(jnp.float32), (((1,), (0,)), ((), ())),
                                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, n_steps, body_dot, jnp.zeros((rows, BN), jnp.float32))


def _norm_inputs(x_ref, refs, *, eps, K, BK, n_tok, rows):
    """(g_ref, inv_rms) of the norm prologue, taking g_ref off the front of `refs`; (None, None) without a norm."""
    if eps is None:
        return None, None
    return refs.pop(0), _inv_rms(x_ref, K=K, BK=BK, n_tok=n_tok, rows=rows, eps=eps)


def _out_mask(n0, *, BN, n_cols, n_tok, rows):
    """Which of a [rows, BN] output block's entries exist (None: all of them)."""
    masks = []
    if n_cols % BN:
        masks.append(n0 + lax.broadcasted_iota(jnp.int32, (rows, BN), 1) < n_cols)
    if n_tok != rows:
        masks.append(lax.broadcasted_iota(jnp.int32, (rows, BN), 0) < n_tok)
    return functools.reduce(jnp.logical_and, masks) if masks else None


def gemv_kernel(x_ref, w_ref, *refs, K, k_rows, BK, BN, n_cols, n_tok, rows, split_out, with_residual, eps):
    # x_ref [T, K], w_ref [K, N], then g_ref [K] (the norm weight, any float dtype; eps not None) and r_ref [T, N]
    # (with_residual) in the compute dtype; o_ref [T, N] compute dtype, or [KS, T, N] fp32 partials (split_out).
    # Program (j, s): columns [j·BN, (j+1)·BN), K rows [s, s + 1)·k_rows.
    refs = list(refs)
    o_ref = refs.pop()
    g_ref, inv_rms = _norm_inputs(x_ref, refs, eps=eps, K=K, BK=BK, n_tok=n_tok, rows=rows)
    r_ref = refs.pop(0) if with_residual else None
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    acc = _block_products(x_ref, w_ref, k0=s * k_rows, n_steps=k_rows // BK, BK=BK, n0=n0, BN=BN, n_cols=n_cols,
                          n_tok=n_tok, rows=rows, g_ref=g_ref, inv_rms=inv_rms)
    mask = _out_mask(n0, BN=BN, n_cols=n_cols, n_tok=n_tok, rows=rows)
    idx = (pl.ds(0, rows), pl.ds(n0, BN))
    if split_out:
        pltriton.store(o_ref.at[(s,) + idx], acc, mask=mask)
        return
    y = acc.astype(o_ref.dtype)
    if with_residual:
        y = _load(r_ref, idx, mask) + y
    pltriton.store(o_ref.at[idx], y, mask=mask)


def greedy_kernel(x_ref, w_ref, *refs, K, BK, BN, n_cols, n_tok, rows, logits_dtype, eps):
    # x_ref [T, K], w_ref [K, V] compute dtype, then g_ref [K] (the norm weight; eps not None); m_ref [rows] fp32 and
    # i_ref [rows] int32: this block's maximum logit per token and the lowest column index holding it.
    refs = list(refs)
    g_ref, inv_rms = _norm_inputs(x_ref, refs, eps=eps, K=K, BK=BK, n_tok=n_tok, rows=rows)
    m_ref, i_ref = refs
    n0 = pl.program_id(0) * BN
    acc = _block_products(x_ref, w_ref, k0=0, n_steps=K // BK, BK=BK, n0=n0, BN=BN, n_cols=n_cols, n_tok=n_tok,
                          rows=rows, g_ref=g_ref, inv_rms=inv_rms)
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


def _norm_args(norm):
    """((weight,) or (), eps or None) of `norm` = None | (weight [K], eps): eps becomes a static of the jit."""
    if norm is None:
        return (), None
    weight, eps = norm
    return (weight,), float(eps)


def gemv(x, w, residual=None, *, norm=None, tuning: GemvTuning | None = None):
    """Same contract as `reference.gemv` (w [K, N] in x's dtype; `norm` None or (weight [K], eps: a Python float));
    shapes validated by the dispatcher. `tuning` None: `default_tuning(T, K, N)`."""
    norm_weight, eps = _norm_args(norm)
    return _gemv(x, w, residual, *norm_weight, eps=eps, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("eps", "tuning"))
def _gemv(x, w, residual, *norm_weight, eps, tuning):
    tuning = tuning or default_tuning(x.shape[0], *w.shape)
    t, k, n, k_rows, bk = _split_rows(x, w, tuning, tuning.k_splits)
    bn, ks = tuning.block_n, tuning.k_splits
    rows = 1 if t == 1 and not tuning.one_token_dot else DOT_ROWS
    split_out = ks > 1
    with_residual = residual is not None and not split_out
    out_shape = (jax.ShapeDtypeStruct((ks, t, n), jnp.float32) if split_out
                 else jax.ShapeDtypeStruct((t, n), x.dtype))
    y = pl.pallas_call(
        functools.partial(gemv_kernel, K=k, k_rows=k_rows, BK=bk, BN=bn, n_cols=n, n_tok=t, rows=rows,
                          split_out=split_out, with_residual=with_residual, eps=eps),
        grid=(pl.cdiv(n, bn), ks),
        out_shape=out_shape,
        compiler_params=_params(tuning),
        interpret=interpret_mode(),
        name="gemv_fwd_kernel",
    )(x, w, *norm_weight, *([residual] if with_residual else []))
    if not split_out:
        return y
    y = y.sum(0).astype(x.dtype)
    return y if residual is None else residual + y


def greedy_head(x, w, logits_dtype=None, *, norm=None, tuning: GemvTuning | None = None):
    """Same contract as `reference.greedy_head` (w [K, V] in x's dtype; `norm` None or (weight [K], eps: a Python
    float)); shapes validated by the dispatcher. `tuning` None: GREEDY_TUNING (k_splits must be 1: no logits are
    written to sum)."""
    norm_weight, eps = _norm_args(norm)
    return _greedy_head(x, w, *norm_weight, logits_dtype=logits_dtype, eps=eps, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("logits_dtype", "eps", "tuning"))
def _greedy_head(x, w, *norm_weight, logits_dtype, eps, tuning):
    tuning = tuning or GREEDY_TUNING
    if tuning.k_splits != 1:
        raise ValueError(f"GemvTuning.k_splits={tuning.k_splits}: greedy_head keeps its logits in registers, so it "
                         "cannot sum K-split partials; use k_splits=1")
    t, k, v, _, bk = _split_rows(x, w, tuning, 1)
    bn = tuning.block_n
    rows = 1 if t == 1 and not tuning.one_token_dot else DOT_ROWS
    nb = pl.cdiv(v, bn)
    dt = x.dtype if logits_dtype is None else jnp.dtype(logits_dtype)
    block_max, block_idx = pl.pallas_call(
        functools.partial(greedy_kernel, K=k, BK=bk, BN=bn, n_cols=v, n_tok=t, rows=rows, logits_dtype=dt, eps=eps),
        grid=(nb,),
        in_specs=[pl.no_block_spec] * (2 + len(norm_weight)),
        out_specs=[pl.BlockSpec((None, rows), lambda j: (j, 0)), pl.BlockSpec((None, rows), lambda j: (j, 0))],
        out_shape=[jax.ShapeDtypeStruct((nb, rows), jnp.float32), jax.ShapeDtypeStruct((nb, rows), jnp.int32)],
        compiler_params=_params(tuning),
        interpret=interpret_mode(),
        name="greedy_head_fwd_kernel",
    )(x, w, *norm_weight)
    block_max, block_idx = block_max[:, :t].T, block_idx[:, :t].T  # [T, NB]
    best = jnp.argmax(block_max, axis=1)[:, None]  # first block holding the maximum (NaN first)
    return (jnp.take_along_axis(block_idx, best, axis=1)[:, 0],
            jnp.take_along_axis(block_max, best, axis=1)[:, 0])
