"""Tile helpers of the small-T MoE kernels (experts.py's gate/up, down.py, grouped.py): weight-tile loads (an L2
eviction policy; FP8: the E4M3 tile and its 128x128 block's one scale), activations loaded in a tile's register
layout, the FP8 per-lane sums, the chunk loop, the transposed-operand dot, slot ownership, optional-input kernel
bodies, exact bf16 -> fp32 widening, and the reference's roundings (SwiGLU, the combine).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import fp8


EVICTION_POLICIES = (None, "evict_first")


def evicting_load(ref, idx, eviction):
    """ref[idx] with an L2 eviction policy (None: the default load)."""
    return ref[idx] if eviction is None else pltriton.load(ref.at[idx], eviction_policy=eviction)


def split_fp8(w):
    """(values, scales) of an expert matrix: an Fp8Weight's E4M3 q and its 128x128 block scales, or a plain array
    (or None, for an absent one) and None."""
    if isinstance(w, fp8.Fp8Weight):
        return w.q, w.scale
    return w, None


def block_of(start):
    """The 128-wide scale block holding index `start` (an int or a traced non-negative int32)."""
    return start // fp8.BLOCK if isinstance(start, int) else lax.div(start, fp8.BLOCK)


def load_w(w_ref, scale_ref, lead, rows, cols, eviction):
    """Weight tile w[*lead, rows, cols] (rows, cols: pl.ds) and its scale: plain (scale_ref None) the tile as stored
    and None; FP8 the E4M3 tile as stored and the one float32 scale of the 128x128 block holding it (rows <= 128
    and cols <= 128, each a power of two starting at a multiple of itself: `sub_width`, `check_fp8_rows`), a scalar
    load. The products take the E4M3 values widened exactly and apply the scale to their fp32 sums (`scaled`)."""
    w = evicting_load(w_ref, (*lead, rows, cols), eviction)
    if scale_ref is None:
        return w, None
    return w, scale_ref[(*lead, block_of(rows.start), block_of(cols.start))]


def rows_load(ref, lead, n_rows, cols):
    """ref[*lead, 0, cols] repeated over n_rows rows, loaded as one [n_rows, cols.size] tensor (each row's pointers
    the same). Loaded in a weight tile's shape, activations take the tile's register layout (Triton vectorises
    same-shaped loads of one computation alike): each lane loads the values its own weights meet."""
    shape = (n_rows, 1)
    idx = tuple(jnp.full(shape, l, jnp.int32) for l in lead)
    c = cols.start + lax.broadcasted_iota(jnp.int32, (1, cols.size), 1)
    return pltriton.load(ref.at[(*idx, jnp.zeros(shape, jnp.int32), c)])


def scaled(part, scale):
    """An fp32 partial over one scale block's columns times the block's scale (None: a plain weight's, as it is)."""
    return part if scale is None else part * scale


def operand(w, dtype):
    """A weight tile as a dot operand in the activations' dtype: an E4M3 tile widened exactly (its 4 significant
    bits fit bf16 and fp32; through fp32, the fast conversions: E4M3 -> bf16 goes through an f16 -> bf16 convert
    per value on a slower pipe), a plain one as it is (already that dtype)."""
    if jnp.dtype(w.dtype) == jnp.dtype(dtype):
        return w
    return w.astype(jnp.float32).astype(dtype)


# FP8 "accumulate" products (T = 1): a tile's fp32 products summed over the adjacent columns one lane holds (Triton
# gives each lane up to 16 adjacent bytes of an E4M3 tile: one 16-byte load), one chain of FFMAs per lane and row
# with no shuffle, then times the block's scale: one scaling per 16 weights (`lane_sums`).
LANE_GROUP = 16


def lane_group(rows, cols, lanes):
    """The columns of a [rows, cols] tile that one of `lanes` lanes holds side by side (at most LANE_GROUP)."""
    return max(1, min(LANE_GROUP, cols, rows * cols // lanes))


def lane_sums(prod, lanes):
    """[R, C] fp32 products -> [R, C / G] sums over G = lane_group adjacent columns, added one after another (a
    reduction would sum them as a tree, half again as many instructions as a chain of FFMAs)."""
    r, c = prod.shape
    g = lane_group(r, c, lanes)
    if g == 1:
        return prod
    parts = jnp.split(prod.reshape(r, c // g, g), g, axis=2)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.reshape(r, c // g)


def sub_width(width, *scales):
    """Columns per weight load of a `width`-column chunk: the chunk, or with an FP8 weight (a scale given) at most
    one 128-wide scale block, a wider chunk then loaded block by block, each load with its own scale."""
    return width if all(s is None for s in scales) else min(width, fp8.BLOCK)


def check_fp8_rows(tuning, field, rows, *scales):
    """A tile of `rows` weight rows must lie in one 128-row scale block when the weight is FP8."""
    if rows > fp8.BLOCK and any(s is not None for s in scales):
        raise ValueError(f"{type(tuning).__name__}.{field}={getattr(tuning, field)} gives tiles of {rows} weight "
                         f"rows; with FP8 weights a tile's rows must lie in one {fp8.BLOCK}-row scale block: use "
                         f"{field} <= {fp8.BLOCK}")


def chunk_loop(n_chunks, width, sub, step, init, unroll=False):
    """fori_loop over n_chunks chunks of `width` columns, each taken as width // sub loads of `sub` columns (one
    step: their loads issued together): step(ks, carry) -> carry, ks a pl.ds of `sub` columns. `unroll`: the
    chunks written out instead, so that the compiler may issue later chunks' loads before earlier chunks' math."""
    def body(c, carry):
        for j in range(width // sub):
            start = c * width + j * sub
            carry = step(pl.ds(start if unroll else pl.multiple_of(start, sub), sub), carry)
        return carry

    if unroll:
        for c in range(n_chunks):
            init = body(c, init)
        return init
    return lax.fori_loop(0, n_chunks, body, init)


def with_optional(kernel, inputs):
    """A pallas_call body and its inputs for `kernel`, whose optional inputs (None in `inputs`) reach it as None
    (static): only the given arrays are passed, the output refs follow the inputs."""
    present = [a is not None for a in inputs]
    n_in = sum(present)

    def body(*refs):
        it = iter(refs[:n_in])
        kernel(*(next(it) if p else None for p in present), *refs[n_in:])

    return body, [a for a in inputs if a is not None]


def dot_nt(a, b):
    """a [M, C] · b [N, C]ᵀ -> [M, N] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def round_to(a, dtype):
    """fp32 a rounded to dtype, a rounding XLA keeps even where it may drop cast pairs."""
    info = jnp.finfo(dtype)
    return lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(dtype)


def swiglu(g, u, limit):
    # g, u in the compute dtype; SiLU in fp32 rounded, clamp and product in the compute dtype (reference.swiglu).
    dt = g.dtype
    sg = jax.nn.silu(g.astype(jnp.float32)).astype(dt)
    if limit:
        sg = jnp.minimum(sg, jnp.asarray(limit, dt))
        u = jnp.minimum(jnp.maximum(u, jnp.asarray(-limit, dt)), jnp.asarray(limit, dt))
    return sg * u


def ownership(ids_flat, s, n_routed):
    """Expert of slot s and whether s is the first slot that chose it. ids_flat [P] int32, padding = -1."""
    i_p = lax.iota(jnp.int32, ids_flat.shape[0])
    e = jnp.sum(jnp.where(i_p == s, ids_flat, 0))
    earlier = jnp.sum(jnp.where((i_p < s) & (ids_flat == e), 1, 0))
    return e, (s < n_routed) & (e >= 0) & (earlier == 0)


def widen_exact(a):
    """A bf16 array as float32 through its bit pattern (the same values). A bare convert would do on the GPU, but
    the interpreter runs the kernel through XLA, which may fuse it with the rounding before it (excess precision)
    and store the unrounded value."""
    bits = lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)
