"""Mosaic GPU FP8 projection: the weight streamed through a shared-memory ring of bulk (TMA) copies, T = 1..16.

The Triton kernels (rows.py) hold every weight load in registers until its products, so the bytes in flight per SM
are what the resident programs' registers hold, and they stream KDA's w_in at 2.4 TB/s. Here the copy engine moves
each [BN, 128] E4M3 tile into shared memory, `stages` tiles ahead (`plgpu.emit_pipeline`), while one warpgroup widens
the current tile to f16 in registers and multiplies it on the tensor cores (wgmma, the weight tile as the M operand:
[BN, 128] · x[16, 128]ᵀ -> [BN, 16] fp32); each 128-column block's fp32 product is scaled by the block's scale
column and added to the fp32 accumulator, so the numerics are rows.py's (`reference.gemv`: the weight dequantised in
fp32, never rounded) up to fp32 summation order.

Layout (`TmaWeight`, made once at load time by `prepare`): q [Np, K] E4M3, the ROWS weight with its rows padded to
ROWS_PAD (128, a multiple of every BN); scale [K/128 · Np] fp32, block-major (all rows' scales of one 128-column
block contiguous, so one bulk copy brings a tile's [BN] scales).

x goes in as f16: each token scaled by the power of two that puts its largest magnitude in [2^13, 2^14) (exact for
every bf16 value above 2^-30 of it; a smaller one moves by at most 2^-38 of it), padded to 8 rows (T <= 8) or 16
(the wgmma's N), and the scaling undone on the fp32 output, in the XLA fusions around the launch (with the RMSNorm
prologue and the residual).

Grid (Np / BN, KS): K-splits write fp32 partials [KS, Np, 8 or 16] that the epilogue fusion sums. K must be a
multiple of 128.

Measured (experiments/RESULTS.md, "FP8 GEMV levers"; H100, cold weights, the XLA fusions around the launch
included): not yet faster than the Triton kernels. KDA's w_in at T = 1 27.7 µs against 23.3 for rows.py's FMAs,
with 8 stages 31.7, 128-row CTAs 30.8, two K-splits 27.9; the short projections lose 2-4 µs to the two or three
fusions around the launch. The ring keeps ~58 KB of weight in flight per SM at w_in, against ~40 KB for the FMA
loop, and streams 1.96 TB/s against its 2.32: on the H100 the loads in flight are not what bounds these kernels. A
lever under measurement, in the levers bench only (experiments/bench_gemv.py --fp8 --levers), not a model path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import fp8, interpret_mode
from pallas_kernels.gemv import rows

BLOCK = fp8.BLOCK
ROWS_PAD = 128  # the largest BN; prepared weights are padded to it
TOKENS = 16  # at most 16 tokens; the wgmma's N pads them to 8 or 16 (each CTA re-reads x's tile per step from L2)


@dataclasses.dataclass(frozen=True)
class TmaTuning:
    block_n: int = 64  # rows per CTA: the wgmma's M (one warpgroup; 128 is two 64-row wgmmas)
    stages: int = 4  # tiles in flight per CTA
    k_splits: int = 1

    def __post_init__(self):
        if self.block_n not in (64, ROWS_PAD):
            raise ValueError(f"TmaTuning.block_n={self.block_n} must be 64 or {ROWS_PAD} (whole 64-row wgmmas "
                             "within the prepared rows' padding)")
        for name in ("stages", "k_splits"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TmaTuning.{name}={getattr(self, name)} must be an integer >= 1")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TmaWeight:
    q: jax.Array  # [Np, K] float8_e4m3fn
    scale: jax.Array  # [K/128 · Np] float32, block-major
    n: int = dataclasses.field(metadata=dict(static=True))  # the unpadded output rows


def padded_rows(n: int) -> int:
    """The rows of a prepared weight of n output rows."""
    return -(-n // ROWS_PAD) * ROWS_PAD


def prepare(w: fp8.Fp8Weight) -> TmaWeight:
    """A ROWS Fp8Weight [N, K] as this kernel reads it: rows padded to ROWS_PAD, the scales block-major."""
    n, k = w.q.shape
    if k % BLOCK:
        raise ValueError(f"w.shape[1]={k}: the TMA GEMV takes K a multiple of {BLOCK}")
    np_ = padded_rows(n)
    q = jnp.pad(w.q, ((0, np_ - n), (0, 0)))
    scale = jnp.pad(w.scale, ((0, np_ - n), (0, 0))).T.reshape(-1)
    return TmaWeight(q, scale, n)


def f16_tokens(x, n_rows=TOKENS):
    """x [T, K] -> (x·2^e_t in f16, padded to `n_rows`; 2^-e_t [T] f32): the per-token power of two that puts the
    token's largest magnitude in [2^13, 2^14) (a token below 2^-112 is scaled by 2^126 and stays below it, so the
    undoing 2^-126 is a normal float32 that no flush-to-zero drops; bf16 subnormals, which XLA may flush, are the
    one loss). x's own rounding is pinned first (`rows.pinned_f32`)."""
    x32 = rows.pinned_f32(x)
    _, e = jnp.frexp(jnp.max(jnp.abs(x32), axis=-1))
    shift = jnp.minimum(14 - e, 126).astype(jnp.int32)  # 2^-126: the undoing factor stays a normal f32
    x16 = (x32 * jnp.ldexp(jnp.float32(1), shift)[:, None]).astype(jnp.float16)
    return jnp.pad(x16, ((0, n_rows - x.shape[0]), (0, 0))), jnp.ldexp(jnp.float32(1), -shift)


