"""Fused recurrent KDA in Pallas-Triton: decode (T = 1), speculative verify (T <= 64) and replay.

One program per (sequence, head, V tile of BV columns) keeps a [K, BV] fp32 state tile in registers and walks
the T tokens: conv update + SiLU → L2 norm and scale → safe gate and beta → fp32 delta step → output. With
BV == V the gated RMSNorm is fused (the program holds the whole head); otherwise the kernel emits o and the
norm runs as one XLA fusion after it.

Every program reads the conv window and q/k rows of its head in full (the L2 norm and Sᵀq reduce over K), so
the conv window is never updated in place: the new window goes to a fresh buffer, written by V-tile 0 for q/k
and by each V tile for its own v columns. The state tile is private to its program and is updated in place
(``input_output_aliases``) in decode.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common.interpret import interpret_mode
from pallas_kernels.common.sizes import is_pow2
from pallas_kernels.kda import reference


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Tiling of the recurrent kernels. BV == V fuses the gated RMSNorm.

    Verify only: ``prologue="xla"`` computes the state-independent front half (conv + SiLU, L2 norms, gate,
    beta) for all T tokens as one vectorised XLA fusion before the kernel, so the kernel's sequential chain is
    only the delta step and the output; ``"kernel"`` does it per token inside the loop; ``"hoist"`` does it in
    the kernel for all T tokens (unrolled, straight-line) before the T dependent steps; ``"vec"`` is "hoist"
    with the 2T L2-norm reductions batched into two [TP, K] row reductions. ``unroll`` unrolls
    the token loop (T is static) so that the next token's loads can issue before the current step ends.
    """
    BV: int = 32
    num_warps: int = 4
    num_stages: int = 1
    prologue: str = "kernel"
    unroll: bool = False

    def __post_init__(self):
        # No tl.dot in these kernels, so Triton takes [K, 8] tiles (fla's fused_recurrent uses BV = 8).
        if not is_pow2(self.BV) or self.BV < 8:
            raise ValueError(f"{self.BV=} must be a power of two >= 8")
        if not is_pow2(self.num_warps):
            raise ValueError(f"{self.num_warps=} must be a power of two")
        if self.prologue not in ("kernel", "hoist", "vec", "xla"):
            raise ValueError(f"{self.prologue=} must be 'kernel', 'hoist', 'vec' or 'xla'")


# H200, H=32, K=V=128, batch 1 (experiments/RESULTS.md, KDA; device time per layer, kernel + gated norm):
# decode BV=16/2 warps 5.31 µs (timeline span 4.95), BV=32/4 5.05 (5.36), BV=16/1 5.62, BV=8/1 5.92; the spread
# is within run-to-run noise, BV=16/2 had the shortest timeline and stays. Verify + commit at T=6: the per-token
# prologue ("kernel") 17.5 µs, "vec" 16.2 but slower from T=8 on (29.7 vs 22.7 at T=9: its [T, K] tiles pad to
# 16 rows), "hoist" 16.3, "xla" 22.5; design A (store="states") beat B by 4-6 µs at every variant.
DEFAULT_DECODE = RecurrentConfig(BV=16, num_warps=2)
DEFAULT_VERIFY = RecurrentConfig(BV=16, num_warps=2)


def _silu(x):
    return x * jax.nn.sigmoid(x)


def delta_step(b_h, b_k, b_v, b_g, b_beta):
    """One fp32 delta-rule step on a [K, BV] tile: decay the key rows, then write beta·(v − Sᵀk) along k.

    Shared by verify and replay so that both compile to the same arithmetic (design B must be bit-exact).
    In interpret mode XLA would fuse (and FMA-contract) the step differently with its neighbours in the two
    kernels, so the step is fenced with optimization barriers there; Triton has no such primitive and
    compiles the identical op sequence on identical tile layouts.
    """
    fence = lax.optimization_barrier if interpret_mode() else (lambda x: x)
    b_h, b_k, b_v, b_g, b_beta = fence((b_h, b_k, b_v, b_g, b_beta))
    b_h = b_h * jnp.exp(b_g)[:, None]
    b_kh = jnp.sum(b_k[:, None] * b_h, axis=0)  # [BV]
    b_u = b_beta * (b_v - b_kh)
    return fence(b_h + b_k[:, None] * b_u[None, :])


