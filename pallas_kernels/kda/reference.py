"""Pure-jnp reference for Ling-3.0 KDA (docs/model.md §3.2): the specification, slow and obvious.

Everything accumulates in float32. Matmuls use ``precision=HIGHEST`` so that the reference is fp32 on GPU
too (XLA's default there is TF32).

Two cores, mirroring fla's ``naive.py``:

* ``recurrent_kda``: the token loop (``lax.scan``), exactly fla's ``naive_recurrent_kda``.
* ``chunk_kda``: the chunkwise WY/UT form (docs/model.md §7) for any T, with every decay factor formed as
  ``exp(Γ_r − Γ_c)`` with ``c ≤ r`` so no factor exceeds 1 (no overflow for gates down to −5).

Like fla's naive functions, both take **already L2-normalised** q and k and apply ``scale`` (default K^-1/2)
to q themselves; g is the log-space decay (after the gate), beta is after the sigmoid.

The layer compositions (``kda_layer``, ``kda_verify_layer``) run conv → gate/beta → L2 norm → delta rule →
gated RMSNorm with the roundings of the HF reference in bf16 (see the contract in ``dispatch.py``);
``layer_inputs`` draws random inputs in that contract for the tests and experiments/bench_kda.py; ``pack`` and
``unpack`` convert between its parts and the packed fused-projection layout that decode and verify take.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def kda_gate(f, A_log, dt_bias, lower_bound=-5.0):
    """Ling's safe (lower-bound) gate in fp32: ``lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, k]))``.

    Args:
        f: ``[..., H, K]`` f_proj output, any float dtype.
        A_log: ``[H]`` fp32.
        dt_bias: ``[H, K]`` (or ``[H*K]``) fp32.
    Returns:
        ``[..., H, K]`` float32 log-space decay in ``(lower_bound, 0)``.
    """
    H, K = f.shape[-2:]
    a = jnp.exp(A_log.astype(jnp.float32))[:, None]  # [H, 1]
    x = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, K)
    return lower_bound * jax.nn.sigmoid(a * x)


def l2_normalize(x, eps=1e-6):
    """``x / sqrt(sum(x**2) + eps)`` over the last axis, in fp32 (eps inside the sqrt, as fla's l2norm)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def short_conv(x, conv_window, conv_w):
    """Causal depthwise conv + SiLU over time, fp32 accumulation, output in x.dtype.

    Args:
        x: ``[B, T, *C]`` pre-conv rows (compute dtype).
        conv_window: ``[B, W-1, *C]`` the previous W-1 pre-conv rows, oldest first.
        conv_w: ``[W, *C]`` taps; tap W-1 multiplies the current row.
    Returns:
        ``(y [B, T, *C] x.dtype, new_window [B, W-1, *C])``, new_window = last W-1 rows of window ++ x.
    """
    W = conv_w.shape[0]
    T = x.shape[1]
    xs = jnp.concatenate([conv_window.astype(x.dtype), x], axis=1)  # [B, W-1+T, *C]
    xf = xs.astype(jnp.float32)
    w = conv_w.astype(jnp.float32)
    acc = sum(w[j] * xf[:, j:j + T] for j in range(W))
    y = jax.nn.silu(acc).astype(x.dtype)
    return y, xs[:, T:]


def gated_rms_norm(o, z, weight, eps=1e-6):
    """fla ``FusedRMSNormGated`` with sigmoid: ``o * rsqrt(mean(o**2) + eps) * w * sigmoid(z)`` in fp32, cast to o.dtype."""
    of = o.astype(jnp.float32)
    y = of * lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    y = y * weight.astype(jnp.float32) * jax.nn.sigmoid(z.astype(jnp.float32))
    return y.astype(o.dtype)


def recurrent_kda(q, k, v, g, beta, initial_state=None, *, scale=None, return_all_states=False):
    """Token-by-token delta rule with per-channel decay (fla ``naive_recurrent_kda``), fp32.

    Args:
        q, k: ``[B, T, H, K]`` already L2-normalised (q is multiplied by ``scale`` here).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-space decay.
        beta: ``[B, T, H]`` after the sigmoid.
        initial_state: ``[B, H, K, V]`` fp32 or None (zeros).
        scale: q scale, default ``K ** -0.5``.
        return_all_states: also return the post-state of every token.
    Returns:
        ``(o [B, T, H, V] fp32, final_state [B, H, K, V])``, or ``(o, states [B, T, H, K, V])`` when
        ``return_all_states``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    q = q * scale
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, K], [B, H, K], [B, H, V], [B, H, K], [B, H]
        S = S * jnp.exp(g_t)[..., None]
        kS = jnp.einsum('bhk,bhkv->bhv', k_t, S, precision=HIGHEST)
        u = b_t[..., None] * (v_t - kS)
        S = S + k_t[..., :, None] * u[..., None, :]
        o_t = jnp.einsum('bhk,bhkv->bhv', q_t, S, precision=HIGHEST)
        return S, (o_t, S if return_all_states else None)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    S, (o, states) = lax.scan(step, S0, xs)
    o = jnp.moveaxis(o, 0, 1)
    if return_all_states:
        return o, jnp.moveaxis(states, 0, 1)
    return o, S


def _chunk_factors(q, k, v, g, beta, chunk_size):
    """Per-chunk WY/UT quantities of docs/model.md §7 for [..., C, K] blocks (fp32, all decay factors ≤ 1)."""
    C = chunk_size
    G = jnp.cumsum(g, axis=-2)  # Γ, [..., C, K]
    r = jnp.arange(C)
    strict = r[:, None] > r[None, :]
    causal = r[:, None] >= r[None, :]
    # e^{Γ_r − Γ_c} for c ≤ r only; the exponent is masked to −inf first so e^{+Γ} is never formed.
    diff = G[..., :, None, :] - G[..., None, :, :]  # [..., C(r), C(c), K]
    decay_strict = jnp.exp(jnp.where(strict[..., None], diff, -jnp.inf))
    decay_causal = jnp.exp(jnp.where(causal[..., None], diff, -jnp.inf))
    L = beta[..., :, None] * jnp.einsum('...rd,...cd,...rcd->...rc', k, k, decay_strict, precision=HIGHEST)
    Aqk = jnp.einsum('...rd,...cd,...rcd->...rc', q, k, decay_causal, precision=HIGHEST)
    eye = jnp.eye(C, dtype=jnp.float32)
    # M = (I + L)^{-1} diag(beta): unit lower-triangular solve.
    M = lax.linalg.triangular_solve(eye + L, jnp.broadcast_to(eye * beta[..., None, :], L.shape),
                                    left_side=True, lower=True, unit_diagonal=True)
    W = jnp.einsum('...rc,...ck->...rk', M, k * jnp.exp(G), precision=HIGHEST)
    U = jnp.einsum('...rc,...cv->...rv', M, v, precision=HIGHEST)
    return G, Aqk, W, U


def chunk_kda(q, k, v, g, beta, initial_state=None, *, scale=None, chunk_size=64):
    """Chunkwise KDA (fla ``naive_chunk_kda``) for any T: pads to a chunk multiple internally.

    Same arguments as ``recurrent_kda``. The padded tail has g = 0, beta = 0 and k = 0, so it leaves the state
    unchanged. Returns ``(o [B, T, H, V] fp32, final_state [B, H, K, V] fp32)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if scale is None:
        scale = K ** -0.5
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    q = q * scale
    NT = -(-T // C)
    P = NT * C - T
    pad = lambda x: jnp.pad(x, [(0, 0), (0, P)] + [(0, 0)] * (x.ndim - 2))
    # [B, T, H, ...] -> [NT, B, H, C, ...]
    to_chunks = lambda x: jnp.moveaxis(pad(x).reshape(B, NT, C, H, *x.shape[3:]), (1, 2), (0, 3))
    qc, kc, vc, gc, bc = (to_chunks(x) for x in (q, k, v, g, beta))
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

    def step(S, xs):
        q_c, k_c, v_c, g_c, b_c = xs
        G, Aqk, Wc, Uc = _chunk_factors(q_c, k_c, v_c, g_c, b_c, C)
        Un = Uc - jnp.einsum('bhck,bhkv->bhcv', Wc, S, precision=HIGHEST)  # pseudo-values Ũ
        o = (jnp.einsum('bhck,bhkv->bhcv', q_c * jnp.exp(G), S, precision=HIGHEST)
             + jnp.einsum('bhrc,bhcv->bhrv', Aqk, Un, precision=HIGHEST))
        GC = G[..., -1, :]  # [B, H, K]
        S = (S * jnp.exp(GC)[..., None]
             + jnp.einsum('bhck,bhcv->bhkv', k_c * jnp.exp(GC[..., None, :] - G), Un, precision=HIGHEST))
        return S, o

    S, o = lax.scan(step, S0, (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(B, NT * C, H, V)[:, :T]
    return o, S


def kda_inputs(qkv, f, b, conv_window, conv_w, A_log, dt_bias, lower_bound=-5.0):
    """Layer front half: conv + SiLU, gate, beta, L2 norm. Returns fp32 (q̂, k̂, v, g, beta) and the new window.

    The gate and beta are rounded to the compute dtype and back, as the HF reference casts them to the
    model dtype; the conv output is rounded to the compute dtype before the L2 norm.
    """
    dtype = qkv.dtype
    y, new_window = short_conv(qkv, conv_window, conv_w)  # [B, T, 3, H, K]
    q = l2_normalize(y[:, :, 0])
    k = l2_normalize(y[:, :, 1])
    v = y[:, :, 2].astype(jnp.float32)
    g = kda_gate(f, A_log, dt_bias, lower_bound).astype(dtype).astype(jnp.float32)
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    return (q, k, v, g, beta), new_window


def kda_layer(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0,
              eps=1e-6, mode="recurrent"):
    """The KDA layer between the input projections and o_proj. mode: "recurrent" or "chunk".

    Returns ``(y [B, T, H, K] compute dtype, new_conv_window, new_state)``.
    """
    (q, k, v, g, beta), new_window = kda_inputs(qkv, f, b, conv_window, conv_w, A_log, dt_bias, lower_bound)
    core = {"recurrent": recurrent_kda, "chunk": chunk_kda}[mode]
    o, new_state = core(q, k, v, g, beta, state)
    y = gated_rms_norm(o.astype(qkv.dtype), z, o_norm_w, eps)
    return y, new_window, new_state


def kda_verify_layer(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0,
                     eps=1e-6):
    """Verify: the recurrent layer keeping every position's post-state.

    Returns ``(y [B, T, H, K], conv_rows [B, W-1+T, 3, H, K], states [B, T, H, K, V])`` where
    ``conv_rows`` = old window ++ qkv (the window after position t is ``conv_rows[:, t+1 : t+W]``).
    """
    (q, k, v, g, beta), _ = kda_inputs(qkv, f, b, conv_window, conv_w, A_log, dt_bias, lower_bound)
    o, states = recurrent_kda(q, k, v, g, beta, state, return_all_states=True)
    y = gated_rms_norm(o.astype(qkv.dtype), z, o_norm_w, eps)
    conv_rows = jnp.concatenate([conv_window.astype(qkv.dtype), qkv], axis=1)
    return y, conv_rows, states


def pack(qkv, f, b, z):
    """The fused input projection's layout [B, T, H, 5K+1], per head q|k|v|f|g|b, from the parts."""
    q, k, v = (qkv[:, :, i] for i in range(3))
    return jnp.concatenate([q, k, v, f, z, b[..., None]], axis=-1)


def unpack(x):
    """``pack``'s inverse: [B, T, H, 5K+1] -> (qkv [B, T, 3, H, K], f, b [B, T, H], z)."""
    K = (x.shape[-1] - 1) // 5
    part = lambda i: x[..., i * K:(i + 1) * K]  # noqa: E731
    return jnp.stack([part(0), part(1), part(2)], axis=2), part(3), x[..., 5 * K], part(4)


def layer_inputs(seed, B, T, H, K, dtype=jnp.float32, gate="mixed", fresh_window=False, W=4):
    """Random inputs in the layer contract of ``dispatch.py`` (numpy-seeded, so a failure names its draw).

    gate="strong": A_log and dt_bias push g to about −5 (the safe gate's bound); fresh_window: a zero window.
    """
    rng = np.random.default_rng(seed)
    n = lambda *s, sc=1.0: rng.standard_normal(s).astype(np.float32) * sc
    qkv = jnp.asarray(n(B, T, 3, H, K), dtype)
    f = jnp.asarray(n(B, T, H, K), dtype)
    b = jnp.asarray(n(B, T, H, sc=2.0), dtype)
    z = jnp.asarray(n(B, T, H, K), dtype)
    window = jnp.zeros((B, W - 1, 3, H, K), dtype) if fresh_window else jnp.asarray(n(B, W - 1, 3, H, K), dtype)
    state = jnp.asarray(n(B, H, K, K, sc=0.5))
    conv_w = jnp.asarray(n(W, 3, H, K, sc=0.5))
    if gate == "strong":
        A_log = jnp.asarray(rng.uniform(1.5, 2.5, H).astype(np.float32))
        dt_bias = jnp.asarray(rng.uniform(2.0, 4.0, (H, K)).astype(np.float32))
    else:
        A_log = jnp.asarray(n(H, sc=0.5))
        dt_bias = jnp.asarray(n(H, K, sc=0.5))
    o_norm_w = jnp.asarray(1.0 + n(K, sc=0.1))
    return qkv, f, b, z, window, state, conv_w, A_log, dt_bias, o_norm_w