def _kernel_call(x16, q, scale, *, tuning: TmaTuning, interpret=None, a_via_smem=False):
    np_, k = q.shape
    tok = x16.shape[0]
    bn, ks = tuning.block_n, tuning.k_splits
    nb, steps = np_ // bn, k // BLOCK // ks
    swz_x = plgpu.find_swizzle(BLOCK * 16, "rhs")
    x_tr = (plgpu.TilingTransform((8, swz_x * 8 // 16)), plgpu.SwizzleTransform(swz_x))
    swz_q = plgpu.find_swizzle(BLOCK * 8, "lhs")
    q_tr = (plgpu.TilingTransform((8, swz_q)), plgpu.SwizzleTransform(swz_q))
    swz_a = plgpu.find_swizzle(BLOCK * 16, "lhs")
    a_tr = (plgpu.TilingTransform((8, swz_a * 8 // 16)), plgpu.SwizzleTransform(swz_a))

    def kernel(x_gmem, q_gmem, s_gmem, o_gmem, o_smem, a_smem):
        rb, split = lax.axis_index("rows"), lax.axis_index("split")
        k0 = split * steps

        def body(_, x_smem, q_smem, s_smem, acc):
            a = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float16)
            if a_via_smem:  # the interpreter's wgmma reads A from shared memory only
                a_smem[...] = a
                plgpu.commit_smem()

            def dot(acc_ref):
                plgpu.wgmma(acc_ref, a_smem if a_via_smem else a, x_smem.transpose((1, 0)))
                return acc_ref[...]

            part = pl.run_scoped(dot, plgpu.ACC((bn, tok), jnp.float32))
            s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            return acc + part * lax.broadcast_in_dim(s, (bn, tok), [0])

        acc0 = plgpu.layout_cast(jnp.full((bn, tok), 0, jnp.float32), plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(
            body, grid=(steps,),
            in_specs=[plgpu.BlockSpec((tok, BLOCK), lambda i: (0, k0 + i), transforms=x_tr),
                      plgpu.BlockSpec((bn, BLOCK), lambda i: (rb, k0 + i), transforms=q_tr),
                      plgpu.BlockSpec((bn,), lambda i: ((k0 + i) * nb + rb,))],
            max_concurrent_steps=min(tuning.stages, steps), init_carry=acc0)(x_gmem, q_gmem, s_gmem)
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(rb * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((ks, np_, tok), jnp.float32),
        scratch_types=[plgpu.SMEM((bn, tok), jnp.float32),
                       plgpu.SMEM((bn, BLOCK), jnp.float16, transforms=a_tr)],
        grid=(nb, ks), grid_names=("rows", "split"), interpret=interpret,
        compiler_params=plgpu.CompilerParams(),
    )(x16, q, scale)


def gemv(x, w: TmaWeight, residual=None, *, norm=None, tuning: TmaTuning | None = None):
    """`reference.gemv`'s contract for a prepared weight: x [T, K] bfloat16, 1 <= T <= 16; `norm` None or
    (weight [K], eps). Off the GPU the Mosaic GPU interpreter runs it (its wgmma then reads the widened tile from
    shared memory: the one step that differs)."""
    interpret = plgpu.InterpretGPUParams() if interpret_mode() else None
    t, k = x.shape
    if not 1 <= t <= TOKENS or x.dtype != jnp.bfloat16:
        raise ValueError(f"x [{t}, {k}] {x.dtype}: the TMA GEMV takes 1..{TOKENS} bfloat16 tokens")
    if not isinstance(w, TmaWeight) or w.q.shape[1] != k:
        shape = tuple(w.q.shape) if isinstance(w, TmaWeight) else getattr(w, "shape", ())
        raise ValueError(f"w must be a TmaWeight (tma.prepare of a ROWS Fp8Weight) of K = x.shape[1] = {k} inputs, "
                         f"not {type(w).__name__} {tuple(shape)}")
    tuning = tuning or TmaTuning()
    if (k // BLOCK) % tuning.k_splits or w.q.shape[0] % tuning.block_n:
        raise ValueError(f"TmaTuning {tuning}: k_splits must divide K/128 = {k // BLOCK} and block_n the padded "
                         f"rows {w.q.shape[0]}")
    return _gemv(x, w, residual, norm, tuning=tuning, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def _gemv(x, w, residual, norm, *, tuning, interpret):
    t = x.shape[0]
    if norm is not None:
        x = rows._rms_norm_pinned(x, norm[0], norm[1])
    x16, unscale = f16_tokens(x, 8 if t <= 8 else TOKENS)
    parts = _kernel_call(x16, w.q, w.scale, tuning=tuning, interpret=interpret, a_via_smem=interpret is not None)
    y = (parts.sum(0)[:w.n, :t].T * unscale[:, None]).astype(x.dtype)
    return y if residual is None else residual + y