def step_and_store(t, b_h, b_q, b_k, b_v, b_g, b_beta, *, refs, o_v, b_nw, eps):
    """One token's dependent half, shared by the recurrent and the verify-core kernels: the delta step, the output
    q·S (with the gated RMSNorm when b_nw is given: the program holds the whole head) and, when ``refs`` has a
    states ref, the post-state. refs = (y_ref, z_ref, states_ref or None, i_b, i_h). Returns the new state tile."""
    y_ref, z_ref, states_ref, i_b, i_h = refs
    b_h = delta_step(b_h, b_k, b_v, b_g, b_beta)
    b_o = jnp.sum(b_q[:, None] * b_h, axis=0).astype(y_ref.dtype)  # [BV]
    if b_nw is not None:
        b_of = b_o.astype(jnp.float32)
        b_z = z_ref[i_b, t, i_h, :].astype(jnp.float32)
        b_y = b_of * lax.rsqrt(jnp.mean(b_of * b_of) + eps) * b_nw * jax.nn.sigmoid(b_z)
        y_ref[i_b, t, i_h, :] = b_y.astype(y_ref.dtype)
    else:
        y_ref[i_b, t, i_h, o_v] = b_o
    if states_ref is not None:
        states_ref[i_b, t, i_h, :, o_v] = b_h
    return b_h


