"""Fused recurrent KDA in Pallas-Triton: decode (T = 1) and speculative verify (T <= 64).

The kernel reads the fused input projection's output as it is, x [B, T, H, 5K+1] packed per head as
q|k|v|f|g|b (ling_jax/params.py kda_in_parts), each program loading its head's parts at their column offsets,
so no XLA slice or q|k|v stack runs between the projection GEMV and this kernel.

One program per (sequence, head, V tile of BV columns) keeps a [K, BV] fp32 state tile in registers and walks
the T tokens: conv update + SiLU → L2 norm and scale → safe gate and beta → fp32 delta step → output. With
BV == V the gated RMSNorm is fused (the program holds the whole head). Otherwise each program applies the
per-column part of the norm (weight and sigmoid(g)) to its tile, emits it in fp32 with the tile's sum of
squares of o, and each head is scaled by its RMS after the kernel: the RMS is the only quantity that spans the V
tiles, and no XLA op has to read g out of x (a slice of x is a launch of its own). The scaling is one small XLA
fusion, or with `defer_norm` a `GroupRMS` handed to o_proj, whose GEMV prologue applies it (no launch of its own).

Every program reads the conv window and q/k rows of its head in full (the L2 norm and Sᵀq reduce over K), so
the conv window is never updated in place: the new window goes to a fresh buffer, written by V-tile 0 for q/k
and by each V tile for its own v columns. The state tile is private to its program and is updated in place
(``input_output_aliases``) in decode. Verify reads the committed state only and writes every position's
post-state and the conv rows (old window ++ the T new rows), from which commit selects (docs/design.md §2).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common.interpret import interpret_mode
from pallas_kernels.common.norm import GroupRMS
from pallas_kernels.common.sizes import is_pow2


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Tiling of the recurrent kernel. BV == V fuses the gated RMSNorm."""
    BV: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        # No tl.dot in these kernels, so Triton takes [K, 8] tiles (fla's fused_recurrent uses BV = 8).
        if not is_pow2(self.BV) or self.BV < 8:
            raise ValueError(f"{self.BV=} must be a power of two >= 8")
        if not is_pow2(self.num_warps):
            raise ValueError(f"{self.num_warps=} must be a power of two")


# BV 16 / 2 warps: the shortest decode timeline on the H200 (4.95 µs per layer with the norm; experiments/RESULTS.md,
# KDA). The prologue (conv, L2 norms, gate, beta) stays per token inside the loop: the alternatives in
# experiments/FINDINGS.md saved at most 1.4 µs of verify + commit up to T = 7 and lost 7 µs at T = 9.
DEFAULT_DECODE = RecurrentConfig(BV=16, num_warps=2)
DEFAULT_VERIFY = RecurrentConfig(BV=16, num_warps=2)


def _silu(x):
    return x * jax.nn.sigmoid(x)


