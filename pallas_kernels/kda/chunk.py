"""Chunked KDA prefill in Pallas-Triton (C = 64, any T, initial and final state).

Pipeline (docs/model.md §7, fla's ``chunk_kda_fwd`` with fewer launches):

1. conv + SiLU: ``conv.short_conv``, one Pallas pass that reads x once and writes y once, bit-identical to
   ``reference.short_conv`` compiled (194 µs on the H200 at T = 8192 bf16 against 679 for XLA's form of the
   reference, which first copies all of x into a window ++ x concatenation; a conv fused into the intra kernel
   was slower still: experiments/FINDINGS.md). The new conv window is a slice of the last W − 1 rows.
2. ``chunk_kda_fwd_kernel_intra``, grid (B, H, NT), every chunk in parallel: L2 norm and scale, safe gate and
   beta from the conv output and raw f/b, chunk-local Γ = cumsum(g),
   A_qk and L in 16-row sub-blocks, M = (I + L)^{-1} diag(beta) by forward substitution on the 16×16 diagonal
   blocks plus block substitution for the rest, then W = M (K ⊙ e^Γ), U = M V, Q ⊙ e^Γ, K ⊙ e^{Γ_C − Γ}, e^{Γ_C}.
3. ``chunk_kda_fwd_kernel_h``, grid (B, H, V / BV), chunks in sequence with the [K, BV] state in registers:
   Ũ = U − W S, O = (Q ⊙ e^Γ) S + A_qk Ũ, S ← e^{Γ_C} ⊙ S + (K ⊙ e^{Γ_C − Γ})ᵀ Ũ. With BV == V the gated
   RMSNorm is fused; otherwise it runs as an XLA fusion.

Numerical safety for gates down to −5: every decay factor is e^{Γ_r − ref} with ref the Γ of the first row of
the query sub-block, times e^{ref − Γ_c} for the key. Off the diagonal both are ≤ 1; on a 16-row diagonal
block the key factor is at most e^{15·5} = e^75 < fp32 max (≈ e^88.7), and the masked (c > r) products are
discarded with ``where`` after the dot. No factor ever looks at a later token than its row (no future
leakage through rounding, unlike a mid-block reference).
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
from pallas_kernels.kda import conv as conv_lib
from pallas_kernels.kda import reference

BC = 16  # sub-block rows; also Triton's minimum dot dimension


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tiling and precision of the chunk kernels; conv_cfg tiles the conv pass.

    dot: "auto" (fp32 inputs → 3-pass TF32, bf16 inputs → bf16 operands with fp32 accumulation), "tf32x3",
    "ieee", "tf32" or "bf16". Interpret mode always computes fp32 dots.
    """
    BV: int = 64
    num_warps_intra: int = 4
    num_warps_h: int = 4
    num_stages_h: int = 2
    dot: str = "auto"
    conv_cfg: conv_lib.ConvConfig = conv_lib.ConvConfig()

    def __post_init__(self):
        if not is_pow2(self.BV) or self.BV < 16:
            raise ValueError(f"{self.BV=} must be a power of two >= 16")
        if self.dot not in ("auto", "tf32x3", "ieee", "tf32", "bf16"):
            raise ValueError(f"{self.dot=} must be auto, tf32x3, ieee, tf32 or bf16")
        for name in ("num_warps_intra", "num_warps_h"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"ChunkConfig.{name}={getattr(self, name)} must be a power of two")


DEFAULT = ChunkConfig()


def _make_dot(kind):
    """2-D dot with fp32 result. kind "bf16" rounds operands to bf16 first."""
    if interpret_mode():
        prec, cast = lax.Precision.HIGHEST, jnp.float32
    else:
        prec, cast = {
            "tf32x3": (lax.DotAlgorithmPreset.TF32_TF32_F32_X3, jnp.float32),
            "ieee": (lax.DotAlgorithmPreset.F32_F32_F32, jnp.float32),
            "tf32": (lax.DotAlgorithmPreset.TF32_TF32_F32, jnp.float32),
            "bf16": (None, jnp.bfloat16),
        }[kind]

    def dot(a, b, trans_a=False, trans_b=False):
        dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
        return lax.dot_general(a.astype(cast), b.astype(cast), dims, precision=prec,
                               preferred_element_type=jnp.float32)

    return dot