def recurrent_kda_fwd_kernel(
    qkv_ref,    # [B, T, 3, H, K] pre-conv rows
    f_ref,      # [B, T, H, K]
    b_ref,      # [B, T, H]
    z_ref,      # [B, T, H, K]
    win_ref,    # [B, W-1, 3, H, K]
    h0_ref,     # [B, H, K, V] fp32
    convw_ref,  # [W, 3, H, K] fp32
    alog_ref,   # [H] fp32
    dtb_ref,    # [H, K] fp32
    normw_ref,  # [K]
    *out_refs,
    T, W, K, BV, lower_bound, eps, scale, FUSE_NORM, MODE, UNROLL=False, HOIST=False, VEC=False,
):
    """MODE: "decode" (outs: y|o, new window, ht), "states" (outs: y|o, per-token states, conv_rows) or
    "inputs" (outs: y|o, k̂, v, g, beta per token, conv_rows)."""
    i_b, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    o_v = pl.ds(i_v * BV, BV)
    dtype = qkv_ref.dtype
    f32 = jnp.float32
    y_ref = out_refs[0]

    # Conv taps [K] / [BV] per tap, oldest first; tap W-1 multiplies the current row.
    b_wq = [convw_ref[j, 0, i_h, :] for j in range(W)]
    b_wk = [convw_ref[j, 1, i_h, :] for j in range(W)]
    b_wv = [convw_ref[j, 2, i_h, o_v] for j in range(W)]
    b_a = jnp.exp(alog_ref[i_h])
    b_dtb = dtb_ref[i_h, :]
    b_nw = normw_ref[...].astype(f32) if FUSE_NORM else None

    def conv(rows, taps, x):
        acc = taps[W - 1] * x.astype(f32)
        for j in range(W - 1):
            acc = acc + taps[j] * rows[j].astype(f32)
        return _silu(acc).astype(dtype).astype(f32)

    def l2(x):
        return x * lax.rsqrt(jnp.sum(x * x) + 1e-6)

    def store_row(r, x_q, x_k, x_v):
        """Verify: row r of conv_rows (old window ++ qkv), written here so that no XLA concatenate runs."""
        rows_ref = out_refs[-1]
        m_first = jnp.broadcast_to(i_v == 0, (K,))
        # Masked-store indices must be traced values for the interpret-mode discharge rule.
        r_, c0, c1 = jnp.int32(r), jnp.int32(0), jnp.int32(1)
        pltriton.store(rows_ref.at[i_b, r_, c0, i_h, :], x_q, mask=m_first)
        pltriton.store(rows_ref.at[i_b, r_, c1, i_h, :], x_k, mask=m_first)
        rows_ref[i_b, r, 2, i_h, o_v] = x_v

    def conv_t(t, rq, rk, rv):
        """Token t's conv + SiLU outputs (fp32, rounded to the compute dtype) and the shifted windows."""
        x_q = qkv_ref[i_b, t, 0, i_h, :]
        x_k = qkv_ref[i_b, t, 1, i_h, :]
        x_v = qkv_ref[i_b, t, 2, i_h, o_v]
        if MODE != "decode":
            store_row(W - 1 + t, x_q, x_k, x_v)
        cs = (conv(rq, b_wq, x_q), conv(rk, b_wk, x_k), conv(rv, b_wv, x_v))
        return cs, (*rq[1:], x_q), (*rk[1:], x_k), (*rv[1:], x_v)

    def finish(t, b_q, b_k, b_v):
        """Gate and beta of token t (and design B's stores)."""
        b_f = f_ref[i_b, t, i_h, :].astype(f32)
        # Safe gate in fp32, then rounded to the compute dtype as the HF reference does.
        b_g = (lower_bound * jax.nn.sigmoid(b_a * (b_f + b_dtb))).astype(dtype).astype(f32)
        b_beta = jax.nn.sigmoid(b_ref[i_b, t, i_h].astype(f32)).astype(dtype).astype(f32)
        if MODE == "inputs":
            kk_ref, vv_ref, gg_ref, bb_ref = out_refs[1:5]
            m_first = i_v == 0
            t_ = jnp.int32(t)
            pltriton.store(kk_ref.at[i_b, t_, i_h, :], b_k, mask=jnp.broadcast_to(m_first, (K,)))
            pltriton.store(gg_ref.at[i_b, t_, i_h, :], b_g, mask=jnp.broadcast_to(m_first, (K,)))
            pltriton.store(bb_ref.at[i_b, t_, i_h, pl.ds(0, 1)], jnp.broadcast_to(b_beta, (1,)),
                           mask=jnp.broadcast_to(m_first, (1,)))
            vv_ref[i_b, t_, i_h, o_v] = b_v
        return b_q, b_k, b_v, b_g, b_beta

    def front(t, rq, rk, rv):
        """The state-independent half of token t: conv + SiLU, L2 norms, gate, beta."""
        (c_q, c_k, c_v), rq, rk, rv = conv_t(t, rq, rk, rv)
        return finish(t, l2(c_q) * scale, l2(c_k), c_v), rq, rk, rv

    def vec_fronts(rq, rk, rv):
        """All T front halves with the 2T L2-norm reductions done as two [TP, K] reductions (TP = T rounded
        up to a power of two): each token's conv row is placed in row t of a tile, the row sums give every
        norm at once, and token t's norm is read back by a one-hot sum over TP (exact)."""
        TP = 1 << (T - 1).bit_length()
        cs = []
        for t in range(T):
            c_t, rq, rk, rv = conv_t(t, rq, rk, rv)
            cs.append(c_t)
        rows = lax.broadcasted_iota(jnp.int32, (TP, 1), 0)
        idx = lax.broadcasted_iota(jnp.int32, (TP,), 0)

        def inv_norms(xs):
            tile = jnp.zeros((TP, K), f32)
            for t, x in enumerate(xs):
                tile = jnp.where(rows == t, x[None, :], tile)
            return lax.rsqrt(jnp.sum(tile * tile, axis=1) + 1e-6)  # [TP]

        n_q = inv_norms([c[0] for c in cs])
        n_k = inv_norms([c[1] for c in cs])
        pick = lambda n, t: jnp.sum(jnp.where(idx == t, n, 0.0))
        vals = [finish(t, c_q * pick(n_q, t) * scale, c_k * pick(n_k, t), c_v)
                for t, (c_q, c_k, c_v) in enumerate(cs)]
        return vals, rq, rk, rv

    step_refs = (y_ref, z_ref, out_refs[1] if MODE == "states" else None, i_b, i_h)

    def back(t, b_h, vals):
        """The dependent half: delta step, output (and gated norm), design A's state store."""
        return step_and_store(t, b_h, *vals, refs=step_refs, o_v=o_v, b_nw=b_nw, eps=eps)

    def body(t, carry):
        b_h, rq, rk, rv = carry
        vals, rq, rk, rv = front(t, rq, rk, rv)
        return back(t, b_h, vals), rq, rk, rv

    rq = tuple(win_ref[i_b, j, 0, i_h, :] for j in range(W - 1))
    rk = tuple(win_ref[i_b, j, 1, i_h, :] for j in range(W - 1))
    rv = tuple(win_ref[i_b, j, 2, i_h, o_v] for j in range(W - 1))
    if MODE != "decode":
        for j in range(W - 1):
            store_row(j, rq[j], rk[j], rv[j])
    b_h = h0_ref[i_b, i_h, :, o_v].astype(f32)
    carry = (b_h, rq, rk, rv)
    if (HOIST or VEC) and T > 1:
        # Every token's front half first (straight-line, no dependence on the state), then the T steps.
        if VEC:
            vals, rq, rk, rv = vec_fronts(rq, rk, rv)
        else:
            vals = []
            for t in range(T):
                v_t, rq, rk, rv = front(t, rq, rk, rv)
                vals.append(v_t)
        for t in range(T):
            b_h = back(t, b_h, vals[t])
        carry = (b_h, rq, rk, rv)
    elif T == 1 or UNROLL:
        for t in range(T):  # static token indices: straight-line code the compiler can schedule across steps
            carry = body(t, carry)
    else:
        carry = lax.fori_loop(0, T, body, carry)
    b_h, rq, rk, rv = carry

    if MODE == "decode":
        nw_ref, ht_ref = out_refs[1], out_refs[2]
        m_first = jnp.broadcast_to(i_v == 0, (K,))
        for j in range(W - 1):
            # Masked-store indices must be traced values for the interpret-mode discharge rule.
            j_, c0, c1 = jnp.int32(j), jnp.int32(0), jnp.int32(1)
            pltriton.store(nw_ref.at[i_b, j_, c0, i_h, :], rq[j], mask=m_first)
            pltriton.store(nw_ref.at[i_b, j_, c1, i_h, :], rk[j], mask=m_first)
            nw_ref[i_b, j, 2, i_h, o_v] = rv[j]
        ht_ref[i_b, i_h, :, o_v] = b_h