def recurrent_kda_fwd_kernel(
    x_ref,      # [B, T, H, 5K+1] q|k|v pre-conv rows, f, z (the output gate g), beta logit
    win_ref,    # [B, W-1, 3, H, K]
    h0_ref,     # [B, H, K, V] fp32
    convw_ref,  # [W, 3, H, K] fp32
    alog_ref,   # [H] fp32
    dtb_ref,    # [H, K] fp32
    normw_ref,  # [K]
    *out_refs,
    T, W, K, BV, lower_bound, eps, scale, FUSE_NORM, MODE,
):
    """MODE "decode": outs (y|u, new window, final state); "verify": outs (y|u, per-token states, conv_rows);
    BV < V adds a last output, the [B, T, H, V // BV] fp32 sums of squares of o per tile, and u is fp32."""
    i_b, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    o_v = pl.ds(i_v * BV, BV)
    dtype = x_ref.dtype
    f32 = jnp.float32
    y_ref = out_refs[0]
    verify = MODE == "verify"

    # Conv taps [K] / [BV] per tap, oldest first; tap W-1 multiplies the current row.
    b_wq = [convw_ref[j, 0, i_h, :] for j in range(W)]
    b_wk = [convw_ref[j, 1, i_h, :] for j in range(W)]
    b_wv = [convw_ref[j, 2, i_h, o_v] for j in range(W)]
    b_a = jnp.exp(alog_ref[i_h])
    b_dtb = dtb_ref[i_h, :]
    b_nw = normw_ref[o_v].astype(f32)

    def conv(rows, taps, x):
        acc = taps[W - 1] * x.astype(f32)
        for j in range(W - 1):
            acc = acc + taps[j] * rows[j].astype(f32)
        return _silu(acc).astype(dtype).astype(f32)

    def l2(x):
        return x * lax.rsqrt(jnp.sum(x * x) + 1e-6)

    def store_rows(ref, r, x_q, x_k, x_v):
        """Row r of a [B, R, 3, H, K] window-like output: q/k by V-tile 0 only, v by each tile for its columns."""
        m_first = jnp.broadcast_to(i_v == 0, (K,))
        # Masked-store indices must be traced values for the interpret-mode discharge rule.
        r_, c0, c1 = jnp.int32(r), jnp.int32(0), jnp.int32(1)
        pltriton.store(ref.at[i_b, r_, c0, i_h, :], x_q, mask=m_first)
        pltriton.store(ref.at[i_b, r_, c1, i_h, :], x_k, mask=m_first)
        ref[i_b, r, 2, i_h, o_v] = x_v

    def step(t, b_h, b_q, b_k, b_v, b_g, b_beta):
        """The dependent half: decay, delta update along k, output q·S (gated norm when fused), post-state."""
        b_h = b_h * jnp.exp(b_g)[:, None]
        b_u = b_beta * (b_v - jnp.sum(b_k[:, None] * b_h, axis=0))  # [BV]
        b_h = b_h + b_k[:, None] * b_u[None, :]
        # o rounded to the compute dtype before the norm, as the reference's o is.
        b_of = jnp.sum(b_q[:, None] * b_h, axis=0).astype(dtype).astype(f32)  # [BV]
        b_gate = b_nw * jax.nn.sigmoid(x_ref[i_b, t, i_h, pl.ds(4 * K + i_v * BV, BV)].astype(f32))
        if FUSE_NORM:
            b_y = b_of * lax.rsqrt(jnp.mean(b_of * b_of) + eps) * b_gate
            y_ref[i_b, t, i_h, :] = b_y.astype(y_ref.dtype)
        else:
            y_ref[i_b, t, i_h, o_v] = b_of * b_gate
            out_refs[-1][i_b, t, i_h, i_v] = jnp.sum(b_of * b_of)
        if verify:
            out_refs[1][i_b, t, i_h, :, o_v] = b_h
        return b_h

    def body(t, carry):
        b_h, rq, rk, rv = carry
        x_q = x_ref[i_b, t, i_h, pl.ds(0, K)]
        x_k = x_ref[i_b, t, i_h, pl.ds(K, K)]
        x_v = x_ref[i_b, t, i_h, pl.ds(2 * K + i_v * BV, BV)]
        if verify:  # conv_rows written here, so that no XLA concatenate runs
            store_rows(out_refs[2], W - 1 + t, x_q, x_k, x_v)
        c_q, c_k, c_v = conv(rq, b_wq, x_q), conv(rk, b_wk, x_k), conv(rv, b_wv, x_v)
        b_f = x_ref[i_b, t, i_h, pl.ds(3 * K, K)].astype(f32)
        # Safe gate in fp32, then rounded to the compute dtype as the HF reference does.
        b_g = (lower_bound * jax.nn.sigmoid(b_a * (b_f + b_dtb))).astype(dtype).astype(f32)
        b_beta = jax.nn.sigmoid(x_ref[i_b, t, i_h, 5 * K].astype(f32)).astype(dtype).astype(f32)
        b_h = step(t, b_h, l2(c_q) * scale, l2(c_k), c_v, b_g, b_beta)
        return b_h, (*rq[1:], x_q), (*rk[1:], x_k), (*rv[1:], x_v)

    rq = tuple(win_ref[i_b, j, 0, i_h, :] for j in range(W - 1))
    rk = tuple(win_ref[i_b, j, 1, i_h, :] for j in range(W - 1))
    rv = tuple(win_ref[i_b, j, 2, i_h, o_v] for j in range(W - 1))
    if verify:
        for j in range(W - 1):
            store_rows(out_refs[2], j, rq[j], rk[j], rv[j])
    carry = (h0_ref[i_b, i_h, :, o_v].astype(f32), rq, rk, rv)
    carry = body(0, carry) if T == 1 else lax.fori_loop(0, T, body, carry)
    b_h, rq, rk, rv = carry

    if not verify:
        for j in range(W - 1):
            store_rows(out_refs[1], j, rq[j], rk[j], rv[j])
        out_refs[2][i_b, i_h, :, o_v] = b_h


def _recurrent_call(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound, eps,
                    mode, cfg, defer_norm=False):
    B, T, H, _ = x.shape
    K = V = conv_w.shape[-1]
    W = conv_w.shape[0]
    BV = min(cfg.BV, V)
    fuse_norm = BV == V
    dtype = x.dtype
    sds = jax.ShapeDtypeStruct
    y_shape = sds((B, T, H, V), dtype if fuse_norm else jnp.float32)
    if mode == "decode":
        out_shape = [y_shape, sds(conv_window.shape, dtype), sds(state.shape, jnp.float32)]
        aliases = {2: 2}
    else:
        out_shape = [y_shape, sds((B, T, H, K, V), jnp.float32), sds((B, W - 1 + T, 3, H, K), dtype)]
        aliases = {}
    if not fuse_norm:
        out_shape.append(sds((B, T, H, V // BV), jnp.float32))
    kernel = functools.partial(
        recurrent_kda_fwd_kernel, T=T, W=W, K=K, BV=BV, lower_bound=float(lower_bound), eps=float(eps),
        scale=K ** -0.5, FUSE_NORM=fuse_norm, MODE=mode)
    y, *rest = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, V // BV),
        input_output_aliases=aliases,
        interpret=interpret_mode(),
        name=f"kda_recurrent_{mode}",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w)
    if not fuse_norm:
        *rest, sum_sq = rest
        y = GroupRMS(y, sum_sq, float(eps), jnp.dtype(dtype).name)
        y = y if defer_norm else y.apply()
    return y, *rest


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "cfg", "defer_norm"))
def decode(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
           cfg=DEFAULT_DECODE, defer_norm=False):
    """x: the packed [B, 1, H, 5K+1] -> (y, new_window, new_state); the state is updated in place when the
    caller donates it. `defer_norm` (with BV < V): y is the `GroupRMS` whose per-head scaling is left to o_proj's
    prologue."""
    return _recurrent_call(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w,
                           lower_bound=lower_bound, eps=eps, mode="decode", cfg=cfg, defer_norm=defer_norm)


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "cfg", "defer_norm"))
def verify(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
           cfg=DEFAULT_VERIFY, defer_norm=False):
    """x: the packed [B, T, H, 5K+1] -> (y, conv_rows [B, W-1+T, 3, H, K], states [B, T, H, K, V] fp32);
    ``state`` is read only. `defer_norm` as in `decode`."""
    y, states, conv_rows = _recurrent_call(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w,
                                           lower_bound=lower_bound, eps=eps, mode="verify", cfg=cfg,
                                           defer_norm=defer_norm)
    return y, conv_rows, states
