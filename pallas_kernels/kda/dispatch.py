"""Public KDA entry points: prefill, decode, verify (+ commit), one per mode.

Each is the part of a Ling-3.0 KDA layer between the input projections and o_proj. Prefill takes the parts:

    qkv:  [B, T, 3, H, K]  pre-conv projections q|k|v (compute dtype: float32 or bfloat16), K == V
    f:    [B, T, H, K]     f_proj output (gate input, compute dtype)
    b:    [B, T, H]        b_proj output (beta logits, compute dtype)
    z:    [B, T, H, K]     g_proj output (output gate, compute dtype, not activated)
    conv_window: [B, W-1, 3, H, K] previous W-1 pre-conv rows, oldest first (zeros when fresh), compute dtype
    state: [B, H, K, V] float32 recurrent state
    conv_w: [W, 3, H, K] float32 depthwise causal conv taps (tap W-1 multiplies the current token)
    A_log: [H] f32; dt_bias: [H, K] f32; o_norm_w: [K] gated-RMSNorm weight shared by heads

Decode and verify take the fused input projection's output as it is in place of qkv, f, b, z:

    x:    [B, T, H, 5K+1]  per head q|k|v|f|g|b (ling_jax/params.py kda_in_parts; reference.pack / unpack)

so that the Pallas kernel loads each part at its column offset and no XLA slice or q|k|v stack runs before it
(three launches per layer step on the H200); the reference backend unpacks and runs the specification.

`backend="reference"` runs the pure-jnp spec (reference.py); `backend="pallas"` runs the Pallas-Triton kernels
(interpret mode on CPU). Shapes the kernels cannot take raise; nothing falls back silently.

Speculative verify keeps every position's post-state and commit selects ``states[n-1]`` (docs/design.md §2):
on the H200 verify + commit measured 17.5 µs per layer at T = 6 against 21.6 for staging the inputs and replaying
the accepted prefix on commit (experiments/FINDINGS.md).
"""

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda import chunk, recurrent, reference

BACKENDS = ("reference", "pallas")
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, backend,
           mode, max_t=None, source=None):
    # source: (name, shape, layout) of the input the caller passed, named in the messages (default qkv itself).
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{qkv.shape=} must be [B, T, 3, H, K]")
    B, T, _, H, K = qkv.shape
    if jnp.dtype(qkv.dtype) not in _DTYPES:
        raise ValueError(f"{qkv.dtype=} must be float32 or bfloat16")
    dtype = qkv.dtype
    if conv_w.ndim != 4 or conv_w.shape[0] < 2:
        raise ValueError(f"{conv_w.shape=} must be [W, 3, H, K] with W >= 2")
    W = conv_w.shape[0]
    name_in, shape_in, layout_in = source or ("qkv", tuple(qkv.shape), "[B, T, 3, H, K]")
    given = f"{name_in}.shape={shape_in}"
    expect = {
        "f": (f, (B, T, H, K), dtype),
        "b": (b, (B, T, H), dtype),
        "z": (z, (B, T, H, K), dtype),
        "conv_window": (conv_window, (B, W - 1, 3, H, K), dtype),
        "state": (state, (B, H, K, K), jnp.float32),
        "conv_w": (conv_w, (W, 3, H, K), jnp.float32),
        "A_log": (A_log, (H,), jnp.float32),
        "dt_bias": (dt_bias, (H, K), jnp.float32),
        "o_norm_w": (o_norm_w, (K,), None),
    }
    for name, (x, shape, dt) in expect.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be {shape} "
                             f"(from {given} = {layout_in}, W={W}; state is [B, H, K, V], K == V)")
        if dt is not None and jnp.dtype(x.dtype) != jnp.dtype(dt):
            raise ValueError(f"{name}.dtype={x.dtype} must be {jnp.dtype(dt)}")
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"{lower_bound=} must be in [-5, 0): the chunked form is only safe for gates >= -5")
    if mode == "decode" and T != 1:
        raise ValueError(f"kda_decode needs T == 1, got {given}")
    if max_t is not None and T > max_t:
        raise ValueError(f"{mode} takes T <= {max_t}, got {given}")
    if backend == "pallas" and (K & (K - 1) or K < 16):
        raise ValueError(f"backend='pallas' needs K a power of two >= 16 (Triton block shapes), got {K=}")


