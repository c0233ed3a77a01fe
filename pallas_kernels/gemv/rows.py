"""Pallas-Triton FP8 projection over output rows (layout ROWS): T = 1..16 tokens, each weight byte read once.

Layout (`fp8.ROWS`): q [N, K] E4M3, every output row K contiguous bytes (the checkpoint's own [out, in]), scale
[N, ceil(K/128)] fp32, one per output row and 128-column block: the checkpoint's 128x128 block scale repeated over
its rows, so fused per-head packing of several source tensors stays exact (`fp8.convert_layout` makes it from an
IN_OUT weight, exactly). A program owns BN contiguous output rows and a K-slice of whole 128-column blocks; a
block's tile [BN, 128] is BN runs of 128 contiguous bytes, and a thread's 16-byte load lies along one row.

Loads in flight (`RowsTuning.unroll`). Unrolled, the slice's blocks are a static Python loop: every weight tile and
scale column is loaded before the first product, so a thread has its whole slice in flight (16 rows x 2560 columns
over 4 warps: 20 16-byte loads, ~80 registers; `MAX_UNROLLED_BYTES_PER_THREAD` caps it). An untuned probe of this
shape read KDA's w_in [20480 x 2560] at 3.0 TB/s on the H200, against 1.9 for kernel.py's [K, N] loop (in the
tuned kernel, with the norm, w_in's FMAs ran faster looped: Tunings). Looped, the blocks are a fori_loop, which
Triton software-pipelines `num_stages` deep (cp.async into shared memory) when the tile feeds a dot: the lever that
took the bf16 kernel to 86-88 % of 4.3 TB/s. The dot is looped by default; an
unrolled dot runs on one warp over K-slices of <= 640 columns, because at 4 warps every warp computed the whole
[16, 16] dot, converting the whole tile, and at w_in it spilled (255 registers, 1.8 KB of stack, 21.6 SASS
instructions per weight, sm_90).

Products, all fp32 with x and q widened exactly (reference: x · dequantize(w, float32)):
- one token by FMAs (the default at T = 1): per block the [BN, 128] products x[k]·q[n, k] summed over k, times the
  block's scale column [BN], added to a [BN] accumulator;
- a tensor-core dot (T > 1, or `one_token_dot`): per block x [16, 128] (more tokens: the padded rows masked, never
  read; one token: its row padded with zeros in registers) against the tile widened to bf16 through f16 (exact:
  E4M3 values are bf16 values), the fp32 [16, BN] times the scale column; float32 x takes the full-precision dot
  of the tile widened to fp32. 64 rows on 4 warps (`DOT_BLOCK_N`).
The output is rounded once to x's dtype; the result equals the reference up to fp32 summation order.

RMSNorm prologue (`norm=(weight, eps)`, `rms_norm`'s roundings: x·rsqrt rounded to x's dtype, times the weight in
x's dtype, rounded again), once per step rather than once per walk (`RowsTuning.norm_in_kernel`, None: T = 1):
- T = 1, in the kernel: a program loads all of x (5 KB at K = 2560, from L2, issued after its weight loads so
  they hide behind them) as one set of vector loads and sums their squares; a program holding all of K with its
  blocks unrolled multiplies with those same loaded pieces, so x is read once and no second walk happens;
- T > 1, by XLA: one small fusion norms [T, K] before the launch (its intermediate rounding pinned against XLA's
  excess precision), because every program would otherwise norm its own x tiles again (at w_in, T = 16: 6.6 SASS
  instructions per weight against 4.9, 46 loads of x before the first weight wait) and re-read all of x [T, K]
  (80 KB at T = 16) under K-splits.

A `GroupRMS` input (KDA's gated norm with each head's RMS scale still to apply; `takes_group_rms`: one token,
groups of whole 128-column blocks): x_ref holds its fp32 values and each piece, which lies inside one group, is
scaled by rsqrt(Σ sum_sq / S + eps) of its group and rounded to the compute dtype before its products, so the
scaling takes no launch of its own; a program reads only its own slice's groups' P partial sums.

Grid (N / BN, KS), the row block fastest. With KS = 1 the program rounds its [T, BN] block to x's dtype and adds
the optional residual in its epilogue; with KS > 1 (short N: o_proj 4096 -> 2560 has 160 blocks of 16 rows) each
program writes its slice's fp32 partial [KS, T, N] and one XLA fusion sums the KS partials, rounds once and adds the
residual, as kernel.py does. N need not be a multiple of BN (masked rows); K must be a multiple of 16; a K-split
cuts K into whole 128-column blocks (a K that is not a multiple of 128 ends in a narrower block, cut into
power-of-two pieces, held by its one program).

Tunings (`default_tuning`), from the levers measured on the H200 (experiments/bench_gemv.py --fp8 --levers,
results/bench_gemv_levers.json: cold weights, µs, at Flash's fused shapes). K-splits are whole blocks, the fewest
giving MIN_PROGRAMS programs (MIN_PROGRAMS / 2 for the looped dot, slices of >= 512 columns), within the
per-thread cap when unrolled. Each rule with its measurement:
- T = 1 by FMAs in 16 rows, against the better one-token dot: w_in 22.5 µs against 24.8, w_qg 11.0 against 11.4,
  kv_a 4.6 against 5.6, o_proj 7.2 against 8.1, down 9.0 against 11.2; only gate|up liked the dot (17.2 against
  18.3).
- Looped when the 16-row blocks over all of K already give FMA_LOOPED_MIN_PROGRAMS programs (8 per SM): w_in's
  1282 took 22.5 µs looped, 33.1 unrolled, 27.2 unrolled in two K-splits. The loop steps over FMA_LOOP_GROUP = 2
  blocks, both blocks' loads issued together (`RowsTuning.group`; on an H100: w_in 23.3 µs against 24.6 one block a
  step, 26.6 four; w_qg looped in two-block steps 11.2 against 12.2 for its unrolled default there, not adopted
  without an H200 run, where unrolled beat one-block looping 11.0 to 12.1; `RowsTuning.early_loads`, the first step's
  loads issued before the norm's walk of x, is a lever not yet timed). Fewer rows: unrolled (gate|up, 768
  programs: 18.3 unrolled in two splits, 18.4 looped; o_proj 7.2 unrolled against 8.6 looped; w_qg 11.0 against
  12.1), every load of the slice in flight before the first FMA.
- Unrolled slices of at most FMA_BYTES_PER_THREAD weight bytes per thread (16 rows x 1280 columns on 4 warps), half
  the probe's whole K: gate|up took 19.6 µs over all 2560 columns against 18.3 over 1280; w_qg 10.9 against 11.0
  (a tie, which the rule gives up: no one rule gives w_qg one split and gate|up two). kv_a: its 36 blocks take the
  most splits, 10 (4.6 µs; 5 splits 4.9).
- 8 warps for unrolled FMAs at K >= FMA_LONG_K (the row-parallel o_proj 4096 and down 6144, short N split 4
  ways): down 9.0 µs against 10.5 on 4 warps, o_proj 7.2 either way; at K = 2560 8 warps lost (w_qg 13.1 against
  11.0, w_in 44.8 against 33.1) or tied (kv_a 4.6).
- T > 1: the dot looped in 64 rows on 4 warps, 3 stages, the norm by XLA: w_in 21.4 / 22.7 µs at T = 4 / 16 (66.1
  at T = 16 for kernel.py's IN_OUT), gate|up 15.5 / 16.0, w_qg 10.7 / 11.3, o_proj 9.0 / 8.4, down 9.9 / 10.0.
  Within 5 % of the sweep's best where swept (32 rows on 2 warps: o_proj 8.1 at T = 16); the norm in the kernel
  lost (w_in 30.3 at T = 16), 2 stages too (29.7), 4 or 5 tied. kv_a alone prefers the unrolled one-warp dot
  (6.6 / 7.0 against 7.8 / 7.5): its 45 looped programs are too few, but it is 1.5 MB of a step.

Compiled for sm_90 on a CPU (experiments/triton_resources.py --gemv, SASS instructions per weight a thread streams,
against ~7 issue slots per weight byte at 4.3 TB/s), the T = 1 defaults over a program: w_in's two-block loop 5.5
(5.1 in the loop body, 48 registers; one block a step 5.8, 5.3 and 38), w_qg and gate|up unrolled in two splits
5.8 (72 registers, 10 16-byte loads issued before the first wait), o_proj and down on 8 warps 7.3 and 7.1 (38 and
54 registers), kv_a's 256-column slices 10; unrolled over all of w_in's K it was 5.0 at 183 registers. The looped
dot 4.6-5.0 per weight in the loop, 64-96 registers, 20-24 KiB of shared memory; no default spills.
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
from pallas_kernels.gemv import kernel
from pallas_kernels.gemv.kernel import DOT_ROWS, MIN_PROGRAMS, MIN_SPLIT_ROWS, _load, _norm_args

BLOCK = fp8.BLOCK
# Weight bytes a thread of an unrolled program holds in flight: the probe's 16 rows x 2560 columns over 4 warps, 80
# registers; a longer slice is split (more would spill or halve the programs an SM holds).
MAX_UNROLLED_BYTES_PER_THREAD = 16 * 2560 // 128
# T = 1 FMAs loop over K once this many 16-row programs cover N at one K-split (8 per SM): w_in's 1282 took 22.5 µs
# looped against 33.1 unrolled (module docstring, Tunings).
FMA_LOOPED_MIN_PROGRAMS = 8 * kernel.SMS
# An unrolled FMA program's weight bytes per thread: half the probe's (16 rows x 1280 columns on 4 warps); all 2560
# columns took gate|up 19.6 µs against 18.3.
FMA_BYTES_PER_THREAD = MAX_UNROLLED_BYTES_PER_THREAD // 2
# Unrolled FMAs over K >= this run on 8 warps: down 6144 -> 2560 took 9.0 µs against 10.5 on 4.
FMA_LONG_K = 4096
# Looped FMAs take two 128-column blocks per step (each row's 256 bytes loaded together): w_in 23.3 µs against 24.6
# one block a step and 26.6 four (H100, results/bench_gemv_levers_h100.json).
FMA_LOOP_GROUP = 2
# The dot's rows per program: 64 rows take 4 warps without replicating the [16, BN] dot over warps (at 16 rows every
# warp converted the whole tile: 10.5 SASS instructions per weight against 4.8), and each program reads x [T, K]
# from L2 once per 64 rows (at 16 rows and T = 16 that is twice the weight's own bytes).
DOT_BLOCK_N = 64


@dataclasses.dataclass(frozen=True)
class RowsTuning:
    block_n: int = 16  # BN: output rows per program (a power of two >= 16, the dot's minimum)
    k_splits: int = 1  # KS: K-slices of whole 128-column blocks, summed by an XLA fusion
    num_warps: int = 4
    num_stages: int = 3  # Triton's software-pipelining depth of the fori_loop (unroll False) feeding a dot
    one_token_dot: bool = False  # T = 1 through the 16-row padded dot too (dot-fed loads) rather than FMAs
    # The slice's blocks as a static loop (every load issued up front) or a fori_loop; None: unrolled for FMAs, the
    # loop for the dot (unrolled, Triton stages every block's dot operand in shared memory and spills: see below).
    unroll: bool | None = None
    norm_in_kernel: bool | None = None  # the RMSNorm in the kernel, or x normed by XLA first; None: T = 1 only
    # Looped: 128-column blocks per loop step, their loads issued together (each row's group·128 bytes at once)
    group: int = 1
    # Looped with the norm in the kernel: the first step's weight tiles and scales are loaded before the norm walks
    # x, so they are in flight behind the norm rather than after it
    early_loads: bool = False

    def __post_init__(self):
        check_pow2_fields(self, ("block_n",), 16)
        check_pow2_fields(self, ("num_warps",))
        for name in ("k_splits", "num_stages", "group"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"RowsTuning.{name}={getattr(self, name)} must be an integer >= 1")
        for name in ("one_token_dot", "early_loads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RowsTuning.{name}={getattr(self, name)!r} must be a bool")
        for name in ("unroll", "norm_in_kernel"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"RowsTuning.{name}={getattr(self, name)!r} must be None, True or False")
        if self.group > 1 and self.unroll:
            raise ValueError(f"RowsTuning.group={self.group} groups the blocks of a loop step, and unroll=True has no "
                             "loop: pass group=1 or unroll=False")
        if self.early_loads and (self.unroll or self.norm_in_kernel is False):
            raise ValueError("RowsTuning.early_loads=True moves a loop's first loads ahead of the kernel's norm; with "
                             "unroll=True every load already comes first, and norm_in_kernel=False has no norm there")


def default_tuning(n_tokens: int, k: int, n: int, *, one_token_dot: bool = False,
                   unroll: bool | None = None) -> RowsTuning:
    """The measured tuning of a [T, K] x ROWS [N, K] projection (module docstring, Tunings) taking the given path:
    at T = 1 FMAs unless one_token_dot, above the dot. `unroll` None: FMAs looped at FMA_LOOPED_MIN_PROGRAMS
    16-row programs and unrolled below, the dot looped."""
    if n_tokens == 1 and not one_token_dot:
        if unroll is None:
            unroll = pl.cdiv(n, 16) < FMA_LOOPED_MIN_PROGRAMS
        warps = 8 if unroll and k >= FMA_LONG_K else 4
        cap = FMA_BYTES_PER_THREAD * 32 * warps if unroll else None
        return RowsTuning(block_n=16, k_splits=_fewest_splits(k, n, 16, MIN_SPLIT_ROWS, MIN_PROGRAMS, cap),
                          num_warps=warps, unroll=unroll, group=1 if unroll else FMA_LOOP_GROUP)
    if unroll:  # one warp per 16-row dot: more would each convert the whole tile
        ks = _fewest_splits(k, n, 16, MIN_SPLIT_ROWS, MIN_PROGRAMS, MAX_UNROLLED_BYTES_PER_THREAD * 32)
        return RowsTuning(block_n=16, k_splits=ks, num_warps=1, one_token_dot=n_tokens == 1, unroll=True)
    ks = _fewest_splits(k, n, DOT_BLOCK_N, kernel.FP8_DOT_MIN_SPLIT_ROWS, MIN_PROGRAMS // 2, None)
    return RowsTuning(block_n=DOT_BLOCK_N, k_splits=ks, num_warps=4, one_token_dot=n_tokens == 1, unroll=False)


def _fewest_splits(k: int, n: int, bn: int, min_cols: int, target: int, cap: int | None) -> int:
    """The fewest K-splits (whole blocks, slices of >= min_cols) giving `target` programs of bn rows, each slice
    within `cap` weight bytes per program when given; the most splits when none does."""
    splits = kernel.fp8_splits(k, min_cols)
    return next((d for d in splits if pl.cdiv(n, bn) * d >= target and (cap is None or bn * (k // d) <= cap)),
                splits[-1])


def _pieces(width):
    """[(offset, width)] cutting `width` (a multiple of 16) into 128-column blocks, then power-of-two pieces of the
    remainder (Triton takes power-of-two shapes; every piece of the remainder shares its scale block)."""
    out = [(o, BLOCK) for o in range(0, width - width % BLOCK, BLOCK)]
    o, rest = width - width % BLOCK, width % BLOCK
    for p in (64, 32, 16):
        if rest >= p:
            out.append((o, p))
            o, rest = o + p, rest - p
    return out


def _row_mask(n0, shape, *, BN, n_rows):
    """Which rows of a [BN, ...] weight tile (or [BN] scale column) at row n0 exist (None: all of them)."""
    if n_rows % BN == 0:
        return None
    return n0 + lax.broadcasted_iota(jnp.int32, shape, 0) < n_rows


@dataclasses.dataclass(frozen=True)
class _Program:
    """What one program reads: refs and the static sizes, with the loads of a piece at column k."""
    x_ref: object
    q_ref: object
    s_ref: object
    n0: object
    BN: int
    n_rows: int
    n_tok: int
    rows: int  # 1: the one token by FMAs; DOT_ROWS: the padded dot
    ss_ref: object = None  # a GroupRMS input's sums of squares [1, G, P] (its values are x_ref, fp32)
    rms_group: int = 0  # ... and its S columns per group
    rms_eps: float = 0.0
    out_dtype: object = None  # ... and the dtype its scaled values are rounded to

    def q(self, k, w):
        return _load(self.q_ref, (pl.ds(self.n0, self.BN), pl.ds(k, w)),
                     _row_mask(self.n0, (self.BN, w), BN=self.BN, n_rows=self.n_rows))

    def scale(self, k):
        """The scale column [BN] of the 128-column block holding column k."""
        block = jnp.int32(k // BLOCK) if isinstance(k, int) else lax.div(k, BLOCK)  # a masked load wants an array
        return _load(self.s_ref, (pl.ds(self.n0, self.BN), block),
                     _row_mask(self.n0, (self.BN,), BN=self.BN, n_rows=self.n_rows))

    def x(self, k, w):
        """x's columns [k, k + w): [w] for one token (FMAs, or a dot row padded in registers: `_product`), else
        [rows, w] with the padded rows zero (masked, never read)."""
        if self.n_tok == 1:
            xs = self.x_ref[0, pl.ds(k, w)]
            return xs if self.ss_ref is None else self._rms_scaled(xs, k)
        ok = None if self.n_tok == self.rows else lax.broadcasted_iota(jnp.int32, (self.rows, w), 0) < self.n_tok
        return _load(self.x_ref, (pl.ds(0, self.rows), pl.ds(k, w)), ok)

    def _rms_scaled(self, xs, k):
        """A GroupRMS input's piece at column k (inside one group: groups are whole 128-column blocks), scaled by
        its group's rsqrt(Σ sum_sq / S + eps) and rounded to the compute dtype."""
        g = k // self.rms_group if isinstance(k, int) else lax.div(k, self.rms_group)
        return group_rms_scaled(xs, self.ss_ref[0, g, :], self.rms_group, self.rms_eps, self.out_dtype)

    def norm_x(self):
        """x's pieces over all K, for the norm's sum of squares."""
        return [self.x(off, w) for off, w in _pieces(self.x_ref.shape[1])]


