"""Public MLA entry points: validate shapes and dtypes, then run the chosen backend (never a silent fallback).

`backend="reference"` runs `reference.py`; `backend="pallas"` runs `prefill.py` (flash attention over the expanded
heads) or `decode.py` (absorbed, over the latent cache), compiled on a GPU and interpreted on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import COMPUTE_DTYPES, check_backend, check_dtype, check_rank, check_shape
from pallas_kernels.mla import reference


def mla_prefill_attention(q, k, v, start=0, *, scale, backend="reference", tuning=None):
    """Causal softmax attention of T queries over L >= T expanded MLA heads, transformers' eager numerics.

    Args:
      q: [B, T, H, Dqk] compute dtype, the queries at positions start .. start+T-1.
      k: [B, L, H, Dqk], v: [B, L, H, Dv], q's dtype: keys and values of positions 0 .. L-1; positions
        >= start + T are never read into the result (garbage or NaN there is fine).
      start: int32 scalar (may be traced), the position of the first query; 0 for a one-shot prefill (L = T).
      scale: softmax scale (192^-0.5 for Ling).
      backend: "reference" | "pallas".
      tuning: optional `prefill.MLAPrefillTuning` for backend="pallas" (tiling); None: the defaults, or where
        they exceed the shared memory for q's dtype (float32 at Ling's widths) `prefill.fitting_tuning`'s.
    Returns:
      o [B, T, H, Dv] compute dtype.
    """
    check_backend(backend)
    check_rank("q", q, 4, "[B, T, H, Dqk]")
    check_dtype("q", q, COMPUTE_DTYPES)
    b, t, h, dqk = q.shape
    check_rank("k", k, 4, "[B, L, H, Dqk]")
    length = k.shape[1]
    check_shape("k", k, (b, length, h, dqk), "[B, L, H, Dqk]")
    if length < t:
        raise ValueError(f"k.shape={tuple(k.shape)} must have L >= T = {t} (the keys include the queries' own)")
    check_rank("v", v, 4, "[B, L, H, Dv]")
    check_shape("v", v, (b, length, h, v.shape[3]), "[B, L, H, Dv]")
    check_dtype("k", k, (q.dtype,))
    check_dtype("v", v, (q.dtype,))
    start = _check_start(start, t, length)
    if backend == "reference":
        _no_tuning(tuning)
        return reference.mla_prefill_attention(q, k, v, start, scale=scale)
    from pallas_kernels.mla import prefill

    if tuning is not None:  # None: the kernel's defaults that fit the shared memory for q's dtype
        _pallas_tuning(tuning, prefill.MLAPrefillTuning, "prefill")
    return prefill.mla_prefill_attention(q, k, v, start, scale=scale, tuning=tuning)


def _no_tuning(tuning):
    if tuning is not None:
        raise ValueError("tuning= tunes the Pallas kernel: pass backend='pallas', or drop tuning= for the reference")


def _pallas_tuning(tuning, cls, module: str):
    """`tuning`, or the kernel's defaults when None; anything but a `cls` is refused."""
    if tuning is not None and not isinstance(tuning, cls):
        raise TypeError(f"tuning must be a pallas_kernels.mla.{module}.{cls.__name__}, got {type(tuning).__name__}")
    return cls() if tuning is None else tuning


def _int_scalar(start):
    start = jnp.asarray(start)
    if start.ndim != 0 or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start (shape {start.shape}, dtype {start.dtype}) must be an integer scalar")
    return start.astype(jnp.int32)


def _check_start(start, t, length):
    """start as an int32 scalar; a concrete one must put the T queries inside the L keys."""
    concrete = not isinstance(start, jax.core.Tracer)
    start = _int_scalar(start)
    if concrete and not 0 <= int(start) <= length - t:
        raise ValueError(f"start={int(start)} must be in [0, L - T] = [0, {length - t}]: the queries' positions "
                         f"start .. start + T - 1 index the L = {length} keys")
    return start


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
    start = _int_scalar(start)
    if backend == "reference":
        _no_tuning(tuning)
        return reference.mla_decode_attention(q_latent, q_rope, kv_cache, start, scale=scale)
    from pallas_kernels.mla import decode

    tuning = _pallas_tuning(tuning, decode.MLADecodeTuning, "decode")
    return decode.mla_decode_attention(q_latent, q_rope, kv_cache, start, scale=scale, tuning=tuning)