def _check_packed(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, backend, mode, max_t=None):
    """Validates the packed x, then every other argument against the parts it stands for."""
    if x.ndim != 4:
        raise ValueError(f"{x.shape=} must be the packed [B, T, H, 5K+1]")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"x.dtype={jnp.dtype(x.dtype)} must be float32 or bfloat16")
    if conv_w.ndim != 4:
        raise ValueError(f"{conv_w.shape=} must be [W, 3, H, K] with W >= 2")
    B, T, H, width = x.shape
    K = conv_w.shape[-1]
    if width != 5 * K + 1:
        raise ValueError(f"x.shape[-1]={width} must be 5K+1 = {5 * K + 1} (q|k|v|f|g|b per head, "
                         f"K={K} from conv_w.shape={tuple(conv_w.shape)})")
    sds = jax.ShapeDtypeStruct
    parts = (sds((B, T, 3, H, K), x.dtype), sds((B, T, H, K), x.dtype), sds((B, T, H), x.dtype),
             sds((B, T, H, K), x.dtype))
    _check(*parts, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, backend, mode, max_t,
           source=("x", tuple(x.shape), "[B, T, H, 5K+1]"))


def kda_prefill(qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0,
                eps=1e-6, backend="reference", chunk_size=64):
    """Chunked prefill (C = 64) for any T, from ``state``. Returns ``(y, new_conv_window, new_state)``."""
    args = (qkv, f, b, z, conv_window, state, conv_w, A_log, dt_bias, o_norm_w)
    _check(*args, lower_bound, backend, "prefill")
    if backend == "reference":
        return _ref_layer(*args, lower_bound=lower_bound, eps=eps, mode="chunk")
    return chunk.prefill(*args, lower_bound=lower_bound, eps=eps, chunk_size=chunk_size)


def kda_decode(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
               backend="reference", defer_norm=False):
    """One token (T == 1) of the packed x. Returns ``(y, new_conv_window, new_state)``; the Pallas kernel
    updates the state in place when the caller donates it. `defer_norm`: the Pallas kernel's y may come back as a
    `pallas_kernels.common.norm.GroupRMS` (the gated norm's per-head RMS scaling not yet applied), which the o_proj
    GEMV (`pallas_kernels.gemv.gemv`) applies in its prologue; `y.apply()` gives the plain y."""
    args = (conv_window, state, conv_w, A_log, dt_bias, o_norm_w)
    _check_packed(x, *args, lower_bound, backend, "decode")
    if backend == "reference":
        return _ref_layer(*reference.unpack(x), *args, lower_bound=lower_bound, eps=eps, mode="recurrent")
    return recurrent.decode(x, *args, lower_bound=lower_bound, eps=eps, defer_norm=defer_norm)


def kda_verify(x, conv_window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
               backend="reference", defer_norm=False):
    """T draft positions of the packed x from the committed ``state`` (read only).

    Returns ``(y, conv_rows, states)``: conv_rows [B, W-1+T, 3, H, K] = old window ++ q|k|v (the window after
    position t is ``conv_rows[:, t+1 : t+W]``) and states [B, T, H, K, V] fp32, every position's post-state.
    `defer_norm` as in `kda_decode`.
    """
    args = (conv_window, state, conv_w, A_log, dt_bias, o_norm_w)
    _check_packed(x, *args, lower_bound, backend, "verify", max_t=64)
    if backend == "reference":
        return _ref_verify(*reference.unpack(x), *args, lower_bound=lower_bound, eps=eps)
    return recurrent.verify(x, *args, lower_bound=lower_bound, eps=eps, defer_norm=defer_norm)


def kda_commit(conv_rows, states, n):
    """``(window, state)`` after verify position n-1, from ``kda_verify``'s conv_rows and states.

    n: int32 device scalar (or [B]) in [1, T], the number of verify positions kept. Never read on the host;
    no lax.cond.
    """
    B, R = conv_rows.shape[:2]
    Wm1 = R - states.shape[1]
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    window = jax.vmap(lambda rows, i: lax.dynamic_slice_in_dim(rows, i, Wm1, axis=0))(conv_rows, n)
    state = jax.vmap(lambda s, i: lax.dynamic_index_in_dim(s, i - 1, axis=0, keepdims=False))(states, n)
    return window, state


_ref_layer = jax.jit(reference.kda_layer, static_argnames=("lower_bound", "eps", "mode"))
_ref_verify = jax.jit(reference.kda_verify_layer, static_argnames=("lower_bound", "eps"))
