"""Pallas-Triton projections of T = 1..16 tokens (decode, verify) and the greedy lm_head: each weight read once.

Layout (ling_jax/params.py): a dense projection is stored [in, out], w [K, N], so a weight row is N contiguous
values. A program owns BN output columns and streams its [K, BN] column panel in [BK, BN] tiles: every tile row is
BN·itemsize contiguous bytes (128 at the default BN = 64 in bf16), the program's threads lie along it, and the
programs of one K-split launch next to each other read neighbouring stripes of the same rows. The tokens are read
from the whole [T, K] input (a few KB, served by L2 after the first program).

Products: every step is a tensor-core dot [16, BK]·[BK, BN] over the tokens padded to 16 rows (masked loads: the
padding is zeros, never read from memory), one token included (`GemvTuning.one_token_dot`; Triton pipelines only
loads that feed a dot. With it off, T = 1 adds x[k]·w[k, n] into a [BK, BN] fp32 accumulator by FMAs, reduced over
BK once at the end); bf16·bf16 products are exact in fp32, an fp32 operand takes the full-precision dot.
Accumulation is fp32; the order differs from XLA's, so the result equals the reference up to fp32 summation order
(then rounded once to the compute dtype).

FP8 weights (`fp8.Fp8Weight`, layout IN_OUT): q [K, N] E4M3 with scale [ceil(K/128), N] fp32, one scale per 128
rows and output column. At batch 1 the projection is weight streaming, so E4M3 halves the HBM bytes (plus 4 scale
bytes per 128 weight bytes, 3 %). The product is y[n] = sum over 128-row blocks b of scale[b, n] · (sum over the
block's rows of x[k]·q[k, n]), all in fp32: x and q widened exactly, the dequantised weight never rounded to the
compute dtype, only the output rounded once (`reference.gemv`, which dequantises in fp32). A step of BK rows runs as
sub-blocks of min(BK, 128) rows, each inside one scale block (BK is a power of two and every step starts at a
multiple of it), and the block's [BN] scale row multiplies the sub-block's fp32 partial, not each weight:
- One token (`one_token_dot` off, the FP8 default): FMAs. A [32, BN] fp32 partial sums x[k]·q[k, :] over the
  sub-block's 32-row chunks, then the accumulator takes it times the scale row; per weight that is half an
  E4M3x2 -> f16x2 conversion, one f16 -> f32 and one FFMA. Compiled for sm_90 (the venv's Triton 3.8 and ptxas,
  on a CPU; not yet timed): 3.4-4.4 SASS instructions per weight in the loop (16-byte loads, no spills), 4.3-7
  over a whole program with the norm prologue and the epilogue, at the Flash shapes; the first FP8 kernel
  (dequantised to bf16 into the 16-row dot) took 8-10 in the loop and 8-17 per program (25 and 55 in MLA kv_a's
  16-column blocks). 4.3 TB/s over 132 SMs leaves ~7.8 issue slots per weight byte.
- More tokens (or `one_token_dot`): a tensor-core dot per sub-block, x (bf16) with the tile widened to bf16
  (exact: E4M3 values are bf16 values), its fp32 result times the scale row; float32 x takes the full-precision
  dot. The loop is pipelined by hand one step deep (`_fp8_dot`): 3.4-4.6 SASS per weight in the loop, 3.6-5.9
  per program at T = 4 and 16 (the 45-program MLA kv_a: 7-8.4). The model stores FP8 projections ROWS
  (rows.py); this IN_OUT path is the `before` of experiments/bench_gemv.py --fp8 --levers.
The result equals the reference up to fp32 rounding and summation order (then the one rounding to x's dtype).

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

`greedy_head` (lm_head + greedy sampling, optionally the final norm as its prologue; bf16 or fp32 weights only: the
`-fp8` checkpoint keeps the lm_head unquantised): grid (V / BN,), no K-split;
each program computes its [T, BN] logits in fp32, rounds them to `logits_dtype` (the model's logits are rounded to
the compute dtype) and writes only its block maximum and the lowest column index reaching it, per token ([NB, 16]
each, 2·NB·64 bytes at T = 16); no logits reach HBM. A NaN counts as larger than every number (as in `jnp.argmax`).
An XLA reduce over the NB block maxima then takes the first block holding the largest (jnp.argmax: ties to the lower
block, whose own index is its lowest), so the global pick is the lowest index among equal maxima, exactly
`jnp.argmax` over the logits.

Tunings: `default_tuning` is a heuristic, the widest BN of (64, 32, 16) and the fewest power-of-two K-splits that
give at least MIN_PROGRAMS programs. Against 12 swept bf16 tunings on the H200 (experiments/RESULTS.md, GEMV) it was
the fastest at KDA's o_proj and within 3 % at KDA's w_in; one K-split at w_in, 2 % faster alone, lost 130 µs per
step in the model, where the RMSNorm prologue of its 321 programs is not hidden (experiments/FINDINGS.md). FP8
weights have their own rule (`_fp8_default_tuning`), chosen by SASS instructions per weight over a whole program on
sm_90, compiled on a CPU (not yet timed): 128-row steps, 4 warps, BN 128 or 64, K-splits into whole scale blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import fp8, interpret_mode
from pallas_kernels.common.norm import GroupRMS, group_rms_scaled, rms_normed as _rms_normed
from pallas_kernels.common.sizes import check_pow2_fields, is_pow2

MAX_TOKENS = 16  # the tokens fill one 16-row dot; more would want blocks of tokens too (a GEMM kernel)
DOT_ROWS = 16  # tensor-core dots take >= 16 rows: T > 1 tokens are padded to this
SMS = 132  # the H200's streaming multiprocessors
# Programs a launch should have to keep the H200's HBM busy: 4 per SM (the heuristic's rule).
MIN_PROGRAMS = 4 * SMS
# The shortest K-slice default_tuning makes: shorter slices write more fp32 partials per weight byte (a heuristic).
MIN_SPLIT_ROWS = 256
# The FP8 dot path's shortest default K-slice: four 128-row steps (its fixed costs per program grow with T).
FP8_DOT_MIN_SPLIT_ROWS = 512
# FP8 at T = 1 by FMAs: rows per partial (an [R, BN] fp32 accumulator and partial). At 32 ptxas issued up to a whole
# 128-row step's loads before their first use (8 of 8 at KDA's w_in with the norm), at 16 only 2.
FP8_FMA_ROWS = 32
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
    # 88 % by FMAs at T = 1 (experiments/RESULTS.md, GEMV). FP8 weights default to FMAs (fewer instructions per
    # weight; their dot is pipelined by hand either way).
    one_token_dot: bool = True

    def __post_init__(self):
        check_pow2_fields(self, ("block_n", "block_k"), 16)  # the T > 1 dot's minimum; sectors are 32 bytes
        check_pow2_fields(self, ("num_warps",))
        for name in ("k_splits", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GemvTuning.{name}={getattr(self, name)} must be an integer >= 1")


def _split_ok(k, ks):
    return k % ks == 0 and (k // ks) % 16 == 0


def default_tuning(n_tokens: int, k: int, n: int, itemsize: int = 2) -> GemvTuning:
    """The heuristic tuning of a [T, K] x [K, N] projection with weights of `itemsize` bytes (module docstring); T
    is unused for plain weights (T = 1 and 4 ranked the swept tunings alike) and picks the FP8 product's path."""
    if itemsize == 1:
        return _fp8_default_tuning(n_tokens, k, n)
    max_ks = 1
    while _split_ok(k, 2 * max_ks) and k // (2 * max_ks) >= MIN_SPLIT_ROWS:
        max_ks *= 2
    # The widest block: 64 columns, 128 contiguous bytes per weight row.
    bn = 64
    while bn > 16 and pl.cdiv(n, bn) * max_ks < MIN_PROGRAMS:
        bn //= 2
    ks = 1
    while ks < max_ks and pl.cdiv(n, bn) * ks < MIN_PROGRAMS:
        ks *= 2
    return GemvTuning(block_n=bn, k_splits=ks)