def chunk_kda_fwd_kernel_intra(
    y_ref,     # [B, T, 3, H, K] conv + SiLU output q|k|v (compute dtype)
    f_ref,     # [B, T, H, K] gate input
    b_ref,     # [B, T, H] beta logits
    alog_ref,  # [H] fp32
    dtb_ref,   # [H, K] fp32
    w_ref,     # [B, NT*C, H, K] out: W = M (K ⊙ e^Γ)
    u_ref,     # [B, NT*C, H, V] out: U = M V
    qg_ref,    # [B, NT*C, H, K] out: Q ⊙ e^Γ
    kg_ref,    # [B, NT*C, H, K] out: K ⊙ e^{Γ_C − Γ}
    aqk_ref,   # [B, NT, H, C, C] out: causal A_qk
    gc_ref,    # [B, NT, H, K] fp32 out: e^{Γ_C}
    *, T, C, K, lower_bound, dot,
):
    """L2 norm, scale, safe gate and beta are computed here from the conv output (as the reference: fp32,
    gate and beta rounded to the compute dtype); rows past T load as zeros (k = 0, beta = 0, g = 0), so
    they leave the state unchanged."""
    i_b, i_h, i_n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    NC = C // BC
    dtype = y_ref.dtype
    o_r = lax.broadcasted_iota(jnp.int32, (BC, BC), 0)
    o_c = lax.broadcasted_iota(jnp.int32, (BC, BC), 1)
    m_strict = o_r > o_c
    m_causal = o_r >= o_c
    eye = (o_r == o_c).astype(f32)
    store_dt = w_ref.dtype
    scale = K ** -0.5
    b_a = jnp.exp(alog_ref[i_h])
    b_dtb = dtb_ref[i_h, :]

    def rows(i):
        return pl.ds(i_n * C + i * BC, BC)

    def valid(i):
        return (i_n * C + i * BC + lax.iota(jnp.int32, BC)) < T  # [BC]

    def load_y(i, s):
        m = jnp.broadcast_to(valid(i)[:, None], (BC, K))
        # Masked-load indices must be traced values for the interpret-mode discharge rule.
        return pltriton.load(y_ref.at[i_b, rows(i), jnp.int32(s), i_h, :], mask=m, other=0.0).astype(f32)

    def l2(x):
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)

    def load_q(i):
        return l2(load_y(i, 0)) * scale

    def load_k(i):
        return l2(load_y(i, 1))

    def load_g(i):
        m = jnp.broadcast_to(valid(i)[:, None], (BC, K))
        b_f = pltriton.load(f_ref.at[i_b, rows(i), i_h, :], mask=m, other=0.0).astype(f32)
        b_g = (lower_bound * jax.nn.sigmoid(b_a * (b_f + b_dtb[None, :]))).astype(dtype).astype(f32)
        return jnp.where(m, b_g, 0.0)

    def load_beta(i):
        b_b = pltriton.load(b_ref.at[i_b, rows(i), i_h], mask=valid(i), other=0.0).astype(f32)
        return jnp.where(valid(i), jax.nn.sigmoid(b_b).astype(dtype).astype(f32), 0.0)

    # Phase 1: Γ per sub-block (chunk-local, inclusive cumsum), keys, and each sub-block's reference row.
    b_G, b_k, ref_row = [], [], []
    carry = jnp.zeros((K,), f32)
    for i in range(NC):
        b_g = load_g(i)
        G_i = jnp.cumsum(b_g, axis=0) + carry[None, :]
        m_first = lax.broadcasted_iota(jnp.int32, (BC, K), 0) == 0
        ref_row.append(carry + jnp.sum(jnp.where(m_first, b_g, 0.0), axis=0))
        carry = carry + jnp.sum(b_g, axis=0)
        b_G.append(G_i)
        b_k.append(load_k(i))
    G_C = carry

    # Phase 2: A_qk and L = beta·(K_r·K_c e^{Γ_r − Γ_c}) strictly lower, block by block.
    L = {}
    for i in range(NC):
        b_q = load_q(i)
        qg_ref[i_b, rows(i), i_h, :] = (b_q * jnp.exp(b_G[i])).astype(store_dt)
        kg_ref[i_b, rows(i), i_h, :] = (b_k[i] * jnp.exp(G_C[None, :] - b_G[i])).astype(store_dt)
        beta_i = load_beta(i)
        e_q = jnp.exp(b_G[i] - ref_row[i][None, :])  # ≤ 1
        b_qd = b_q * e_q
        b_kr = b_k[i] * e_q
        for j in range(NC):
            o_cols = pl.ds(j * BC, BC)
            if j > i:
                aqk_ref[i_b, i_n, i_h, pl.ds(i * BC, BC), o_cols] = jnp.zeros((BC, BC), aqk_ref.dtype)
                continue
            # ≤ 1 off the diagonal, ≤ e^75 on it.
            b_kd = b_k[j] * jnp.exp(ref_row[i][None, :] - b_G[j])
            A_qk = dot(b_qd, b_kd, trans_b=True)
            A_kk = beta_i[:, None] * dot(b_kr, b_kd, trans_b=True)
            if j == i:
                A_qk = jnp.where(m_causal, A_qk, 0.0)
                A_kk = jnp.where(m_strict, A_kk, 0.0)
            aqk_ref[i_b, i_n, i_h, pl.ds(i * BC, BC), o_cols] = A_qk.astype(aqk_ref.dtype)
            L[i, j] = A_kk

    # Phase 3: X = (I + L)^{-1}. Diagonal blocks by forward substitution (row r of N = X − I is
    # −L[r] − Σ_{c<r} L[r, c] N[c]); off-diagonal blocks by X_ij = −X_ii Σ_{j≤m<i} L_im X_mj.
    def fwd_subst(b_L):
        def body(r, b_A):
            b_a = jnp.sum(jnp.where(o_r == r, b_A, 0.0), axis=0)  # row r of −L (zeros at c ≥ r)
            b_a = b_a + jnp.sum(b_a[:, None] * b_A, axis=0)
            return jnp.where(o_r == r, b_a[None, :], b_A)
        return lax.fori_loop(2, BC, body, -b_L) + eye

    X = {}
    for i in range(NC):
        X[i, i] = fwd_subst(L[i, i])
    for d in range(1, NC):
        for j in range(NC - d):
            i = j + d
            acc = dot(L[i, j], X[j, j])
            for m in range(j + 1, i):
                acc = acc + dot(L[i, m], X[m, j])
            X[i, j] = -dot(X[i, i], acc)

    # Phase 4: W = X diag(beta) (K ⊙ e^Γ), U = X diag(beta) V, and the gated copies of Q and K.
    beta = [load_beta(j) for j in range(NC)]
    b_kb = [b_k[j] * beta[j][:, None] * jnp.exp(b_G[j]) for j in range(NC)]
    b_vb = [load_y(j, 2) * beta[j][:, None] for j in range(NC)]  # each conv'd v tile once
    for i in range(NC):
        b_w = jnp.zeros((BC, K), f32)
        b_u = jnp.zeros((BC, K), f32)
        for j in range(i + 1):
            b_w = b_w + dot(X[i, j], b_kb[j])
            b_u = b_u + dot(X[i, j], b_vb[j])
        w_ref[i_b, rows(i), i_h, :] = b_w.astype(store_dt)
        u_ref[i_b, rows(i), i_h, :] = b_u.astype(store_dt)
    gc_ref[i_b, i_n, i_h, :] = jnp.exp(G_C)


