"""Causal depthwise conv + SiLU of the KDA prefill as one Pallas-Triton pass (the first pass of ``chunk.prefill``).

Same contract and arithmetic as ``reference.short_conv``: per channel, fp32 ``acc = w0·x[t−3]`` then
``acc = acc + w_j·x[t−3+j]`` in tap order, SiLU in fp32, cast to x.dtype. Why a kernel: XLA runs the reference as a
full ``concatenate(window, x)`` (a copy of all of x) plus the conv fusion; this reads x once (the 3-row halo of each
tile is an L1/L2 hit) and writes y once.

Channels are flattened (C = 3·H·K, contiguous), grid (B, T / BT, C / BC). Rows before 0 come from ``head``
= window ++ the first BT rows of x (zero-padded), read at static row offsets by the first T-block only; the other
blocks read x at ``t0 − back ≥ 0``. Each load is masked off where its source is not used, so no load starts below
row 0 (interpret mode's discharge would clamp it) and the compiled kernel moves no bytes for the unused source.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common.interpret import interpret_mode
from pallas_kernels.common.sizes import is_pow2, next_pow2


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """BT rows × BC channels per program (BC is capped to the largest power of two dividing C).
    c_fastest: launch order with the channel blocks of one row block consecutive (whole rows stream in order;
    the halo rows were read 1 row block = C / BC programs earlier) instead of the row blocks of one channel block
    (the halo was read by the program just before)."""
    # BT 16 / BC 256 / 4 warps: 194 µs on the H200 at T = 8192 bf16 (floor 94), the fastest tiling swept
    # (experiments/RESULTS.md, KDA).
    BT: int = 16
    BC: int = 256
    num_warps: int = 4
    c_fastest: bool = False

    def __post_init__(self):
        if not (is_pow2(self.BT) and is_pow2(self.BC)) or self.BT < 4:
            raise ValueError(f"{self.BT=} (>= 4, so the halo stays in one block) and {self.BC=} must be powers of two")


def new_window(x, conv_window):
    """Last W−1 pre-conv rows of window ++ x, without concatenating all T rows."""
    T, Wm1 = x.shape[1], conv_window.shape[1]
    if T >= Wm1:
        return x[:, T - Wm1:]
    return jnp.concatenate([conv_window[:, T:].astype(x.dtype), x], axis=1)


def short_conv_kernel(x_ref, head_ref, w_ref, y_ref, *, T, BT, BC, W, c_fastest):
    """x_ref [B, T, C], head_ref [B, W−1+BT, C] (window ++ x[:BT], zero-padded), w_ref [W, C] fp32,
    y_ref [B, T, C]. Grid (B, T / BT, C / BC), or (C / BC, T / BT, B) with c_fastest (axis 0 launches fastest)."""
    i_t = pl.program_id(1)
    i_b, i_c = (pl.program_id(2), pl.program_id(0)) if c_fastest else (pl.program_id(0), pl.program_id(2))
    f32 = jnp.float32
    t0 = i_t * BT
    cols = pl.ds(i_c * BC, BC)
    m_t = jnp.broadcast_to(((t0 + lax.iota(jnp.int32, BT)) < T)[:, None], (BT, BC))
    first = i_t == 0

    def tap(back):
        """Rows t − back of the tile, fp32 (t = t0 .. t0 + BT − 1)."""
        if back == 0:
            return pltriton.load(x_ref.at[i_b, pl.ds(t0, BT), cols], mask=m_t, other=0.0).astype(f32)
        # Masked-load starts must be traced values for the interpret-mode discharge rule.
        b_h = pltriton.load(head_ref.at[i_b, pl.ds(jnp.int32(W - 1 - back), BT), cols],
                            mask=m_t & first, other=0.0)
        b_x = pltriton.load(x_ref.at[i_b, pl.ds(jnp.maximum(t0 - back, 0), BT), cols],
                            mask=m_t & jnp.logical_not(first), other=0.0)
        return jnp.where(first, b_h, b_x).astype(f32)

    # The reference's order: ((w0·x[t−3] + w1·x[t−2]) + w2·x[t−1]) + w3·x[t].
    acc = w_ref[0, cols][None, :] * tap(W - 1)
    for j in range(1, W):
        acc = acc + w_ref[j, cols][None, :] * tap(W - 1 - j)
    pltriton.store(y_ref.at[i_b, pl.ds(t0, BT), cols], jax.nn.silu(acc).astype(y_ref.dtype), mask=m_t)


def _largest_pow2_divisor(n, cap):
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


@functools.partial(jax.jit, static_argnames=("cfg",))
def short_conv(x, conv_window, conv_w, *, cfg=ConvConfig()):
    """Drop-in for ``reference.short_conv``: ``(y [B, T, *C] x.dtype, new_window [B, W−1, *C])``."""
    B, T = x.shape[:2]
    W = conv_w.shape[0]
    C = x[0, 0].size
    BT = min(cfg.BT, max(4, next_pow2(T)))  # short prompts: one small block
    BC = _largest_pow2_divisor(C, cfg.BC)
    if BT < W - 1:
        raise ValueError(f"{BT=} < W - 1 = {W - 1}: the first block's halo would reach past the head rows")
    xf = x.reshape(B, T, C)
    win = conv_window.astype(x.dtype).reshape(B, W - 1, C)
    head = jnp.concatenate([win, jnp.pad(xf[:, :BT], [(0, 0), (0, BT - min(BT, T)), (0, 0)])], axis=1)
    y = pl.pallas_call(
        functools.partial(short_conv_kernel, T=T, BT=BT, BC=BC, W=W, c_fastest=cfg.c_fastest),
        out_shape=jax.ShapeDtypeStruct((B, T, C), x.dtype),
        grid=(C // BC, pl.cdiv(T, BT), B) if cfg.c_fastest else (B, pl.cdiv(T, BT), C // BC),
        interpret=interpret_mode(),
        name="kda_short_conv",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
    )(xf, head, conv_w.astype(jnp.float32).reshape(W, C))
    return y.reshape(x.shape), new_window(x, conv_window)