def verify_core_kernel(
    q_ref,      # [B, T, H, K] fp32 L2-normalised q (unscaled)
    k_ref,      # [B, T, H, K] fp32 L2-normalised k
    v_ref,      # [B, T, H, V] fp32 conv output v
    g_ref,      # [B, T, H, K] fp32 log decay
    bb_ref,     # [B, T, H, 1] fp32 beta
    z_ref,      # [B, T, H, K]
    h0_ref,     # [B, H, K, V] fp32
    normw_ref,  # [K]
    *out_refs,
    T, BV, eps, scale, FUSE_NORM, MODE, UNROLL,
):
    """Verify with the front half precomputed (``prologue="xla"``): per token only the delta step and q·S.
    MODE "states" also writes every post-state; "inputs" writes y only (the staged inputs are the inputs)."""
    i_b, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    o_v = pl.ds(i_v * BV, BV)
    f32 = jnp.float32
    y_ref = out_refs[0]
    b_nw = normw_ref[...].astype(f32) if FUSE_NORM else None
    step_refs = (y_ref, z_ref, out_refs[1] if MODE == "states" else None, i_b, i_h)

    def body(t, b_h):
        return step_and_store(t, b_h, q_ref[i_b, t, i_h, :] * scale, k_ref[i_b, t, i_h, :], v_ref[i_b, t, i_h, o_v],
                              g_ref[i_b, t, i_h, :], bb_ref[i_b, t, i_h, 0], refs=step_refs, o_v=o_v,
                              b_nw=b_nw, eps=eps)

    b_h = h0_ref[i_b, i_h, :, o_v].astype(f32)
    if UNROLL:
        for t in range(T):
            b_h = body(t, b_h)
    else:
        lax.fori_loop(0, T, body, b_h)


def replay_kda_fwd_kernel(
    n_ref,    # [B] int32 accepted counts
    h0_ref,   # [B, H, K, V] fp32 committed state
    kk_ref,   # [B, T, H, K] fp32
    vv_ref,   # [B, T, H, V] fp32
    gg_ref,   # [B, T, H, K] fp32
    bb_ref,   # [B, T, H, 1] fp32
    ht_ref,   # [B, H, K, V] out
    *, T, BV,
):
    """Design B commit: replay tokens t < n into the committed state; masked tokens (g = 0, beta = 0) leave
    the tile bit-identical, so the trip count stays static."""
    i_b, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    o_v = pl.ds(i_v * BV, BV)
    n = n_ref[i_b]

    def body(t, b_h):
        keep = t < n
        b_k = kk_ref[i_b, t, i_h, :]
        b_v = vv_ref[i_b, t, i_h, o_v]
        b_g = jnp.where(keep, gg_ref[i_b, t, i_h, :], 0.0)
        b_beta = jnp.where(keep, bb_ref[i_b, t, i_h, 0], 0.0)
        return delta_step(b_h, b_k, b_v, b_g, b_beta)

    b_h = h0_ref[i_b, i_h, :, o_v]
    ht_ref[i_b, i_h, :, o_v] = lax.fori_loop(0, T, body, b_h)


