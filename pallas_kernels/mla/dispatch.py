"""Public MLA entry points: validate shapes and dtypes, then run the chosen backend (never a silent fallback).

`backend="reference"` runs `reference.py`; `backend="pallas"` runs `decode.py` (compiled on a GPU, interpreted
on CPU). Prefill has no kernel yet: `backend="pallas"` raises rather than falling back.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import COMPUTE_DTYPES, check_backend, check_dtype, check_rank, check_shape
from pallas_kernels.mla import reference


def mla_prefill_attention(q, k, v, *, scale, backend="reference"):
    """Causal softmax attention over expanded MLA heads, transformers' eager numerics.

    Args:
      q, k: [B, T, H, Dqk] compute dtype; v: [B, T, H, Dv] compute dtype.
      scale: softmax scale (192^-0.5 for Ling).
      backend: "reference" ("pallas" has no prefill kernel and raises).
    Returns:
      o [B, T, H, Dv] compute dtype.
    """
    check_backend(backend)
    check_rank("q", q, 4, "[B, T, H, Dqk]")
    check_dtype("q", q, COMPUTE_DTYPES)
    b, t, h, dqk = q.shape
    check_shape("k", k, (b, t, h, dqk), "[B, T, H, Dqk]")
    check_rank("v", v, 4, "[B, T, H, Dv]")
    check_shape("v", v, (b, t, h, v.shape[3]), "[B, T, H, Dv]")
    check_dtype("k", k, (q.dtype,))
    check_dtype("v", v, (q.dtype,))
    if backend == "pallas":
        raise NotImplementedError("mla_prefill_attention has no Pallas kernel; use backend='reference'")
    return reference.mla_prefill_attention(q, k, v, scale=scale)


def mla_decode_attention(q_latent, q_rope, kv_cache, start, *, scale, backend="reference", tuning=None):
    """Absorbed MLA attention of T new queries over the latent cache.

    Args:
      q_latent: [B, T, H, R] float32 (q_nope · W_uk per head).
      q_rope: [B, T, H, P] float32 or compute dtype, already rotated.
      kv_cache: [B, L, R + P] = [normalised c_kv | rotated k_rope], already holding the T new positions at
        start .. start+T-1; positions >= start + T are never read into the result.
      start: int32 scalar (may be traced): cache position of the first new query.
      scale: softmax scale.
      backend: "reference" | "pallas".
      tuning: optional `decode.MLADecodeTuning` for backend="pallas" (tiling).
    Returns:
      o_latent [B, T, H, R] float32 (the caller applies W_uv and the head-wise gate).
    """
    check_backend(backend)
    check_rank("q_latent", q_latent, 4, "[B, T, H, R]")
    check_dtype("q_latent", q_latent, (jnp.float32,))
    b, t, h, r = q_latent.shape
    check_rank("q_rope", q_rope, 4, "[B, T, H, P]")
    p = q_rope.shape[3]
    check_shape("q_rope", q_rope, (b, t, h, p), "[B, T, H, P]")
    check_dtype("q_rope", q_rope, COMPUTE_DTYPES)
    check_rank("kv_cache", kv_cache, 3, "[B, L, R + P]")
    check_shape("kv_cache", kv_cache, (b, kv_cache.shape[1], r + p), "[B, L, R + P]")
    check_dtype("kv_cache", kv_cache, COMPUTE_DTYPES)
    if kv_cache.shape[1] < t:
        raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)} must have L >= T = {t}")
    start = jnp.asarray(start)
    if start.ndim != 0 or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start (shape {start.shape}, dtype {start.dtype}) must be an integer scalar")
    start = start.astype(jnp.int32)
    if backend == "reference":
        if tuning is not None:
            raise ValueError("tuning= tunes the Pallas kernel: pass backend='pallas', or drop tuning= for the "
                             "reference")
        return reference.mla_decode_attention(q_latent, q_rope, kv_cache, start, scale=scale)
    from pallas_kernels.mla import decode

    if tuning is not None and not isinstance(tuning, decode.MLADecodeTuning):
        raise TypeError(f"tuning must be a pallas_kernels.mla.decode.MLADecodeTuning, got {type(tuning).__name__}")

    tuning = decode.MLADecodeTuning() if tuning is None else tuning
    return decode.mla_decode_attention(q_latent, q_rope, kv_cache, start, scale=scale, tuning=tuning)