def chunk_kda_fwd_kernel_h(
    w_ref,     # [B, NT*C, H, K]
    u_ref,     # [B, NT*C, H, V]
    qg_ref,    # [B, NT*C, H, K]
    kg_ref,    # [B, NT*C, H, K]
    aqk_ref,   # [B, NT, H, C, C]
    gc_ref,    # [B, NT, H, K] fp32
    h0_ref,    # [B, H, K, V] fp32
    z_ref,     # [B, T, H, V] output gate (used when the norm is fused)
    nw_ref,    # [K] norm weight
    y_ref,     # [B, T, H, V] out: y (fused norm) or o
    ht_ref,    # [B, H, K, V] fp32 out
    *, T, NT, C, BV, eps, FUSE_NORM, dot,
):
    i_b, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    o_v = pl.ds(i_v * BV, BV)
    f32 = jnp.float32
    if FUSE_NORM:
        b_nw = nw_ref[...].astype(f32)

    def body(i_n, b_h):
        t = pl.ds(i_n * C, C)
        b_w = w_ref[i_b, t, i_h, :]
        b_u = u_ref[i_b, t, i_h, o_v].astype(f32)
        b_qg = qg_ref[i_b, t, i_h, :]
        b_kg = kg_ref[i_b, t, i_h, :]
        b_A = aqk_ref[i_b, i_n, i_h, :, :]
        b_gc = gc_ref[i_b, i_n, i_h, :]
        b_vn = b_u - dot(b_w, b_h)  # [C, BV] pseudo-values Ũ
        b_o = dot(b_qg, b_h) + dot(b_A, b_vn)
        b_h = b_h * b_gc[:, None] + dot(b_kg, b_vn, trans_a=True)
        m_t = jnp.broadcast_to(((i_n * C + lax.iota(jnp.int32, C)) < T)[:, None], (C, BV))
        b_o = b_o.astype(y_ref.dtype)
        if FUSE_NORM:
            b_of = b_o.astype(f32)
            b_z = pltriton.load(z_ref.at[i_b, t, i_h, :], mask=m_t, other=0.0).astype(f32)
            b_y = b_of * lax.rsqrt(jnp.mean(b_of * b_of, axis=1, keepdims=True) + eps)
            b_o = (b_y * b_nw[None, :] * jax.nn.sigmoid(b_z)).astype(y_ref.dtype)
        pltriton.store(y_ref.at[i_b, t, i_h, o_v], b_o, mask=m_t)
        return b_h

    b_h = h0_ref[i_b, i_h, :, o_v]
    ht_ref[i_b, i_h, :, o_v] = lax.fori_loop(0, NT, body, b_h)


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "chunk_size", "cfg"))
def prefill(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
            chunk_size=64, cfg=DEFAULT):
    y_conv, new_window = conv_lib.short_conv(qkv, conv_window, conv_w, cfg=cfg.conv_cfg)
    y, ht = core(y_conv, f, b, z, state, A_log, dt_bias, o_norm_w, lower_bound=lower_bound, eps=eps,
                 chunk_size=chunk_size, cfg=cfg)
    return y, new_window, ht


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "chunk_size", "cfg"))
def core(qkv, f, b, z, state, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6, chunk_size=64, cfg=DEFAULT):
    """The intra and h kernels and the norm on qkv = the conv + SiLU output (also experiments/bench_kda.py's
    conv-free timing, the part fla's chunk_kda does)."""
    B, T, _, H, K = qkv.shape
    V = K
    C = chunk_size
    if C % BC or not is_pow2(C):
        raise ValueError(f"{chunk_size=} must be a power of two multiple of {BC}")
    NT = -(-T // C)
    dtype = qkv.dtype
    kind = cfg.dot if cfg.dot != "auto" else ("bf16" if dtype == jnp.bfloat16 else "tf32x3")
    store_dt = jnp.bfloat16 if kind == "bf16" else jnp.float32
    dot = _make_dot(kind)
    sds = jax.ShapeDtypeStruct
    TP = NT * C
    w, u, qg, kg, aqk, gc = pl.pallas_call(
        functools.partial(chunk_kda_fwd_kernel_intra, T=T, C=C, K=K, lower_bound=float(lower_bound), dot=dot),
        out_shape=[sds((B, TP, H, K), store_dt), sds((B, TP, H, V), store_dt), sds((B, TP, H, K), store_dt),
                   sds((B, TP, H, K), store_dt), sds((B, NT, H, C, C), store_dt), sds((B, NT, H, K), jnp.float32)],
        grid=(B, H, NT),
        interpret=interpret_mode(),
        name="kda_chunk_intra",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps_intra, num_stages=1),
    )(qkv, f, b, A_log, dt_bias)

    BV = min(cfg.BV, V)
    fuse_norm = BV == V
    y, ht = pl.pallas_call(
        functools.partial(chunk_kda_fwd_kernel_h, T=T, NT=NT, C=C, BV=BV, eps=float(eps), FUSE_NORM=fuse_norm,
                          dot=dot),
        out_shape=[sds((B, T, H, V), dtype), sds((B, H, K, V), jnp.float32)],
        grid=(B, H, V // BV),
        interpret=interpret_mode(),
        name="kda_chunk_h",
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps_h, num_stages=cfg.num_stages_h),
    )(w, u, qg, kg, aqk, gc, state, z, o_norm_w)
    if not fuse_norm:
        y = reference.gated_rms_norm(y, z, o_norm_w, eps)
    return y, ht