def _recurrent_call(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound, eps,
                    mode, cfg):
    B, T, _, H, K = qkv.shape
    V = K
    W = conv_w.shape[0]
    BV = min(cfg.BV, V)
    NV = V // BV
    fuse_norm = BV == V
    dtype = qkv.dtype
    sds = jax.ShapeDtypeStruct
    y_shape = sds((B, T, H, V), dtype)
    if mode == "decode":
        out_shape = [y_shape, sds(conv_window.shape, dtype), sds(state.shape, jnp.float32)]
        aliases = {5: 2}
    elif mode == "states":
        out_shape = [y_shape, sds((B, T, H, K, V), jnp.float32), sds((B, W - 1 + T, 3, H, K), dtype)]
        aliases = {}
    else:
        out_shape = [y_shape, sds((B, T, H, K), jnp.float32), sds((B, T, H, V), jnp.float32),
                     sds((B, T, H, K), jnp.float32), sds((B, T, H, 1), jnp.float32),
                     sds((B, W - 1 + T, 3, H, K), dtype)]
        aliases = {}
    kernel = functools.partial(
        recurrent_kda_fwd_kernel, T=T, W=W, K=K, BV=BV, lower_bound=float(lower_bound), eps=float(eps),
        scale=K ** -0.5, FUSE_NORM=fuse_norm, MODE=mode, UNROLL=cfg.unroll, HOIST=cfg.prologue == "hoist",
        VEC=cfg.prologue == "vec")
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, NV),
        input_output_aliases=aliases,
        interpret=interpret_mode(),
        name=f"kda_recurrent_{mode}",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w)
    y = outs[0]
    if not fuse_norm:
        y = reference.gated_rms_norm(y, z, o_norm_w, eps)
    return y, outs[1:]


def _verify_xla_prologue(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound,
                         eps, mode, cfg):
    """``prologue="xla"``: the reference front half, vectorised over T and heads, then the core kernel."""
    B, T, _, H, K = qkv.shape
    V = K
    BV = min(cfg.BV, V)
    fuse_norm = BV == V
    dtype = qkv.dtype
    (q, k, v, g, beta), _ = reference.kda_inputs(qkv, f, b, conv_window, conv_w, A_log, dt_bias, lower_bound)
    sds = jax.ShapeDtypeStruct
    out_shape = [sds((B, T, H, V), dtype)]
    if mode == "states":
        out_shape.append(sds((B, T, H, K, V), jnp.float32))
    kernel = functools.partial(verify_core_kernel, T=T, BV=BV, eps=float(eps), scale=K ** -0.5,
                               FUSE_NORM=fuse_norm, MODE=mode, UNROLL=cfg.unroll)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, V // BV),
        interpret=interpret_mode(),
        name=f"kda_verify_core_{mode}",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(q, k, v, g, beta[..., None], z, state, o_norm_w)
    y = outs[0]
    if not fuse_norm:
        y = reference.gated_rms_norm(y, z, o_norm_w, eps)
    staged = (outs[1],) if mode == "states" else (k, v, g, beta[..., None])
    return y, (*staged, jnp.concatenate([conv_window, qkv], axis=1))


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "cfg"), donate_argnums=())
def decode(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
           cfg=DEFAULT_DECODE):
    if cfg.prologue != "kernel" or cfg.unroll:
        raise ValueError(f"RecurrentConfig(prologue={cfg.prologue!r}, unroll={cfg.unroll}) applies to verify only; "
                         "decode (one token) always runs the prologue in the kernel: leave both at their defaults")
    y, (new_window, new_state) = _recurrent_call(
        qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound=lower_bound, eps=eps,
        mode="decode", cfg=cfg)
    return y, new_window, new_state


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "store", "cfg"))
def verify(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
           store="states", cfg=DEFAULT_VERIFY):
    from pallas_kernels.kda.dispatch import KDAStaged
    call = _verify_xla_prologue if cfg.prologue == "xla" else _recurrent_call
    y, staged = call(
        qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound=lower_bound, eps=eps,
        mode=store, cfg=cfg)
    # The kernel prologues write conv_rows themselves; the XLA prologue concatenates (one fusion with it).
    *staged, conv_rows = staged
    if store == "states":
        return y, KDAStaged(conv_rows, states=staged[0], backend="pallas")
    kk, vv, gg, bb = staged
    return y, KDAStaged(conv_rows, state0=state, k=kk, v=vv, g=gg, beta=bb[..., 0], backend="pallas")


@functools.partial(jax.jit, static_argnames=("cfg",))
def replay(state0, k, v, g, beta, n, *, cfg=DEFAULT_VERIFY):
    B, T, H, K = k.shape
    V = v.shape[-1]
    BV = min(cfg.BV, V)
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    return pl.pallas_call(
        functools.partial(replay_kda_fwd_kernel, T=T, BV=BV),
        out_shape=jax.ShapeDtypeStruct(state0.shape, jnp.float32),
        grid=(B, H, V // BV),
        interpret=interpret_mode(),
        name="kda_replay",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(n, state0, k, v, g, beta[..., None])