def _product(xs, q, scale, *, rows):
    """fp32 scale[n] · sum over the piece's columns of x[k]·q[n, k]: [BN] at rows = 1 (FMAs), else [rows, BN] (a
    tensor-core dot: bf16 x with the tile widened to bf16, exact; float32 x at full precision)."""
    if rows == 1:
        return jnp.sum(xs.astype(jnp.float32)[None, :] * q.astype(jnp.float32), axis=1) * scale
    if xs.ndim == 1:  # one token through the dot: row 0 of a tile padded in registers, normed before padding
        pad = lax.broadcasted_iota(jnp.int32, (rows, xs.shape[0]), 0) == 0
        xs = jnp.where(pad, jnp.broadcast_to(xs[None, :], pad.shape), jnp.zeros(pad.shape, xs.dtype))
    q16 = q.astype(jnp.float16)  # E4M3 -> f16 is one conversion per two weights on sm_90; f16 holds them exactly
    if xs.dtype == jnp.bfloat16:
        d = lax.dot_general(xs, q16.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    else:
        d = lax.dot_general(xs.astype(jnp.float32), q16.astype(jnp.float32), (((1,), (1,)), ((), ())),
                            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return d * scale[None, :]


def _inv_rms(xs_list, *, K, eps):
    """rsqrt(mean(x²) + eps) per token from x's loaded pieces covering all K columns: [] from [w] pieces (one
    token), else [rows] (a padded row's rsqrt(eps) only ever scales zeros). Squares add elementwise over pieces of
    one width, then one reduction each: a reduction per piece cost a cross-warp exchange per 128 columns (156 more
    SASS instructions per thread at w_in)."""
    by_width = {}
    for xs in xs_list:
        x32 = xs.astype(jnp.float32)
        w = xs.shape[-1]
        by_width[w] = x32 * x32 if w not in by_width else by_width[w] + x32 * x32
    total = functools.reduce(jnp.add, [jnp.sum(sq, axis=-1) for sq in by_width.values()])
    return lax.rsqrt(total / K + eps)


def _normed(xs, k, w, g_ref, inv):
    if g_ref is None:
        return xs
    return _rms_normed(xs, g_ref[pl.ds(k, w)], inv)


def _unrolled(prog, k0, pieces, *, full_x, g_ref, K, eps):
    """The slice's pieces as a static loop: every weight tile and scale column loaded first, then x (all of K when
    the kernel computes the norm; `full_x`: the slice is all of K, so those are the product's x tiles too; else
    each piece's x just before its product, an L2 hit, so that no more x than a piece's is live)."""
    ks = [k0 + off for off, _ in pieces]
    qs = [prog.q(k, w) for k, (_, w) in zip(ks, pieces)]
    scales = [prog.scale(k) for k in ks]
    xs, inv = [None] * len(pieces), None
    if g_ref is not None:
        x_all = prog.norm_x()
        inv = _inv_rms(x_all, K=K, eps=eps)
        xs = x_all if full_x else xs
    acc = None
    for k, (_, w), x, q, s in zip(ks, pieces, xs, qs, scales):
        x = prog.x(k, w) if x is None else x
        p = _product(_normed(x, k, w, g_ref, inv), q, s, rows=prog.rows)
        acc = p if acc is None else acc + p
    return acc


def _looped(prog, k0, pieces, *, g_ref, K, eps, group=1, early=False):
    """The slice's whole blocks as a fori_loop over groups of `group` blocks (Triton pipelines the tiles feeding a
    dot; a group's weight tiles and scales load before its first product, `group` x 128 contiguous bytes of each
    row), the blocks left over and the narrower pieces after; the kernel's norm first walks all of x (`early`: after
    the first group's loads are issued, that group then taken out of the loop)."""
    full = [p for p in pieces if p[1] == BLOCK]
    n_groups = len(full) // group
    first_ks = [k0 + j * BLOCK for j in range(group)]
    early = early and g_ref is not None
    if early and not n_groups:
        raise ValueError(f"RowsTuning.early_loads=True takes a loop's first step out of it, and this program's "
                         f"{len(full)} block(s) make no step of {group}: pass early_loads=False or a smaller group")
    first = [(prog.q(k, BLOCK), prog.scale(k)) for k in first_ks] if early else None
    inv = None
    if g_ref is not None:
        inv = _inv_rms(prog.norm_x(), K=K, eps=eps)
    shape = (prog.BN,) if prog.rows == 1 else (prog.rows, prog.BN)

    def steps(ks, w, acc, loaded=None):
        loaded = loaded if loaded is not None else [(prog.q(k, w), prog.scale(k)) for k in ks]
        for k, (q, sc) in zip(ks, loaded):
            acc = acc + _product(_normed(prog.x(k, w), k, w, g_ref, inv), q, sc, rows=prog.rows)
        return acc

    def body(i, acc):
        k = pl.multiple_of(k0 + i * group * BLOCK, BLOCK)
        return steps([k + j * BLOCK for j in range(group)], BLOCK, acc)

    acc = jnp.zeros(shape, jnp.float32)
    if early:
        acc = steps(first_ks, BLOCK, acc, first)
    if n_groups > early:  # a loop of no steps would still trace a 128-wide tile past a narrower K
        acc = lax.fori_loop(int(early), n_groups, body, acc)
    for off, w in pieces[n_groups * group:]:
        acc = steps([k0 + off], w, acc)
    return acc


def rows_kernel(x_ref, q_ref, s_ref, *refs, K, k_rows, BN, n_rows, n_tok, rows, eps, unroll, split_out,
                with_residual, group=1, rms_group=0, rms_dtype=None, early=False):
    # x_ref [T, K] compute dtype (a GroupRMS input, rms_group > 0: its fp32 values, T = 1), q_ref [N, K] E4M3, s_ref
    # [N, ceil(K/128)] fp32, then g_ref [K] (the norm weight; eps not None) or ss_ref [1, G, P] (the GroupRMS
    # input's sums of squares; its eps and compute dtype rms_dtype), and r_ref [T, N] (with_residual); o_ref [T, N]
    # in the compute dtype, or [KS, T, N] fp32 partials (split_out). Program (j, s): rows [j·BN, (j+1)·BN), columns
    # [s, s + 1)·k_rows.
    refs = list(refs)
    o_ref = refs.pop()
    ss_ref = refs.pop(0) if rms_group else None
    g_ref = refs.pop(0) if eps is not None and not rms_group else None
    r_ref = refs.pop(0) if with_residual else None
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    k0 = 0 if k_rows == K else pl.multiple_of(s * k_rows, BLOCK)  # static when one program holds all of K
    prog = _Program(x_ref, q_ref, s_ref, n0, BN, n_rows, n_tok, rows, ss_ref, rms_group, eps or 0.0, rms_dtype)
    common = dict(g_ref=g_ref, K=K, eps=None if rms_group else eps)
    pieces = _pieces(k_rows)
    if unroll:
        acc = _unrolled(prog, k0, pieces, full_x=k_rows == K, **common)
    else:
        acc = _looped(prog, k0, pieces, group=group, early=early, **common)
    _store(o_ref, r_ref, acc, s, n0=n0, BN=BN, n_rows=n_rows, n_tok=n_tok, rows=rows, split_out=split_out)


def _tokens(rows, n_tok, shape):
    """Which of `shape`'s leading `rows` entries are tokens (None: all of them)."""
    return None if n_tok == rows else lax.broadcasted_iota(jnp.int32, shape, 0) < n_tok


def _store(o_ref, r_ref, acc, s, *, n0, BN, n_rows, n_tok, rows, split_out):
    """acc ([BN] at rows = 1, else [rows, BN]) to its output block: an fp32 partial (split_out), or rounded to x's
    dtype plus the residual."""
    acc = acc[None, :] if rows == 1 else acc
    masks = [m for m in (_tokens(rows, n_tok, (rows, BN)),
                         None if n_rows % BN == 0 else n0 + lax.broadcasted_iota(jnp.int32, (rows, BN), 1) < n_rows)
             if m is not None]
    mask = functools.reduce(jnp.logical_and, masks) if masks else None
    idx = (pl.ds(0, rows), pl.ds(n0, BN))
    if split_out:
        pltriton.store(o_ref.at[(s,) + idx], acc, mask=mask)
        return
    y = acc.astype(o_ref.dtype)
    if r_ref is not None:
        y = _load(r_ref, idx, mask) + y
    pltriton.store(o_ref.at[idx], y, mask=mask)


def check_split(k: int, k_splits: int) -> int:
    """The columns of one K-split after checking it cuts K into equal slices of whole 128-column blocks."""
    if k_splits != 1 and (k % k_splits or (k // k_splits) % BLOCK):
        raise ValueError(f"RowsTuning.k_splits={k_splits} must cut K={k} into equal slices of whole {BLOCK}-column "
                         f"blocks (K-splits of this K: {kernel.fp8_splits(k, BLOCK) if k % BLOCK == 0 else [1]})")
    return k // k_splits


def pinned_f32(x):
    """x in float32 with its own rounding pinned: inside a fusion XLA's excess precision may otherwise hand over
    the fp32 value that produced x."""
    fi = jnp.finfo(x.dtype)
    return lax.reduce_precision(x.astype(jnp.float32), exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def _rms_norm_pinned(x, weight, eps):
    """`reference.rms_norm` with its intermediate rounding pinned: XLA's excess precision (its default) may
    otherwise keep the normalised x in fp32 inside a fusion (a bf16 projection after it then 2.5e-3 from the
    reference's, measured on CPU)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    fi = jnp.finfo(x.dtype)
    normed = lax.reduce_precision(normed, exponent_bits=fi.nexp, mantissa_bits=fi.nmant).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def output_shape(ks: int, t: int, n: int, dtype) -> jax.ShapeDtypeStruct:
    """A row-block launch's output: [T, N] in x's dtype, or [KS, T, N] fp32 partials under K-splits."""
    return jax.ShapeDtypeStruct((ks, t, n), jnp.float32) if ks > 1 else jax.ShapeDtypeStruct((t, n), dtype)


def finish(y, residual, dtype):
    """The launch's output as the projection: the K-split partials summed, rounded once and the residual added
    (without K-splits the kernel already did both)."""
    if y.ndim == 2:
        return y
    y = y.sum(0).astype(dtype)
    return y if residual is None else residual + y


def takes_group_rms(x: GroupRMS) -> bool:
    """Whether the kernel applies a GroupRMS input in its prologue: one token (more would scale every x tile of
    every program again, as the norm would: module docstring), groups of whole 128-column blocks, and a power of two
    of partial sums per group (a Triton block shape)."""
    return x.lead[0] == 1 and x.group % BLOCK == 0 and is_pow2(x.sum_sq.shape[-1])


def gemv(x, w, residual=None, *, norm=None, tuning: RowsTuning | None = None):
    """Same contract as `reference.gemv` for a ROWS `fp8.Fp8Weight` (q [N, K] E4M3, scale [N, ceil(K/128)] fp32;
    `norm` None or (weight [K], eps: a Python float)); shapes validated by the dispatcher. `tuning` None:
    `default_tuning(T, K, N)`. x may be a `GroupRMS` [T, K] (no `norm`): applied in the prologue where
    `takes_group_rms`, else by XLA first."""
    if isinstance(x, GroupRMS):
        if not takes_group_rms(x):
            return gemv(x.apply(), w, residual, tuning=tuning)
        return _gemv(x.values, w.q, w.scale, residual, x.sum_sq, eps=x.eps, tuning=tuning, rms_dtype=x.dtype)
    norm_weight, eps = _norm_args(norm)
    return _gemv(x, w.q, w.scale, residual, *norm_weight, eps=eps, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("eps", "tuning", "rms_dtype"))
def _gemv(x, q, scale, residual, *prologue, eps, tuning, rms_dtype=None):
    # prologue: (the norm weight,), (a GroupRMS input's sums of squares,) with rms_dtype, or ()
    t, k = x.shape
    n = q.shape[0]
    tuning = tuning or default_tuning(t, k, n)
    kernel.check_sizes(t, k, n, "w.shape[1]")
    k_rows = check_split(k, tuning.k_splits)
    bn, ks = tuning.block_n, tuning.k_splits
    rows = 1 if t == 1 and not tuning.one_token_dot else DOT_ROWS
    unroll = rows == 1 if tuning.unroll is None else tuning.unroll
    if unroll and (tuning.group > 1 or tuning.early_loads):
        raise ValueError(f"RowsTuning group={tuning.group}, early_loads={tuning.early_loads} shape a loop, and this "
                         "path is unrolled (T = 1 by FMAs unrolls by default): pass unroll=False")
    rms_group = k // prologue[0].shape[1] if rms_dtype is not None else 0
    if prologue and not rms_group and not (t == 1 if tuning.norm_in_kernel is None else tuning.norm_in_kernel):
        x, prologue, eps = _rms_norm_pinned(x, prologue[0], eps), (), None  # once per step, by XLA
    if tuning.early_loads and (not prologue or rms_group):
        raise ValueError("RowsTuning.early_loads=True moves a loop's first loads ahead of the kernel's norm, and this "
                         "call has no norm in the kernel: pass early_loads=False")
    out_dtype = jnp.dtype(rms_dtype) if rms_group else x.dtype
    split_out = ks > 1
    with_residual = residual is not None and not split_out
    out_shape = output_shape(ks, t, n, out_dtype)
    y = pl.pallas_call(
        functools.partial(rows_kernel, K=k, k_rows=k_rows, BN=bn, n_rows=n, n_tok=t, rows=rows, eps=eps,
                          unroll=unroll, split_out=split_out, with_residual=with_residual, group=tuning.group,
                          rms_group=rms_group, rms_dtype=out_dtype if rms_group else None,
                          early=tuning.early_loads),
        grid=(pl.cdiv(n, bn), ks),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="gemv_rows_fwd_kernel",
    )(x, q, scale, *prologue, *([residual] if with_residual else []))
    return finish(y, residual, out_dtype)