def fp8_splits(k: int, min_rows: int = MIN_SPLIT_ROWS) -> list[int]:
    """The K-split counts FP8 defaults choose from, ascending: slices of whole 128-row scale blocks (of 16 rows
    when K is not a multiple of 128) and at least min_rows rows; [1] when none is."""
    unit = fp8.BLOCK if k % fp8.BLOCK == 0 else 16
    return [d for d in range(1, k // min_rows + 1) if k % d == 0 and (k // d) % unit == 0] or [1]


def _fp8_default_tuning(n_tokens, k, n):
    """FP8 weights (module docstring, Tunings): 128-row steps (one scale block each), 4 warps, 128 or 64 columns
    (128 or 64 contiguous bytes per row; narrower blocks would load less than a 16-byte vector per thread), and
    K-splits into whole scale blocks, any count (K = 2560 is 20 blocks: a split in 5 or 10 keeps 128-row steps
    where 8 would cap BK at 64). One token (FMAs, whose loads in flight come from occupancy): the bf16 rule, the
    widest block reaching MIN_PROGRAMS with the most splits, then the fewest splits reaching it. More tokens (the
    dot): fixed costs per program grow with T (the norm prologue over all of K, each step's [16, 128] x tile
    normed, the [16, BN] epilogue), so 128 columns unless that leaves fewer than one program per SM, splits of
    at least FP8_DOT_MIN_SPLIT_ROWS rows, and the fewest reaching MIN_PROGRAMS / 2 (two programs per SM at
    ~180 registers per thread). 128 columns at one token too unless fewer than one program per SM: on the H200
    KDA's o_proj took 7.1 µs at bn128 ks16 against 8.7 at bn64, MLA's w_qg 11.8 against 12.3
    (experiments/RESULTS.md, GEMV FP8)."""
    one_token = n_tokens == 1
    min_rows, target = (MIN_SPLIT_ROWS, MIN_PROGRAMS) if one_token else (FP8_DOT_MIN_SPLIT_ROWS, MIN_PROGRAMS // 2)
    splits = fp8_splits(k, min_rows)
    bn, narrow_below = 128, SMS
    if pl.cdiv(n, bn) * splits[-1] < narrow_below:
        bn = 64
    ks = next((d for d in splits if pl.cdiv(n, bn) * d >= target), splits[-1])
    return GemvTuning(block_n=bn, block_k=fp8.BLOCK, k_splits=ks, num_warps=4, one_token_dot=False)


# lm_head: 157184 / 128 = 1228 programs at Flash size without a K-split (greedy_head cannot split K); BK 128 was the
# fastest of 9 tunings on the H200 (183.6 µs, 101.9 % of 4.3 TB/s; experiments/RESULTS.md, GEMV).
GREEDY_TUNING = GemvTuning(block_n=128, block_k=128)


def _load(ref, idx, mask):
    """ref[idx], the entries outside `mask` read as zeros and not fetched (mask None: a plain load)."""
    if mask is None:
        return ref[idx]
    # A float zero for E4M3: the Triton lowering casts no integer to float8.
    return pltriton.load(ref.at[idx], mask=mask, other=0.0 if ref.dtype == fp8.FP8_DTYPE else 0)


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


def _scale_row(s_ref, k, *, n0, BN, n_cols):
    """The FP8 scale row [BN] (fp32) of weight row k's 128-row block, columns [n0, n0 + BN)."""
    col_ok = None if n_cols % BN == 0 else (n0 + lax.broadcasted_iota(jnp.int32, (BN,), 0)) < n_cols
    return _load(s_ref, (lax.div(k, fp8.BLOCK), pl.ds(n0, BN)), col_ok)


@dataclasses.dataclass(frozen=True)
class _GroupScale:
    """A GroupRMS input in a one-token program: its sums of squares ss_ref [1, G, P], S columns per group, eps, and
    the compute dtype its scaled values are rounded to."""
    ss_ref: object
    S: int
    eps: float
    dtype: object

    def scaled(self, xs, k):
        """The fp32 piece xs at column k (inside one group) times its group's rsqrt(Σ sum_sq / S + eps), rounded."""
        g = k // self.S if isinstance(k, int) else lax.div(k, self.S)
        return group_rms_scaled(xs, self.ss_ref[0, g, :], self.S, self.eps, self.dtype)


def _block_products(x_ref, w_ref, *, k0, n_steps, BK, n0, BN, n_cols, n_tok, rows, s_ref=None, g_ref=None,
                    inv_rms=None, group_rms=None):
    """fp32 products of x_ref [T, K] (compute dtype) with w_ref [K, N] over rows [k0, k0 + n_steps·BK) and columns
    [n0, n0 + BN) -> [rows, BN] (rows = 1 at T = 1, else DOT_ROWS; padded rows are zero). Columns past n_cols are
    loaded as zeros. With s_ref the weight is FP8 (w_ref the E4M3 values, s_ref their [ceil(K/128), N] scales:
    `_fp8_products`); with g_ref (the norm weight [K]) each x tile is RMS-normed first, by the tokens' inv_rms;
    with group_rms (`_GroupScale`, one token, plain weights) x_ref holds a GroupRMS input's fp32 values."""
    if s_ref is not None:
        return _fp8_products(x_ref, w_ref, s_ref, k0=k0, n_steps=n_steps, BK=BK, n0=n0, BN=BN, n_cols=n_cols,
                             n_tok=n_tok, rows=rows, g_ref=g_ref, inv_rms=inv_rms)
    dt = x_ref.dtype if group_rms is None else group_rms.dtype
    col_ok = _col_mask(n0, BK, BN=BN, n_cols=n_cols)
    row_ok = _token_mask(BK=BK, n_tok=n_tok, rows=rows)

    def load_w(k):
        return _load(w_ref, (pl.ds(k, BK), pl.ds(n0, BN)), col_ok)

    def load_x(k):
        xs = _load_x(x_ref, k, BK=BK, rows=rows, row_ok=row_ok)
        if group_rms is not None:
            return group_rms.scaled(xs, k)
        return xs if g_ref is None else _rms_normed(xs, g_ref[pl.ds(k, BK)], inv_rms)

    if rows == 1:
        def body_fma(c, acc):
            k = pl.multiple_of(k0 + c * BK, BK)
            return acc + load_x(k).astype(jnp.float32)[:, None] * load_w(k).astype(jnp.float32)

        acc = lax.fori_loop(0, n_steps, body_fma, jnp.zeros((BK, BN), jnp.float32))
        return jnp.sum(acc, axis=0)[None, :]

    exact_bf16 = dt == jnp.bfloat16 and w_ref.dtype == jnp.bfloat16

    def body_dot(c, acc):
        k = pl.multiple_of(k0 + c * BK, BK)
        return acc + _dot(load_x(k), load_w(k), exact_bf16)

    return lax.fori_loop(0, n_steps, body_dot, jnp.zeros((rows, BN), jnp.float32))


def _col_mask(n0, n_rows, *, BN, n_cols):
    """Which columns of an [n_rows, BN] tile at column n0 exist (None: all of them)."""
    return None if n_cols % BN == 0 else (n0 + lax.broadcasted_iota(jnp.int32, (n_rows, BN), 1)) < n_cols


def _dot(xs, w, exact_bf16):
    """xs [rows, R] · w [R, BN] -> fp32 [rows, BN]: bf16·bf16 products are exact in fp32 (exact_bf16); otherwise
    both operands are widened to fp32 and take the full-precision dot."""
    if exact_bf16:
        return lax.dot_general(xs, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return lax.dot_general(xs.astype(jnp.float32), w.astype(jnp.float32), (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_products(x_ref, w_ref, s_ref, *, k0, n_steps, BK, n0, BN, n_cols, n_tok, rows, g_ref, inv_rms):
    """`_block_products` of an FP8 weight: the sum over 128-row scale blocks b of scale[b] · (x · q over the
    block's rows), all in fp32 (module docstring). A step of BK rows is min(BK, 128)-row sub-blocks, each inside
    one scale block: BK is a power of two and every step starts at a multiple of it."""
    SB = min(BK, fp8.BLOCK)

    def sub_blocks(c):
        k = k0 + c * BK
        return [pl.multiple_of(k + i * SB, SB) for i in range(BK // SB)]

    def scale_row(k):  # [1, BN] fp32, the row of the scale block holding weight row k
        return _scale_row(s_ref, k, n0=n0, BN=BN, n_cols=n_cols)[None, :]

    def load_x(k, n_rows, row_ok):
        return _load_x(x_ref, k, BK=n_rows, rows=rows, row_ok=row_ok)

    def normed(xs, k, n_rows):
        return xs if g_ref is None else _rms_normed(xs, g_ref[pl.ds(k, n_rows)], inv_rms)

    if rows == 1:
        return _fp8_fma(w_ref, n_steps=n_steps, SB=SB, n0=n0, BN=BN, n_cols=n_cols, sub_blocks=sub_blocks,
                        scale_row=scale_row, load_x=load_x, normed=normed)
    return _fp8_dot(w_ref, x_ref.dtype, n_steps=n_steps, SB=SB, n0=n0, BN=BN, n_cols=n_cols, n_tok=n_tok,
                    rows=rows, sub_blocks=sub_blocks, scale_row=scale_row, load_x=load_x, normed=normed)


def _fp8_fma(w_ref, *, n_steps, SB, n0, BN, n_cols, sub_blocks, scale_row, load_x, normed):
    """One token by FMAs: an [R, BN] fp32 partial sums x[k]·q[k, :] over a sub-block's R-row chunks (R =
    FP8_FMA_ROWS), then the [R, BN] accumulator takes the partial times the block's scale row (one multiply per
    SB/R weights, not one per weight); its R rows are summed once at the end. Triton pipelines none of these loads
    (no dot reads them): the bytes in flight come from ptxas issuing a step's 16-byte loads ahead of their use and
    from several programs per SM."""
    R = min(SB, FP8_FMA_ROWS)
    col_ok = _col_mask(n0, R, BN=BN, n_cols=n_cols)

    def body(c, acc):
        for kb in sub_blocks(c):
            part = None
            for k in [pl.multiple_of(kb + i * R, R) for i in range(SB // R)]:
                xs = normed(load_x(k, R, None), k, R).astype(jnp.float32)
                p = xs[:, None] * _load(w_ref, (pl.ds(k, R), pl.ds(n0, BN)), col_ok).astype(jnp.float32)
                part = p if part is None else part + p
            acc = acc + part * scale_row(kb)
        return acc

    acc = lax.fori_loop(0, n_steps, body, jnp.zeros((R, BN), jnp.float32))
    return jnp.sum(acc, axis=0)[None, :]


def _fp8_dot(w_ref, dt, *, n_steps, SB, n0, BN, n_cols, n_tok, rows, sub_blocks, scale_row, load_x, normed):
    """Tokens padded to `rows` by tensor-core dots, one per sub-block, each fp32 result times its scale row.

    The loop is software-pipelined by hand, one step deep: a step's tiles (x, the E4M3 values widened to f16 right
    after their 16-byte loads, the scale rows) are carried into the next iteration, which computes on them while
    the following step's loads are in flight. Left to itself, Triton pipelines a weight tile that feeds a dot
    through shared memory and reads it back in the dot's operand layout, one byte per weight (the rows are
    N-contiguous, the operand wants K-pairs), converting each byte there: ~5.4 SASS instructions per weight on
    sm_90. A carried tile is a register value, widened in its load layout (f16 holds every E4M3 value exactly, two
    to a register) and passed to the dot through shared memory as a bf16 weight is: ~3.4 per weight (4-4.6 with
    the norm, whose x tiles are normed per step)."""
    exact_bf16 = dt == jnp.bfloat16
    col_ok = _col_mask(n0, SB, BN=BN, n_cols=n_cols)
    row_ok = _token_mask(BK=SB, n_tok=n_tok, rows=rows)

    def load_step(c):
        return [(load_x(k, SB, row_ok), _load(w_ref, (pl.ds(k, SB), pl.ds(n0, BN)), col_ok).astype(jnp.float16),
                 scale_row(k)) for k in sub_blocks(c)]

    def compute(c, acc, tiles):
        for k, (xs, q16, scale) in zip(sub_blocks(c), tiles):
            w = q16.astype(jnp.bfloat16 if exact_bf16 else jnp.float32)
            acc = acc + _dot(normed(xs, k, SB), w, exact_bf16) * scale
        return acc

    def body(c, carry):
        acc, tiles = carry
        ahead = load_step(c + 1)
        return compute(c, acc, tiles), ahead

    acc, last = lax.fori_loop(0, n_steps - 1, body, (jnp.zeros((rows, BN), jnp.float32), load_step(0)))
    return compute(n_steps - 1, acc, last)


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


def gemv_kernel(x_ref, w_ref, *refs, K, k_rows, BK, BN, n_cols, n_tok, rows, split_out, with_residual, eps,
                with_scale, rms_group=0, rms_dtype=None):
    # x_ref [T, K], w_ref [K, N] (x's dtype, or E4M3), then s_ref [ceil(K/128), N] fp32 (with_scale: FP8), g_ref [K]
    # (the norm weight, any float dtype; eps not None) or ss_ref [1, G, P] (rms_group > 0: x_ref is a GroupRMS
    # input's fp32 values, these its sums of squares; eps and rms_dtype its), and r_ref [T, N] (with_residual) in the
    # compute dtype; o_ref [T, N] compute dtype, or [KS, T, N] fp32 partials (split_out).
    # Program (j, s): columns [j·BN, (j+1)·BN), K rows [s, s + 1)·k_rows.
    refs = list(refs)
    o_ref = refs.pop()
    s_ref = refs.pop(0) if with_scale else None
    group_rms = _GroupScale(refs.pop(0), rms_group, eps, jnp.dtype(rms_dtype)) if rms_group else None
    g_ref, inv_rms = _norm_inputs(x_ref, refs, eps=None if rms_group else eps, K=K, BK=BK, n_tok=n_tok, rows=rows)
    r_ref = refs.pop(0) if with_residual else None
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    acc = _block_products(x_ref, w_ref, k0=s * k_rows, n_steps=k_rows // BK, BK=BK, n0=n0, BN=BN, n_cols=n_cols,
                          n_tok=n_tok, rows=rows, s_ref=s_ref, g_ref=g_ref, inv_rms=inv_rms, group_rms=group_rms)
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


def check_sizes(t, k, n, k_axis="w.shape[0]"):
    """Raise unless the kernels take T tokens and a weight of K inputs (at `k_axis`) and N outputs (any tuning)."""
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"the Pallas GEMV takes 1 <= T <= {MAX_TOKENS} tokens; got T={t} (more tokens: "
                         "backend='reference')")
    if k % 16:
        raise ValueError(f"the Pallas GEMV needs K={k} ({k_axis}) divisible by 16")
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


def takes_group_rms(x, w, tuning: GemvTuning | None = None) -> bool:
    """Whether the kernel applies a GroupRMS input x in its prologue: one token, a plain weight, and K-steps that
    stay inside one group (a group's S columns a multiple of the tuning's block_k)."""
    if x.lead[0] != 1 or isinstance(w, fp8.Fp8Weight) or not is_pow2(x.sum_sq.shape[-1]):
        return False
    k, n = w.shape
    tuning = tuning or default_tuning(1, k, n, jnp.dtype(w.dtype).itemsize)
    bk = min(tuning.block_k, (k // tuning.k_splits) & -(k // tuning.k_splits))
    return x.group % bk == 0


def gemv(x, w, residual=None, *, norm=None, tuning: GemvTuning | None = None):
    """Same contract as `reference.gemv` (w [K, N] in x's dtype, or an IN_OUT `fp8.Fp8Weight` of that shape; `norm`
    None or (weight [K], eps: a Python float)); shapes validated by the dispatcher. `tuning` None:
    `default_tuning(T, K, N, weight itemsize)`. x may be a `GroupRMS` [T, K] (no `norm`): applied in the prologue
    where `takes_group_rms`, else by XLA first."""
    if isinstance(x, GroupRMS):
        if not takes_group_rms(x, w, tuning):
            return gemv(x.apply(), w, residual, tuning=tuning)
        return _gemv(x.values, w, (), residual, x.sum_sq, eps=x.eps, tuning=tuning, rms_dtype=x.dtype)
    norm_weight, eps = _norm_args(norm)
    q, scale = (w.q, (w.scale,)) if isinstance(w, fp8.Fp8Weight) else (w, ())
    return _gemv(x, q, scale, residual, *norm_weight, eps=eps, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("eps", "tuning", "rms_dtype"))
def _gemv(x, w, scale, residual, *prologue, eps, tuning, rms_dtype=None):
    # w: [K, N] in x's dtype, or the E4M3 values with scale = (their fp32 scales,); scale () for a plain weight.
    # prologue: (the norm weight,), (a GroupRMS input's sums of squares,) with rms_dtype, or ().
    tuning = tuning or default_tuning(x.shape[0], *w.shape, jnp.dtype(w.dtype).itemsize)
    t, k, n, k_rows, bk = _split_rows(x, w, tuning, tuning.k_splits)
    bn, ks = tuning.block_n, tuning.k_splits
    rows = 1 if t == 1 and not tuning.one_token_dot else DOT_ROWS
    rms_group = k // prologue[0].shape[1] if rms_dtype is not None else 0
    out_dtype = jnp.dtype(rms_dtype) if rms_group else x.dtype
    split_out = ks > 1
    with_residual = residual is not None and not split_out
    out_shape = (jax.ShapeDtypeStruct((ks, t, n), jnp.float32) if split_out
                 else jax.ShapeDtypeStruct((t, n), out_dtype))
    y = pl.pallas_call(
        functools.partial(gemv_kernel, K=k, k_rows=k_rows, BK=bk, BN=bn, n_cols=n, n_tok=t, rows=rows,
                          split_out=split_out, with_residual=with_residual, eps=eps, with_scale=bool(scale),
                          rms_group=rms_group, rms_dtype=out_dtype if rms_group else None),
        grid=(pl.cdiv(n, bn), ks),
        out_shape=out_shape,
        compiler_params=_params(tuning),
        interpret=interpret_mode(),
        name="gemv_fwd_kernel",
    )(x, w, *scale, *prologue, *([residual] if with_residual else []))
    if not split_out:
        return y
    y = y.sum(0).astype(out_dtype)
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
