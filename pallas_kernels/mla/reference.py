"""Pure-jnp MLA attention: the specification the Pallas kernels are tested against (docs/model.md §3.3).

`mla_prefill_attention` is transformers' eager attention over the expanded heads (scores rounded to the compute
dtype, softmax in fp32, probabilities rounded before ·V), for T queries at positions start .. start+T-1 over L >= T
keys (one-shot prefill: start 0, L = T; a prefill chunk: the earlier keys too). `mla_decode_attention` is the
absorbed form over the latent cache [c_kv | k_rope], fp32 throughout. Both mask the positions past start + T and
zero them, so garbage there cannot leak through 0 · NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def mla_prefill_attention(q, k, v, start=0, *, scale):
    """q [B, T, H, Dqk]; k [B, L, H, Dqk]; v [B, L, H, Dv], L >= T; start int32 scalar (may be traced).

    Query t (position start + t) sees key positions l <= start + t. Returns o [B, T, H, Dv] compute dtype.
    """
    dt = q.dtype
    prec = _HI if dt == jnp.float32 else None
    t, length = q.shape[1], k.shape[1]
    pos = jnp.arange(length)
    # Rows past the chunk are garbage (maybe NaN): zero them so masked 0-weights cannot leak NaN. With start 0 and
    # L = T nothing is replaced, and the result is the eager formula's bit for bit.
    live = (pos < start + t)[None, :, None, None]
    k, v = jnp.where(live, k, 0), jnp.where(live, v, 0)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32, precision=prec).astype(dt)
    # torch multiplies a bf16 tensor by a Python float in fp32 and rounds once; so do we.
    s = (s.astype(jnp.float32) * scale).astype(dt).astype(jnp.float32)
    visible = pos[None, :] <= (start + jnp.arange(t))[:, None]  # [T, L]
    s = jnp.where(visible[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32, precision=prec).astype(dt)


def mla_decode_attention(q_latent, q_rope, kv_cache, start, *, scale):
    """q_latent [B, T, H, R] fp32; q_rope [B, T, H, P]; kv_cache [B, L, R + P]; start int32 scalar.

    Query t sees cache positions l <= start + t. Returns o_latent [B, T, H, R] float32.
    """
    r = q_latent.shape[-1]
    t = q_latent.shape[1]
    length = kv_cache.shape[1]
    pos = jnp.arange(length)
    # Rows past the last new position are garbage (maybe NaN): zero them so masked 0-weights cannot leak NaN.
    cache = jnp.where((pos < start + t)[None, :, None], kv_cache.astype(jnp.float32), 0.0)
    c_kv, k_rope = cache[..., :r], cache[..., r:]  # [B, L, R], [B, L, P]
    s = jnp.einsum("bthr,blr->bhtl", q_latent.astype(jnp.float32), c_kv, precision=_HI)
    s = s + jnp.einsum("bthp,blp->bhtl", q_rope.astype(jnp.float32), k_rope, precision=_HI)
    s = s * scale
    visible = pos[None, :] <= (start + jnp.arange(t))[:, None]  # [T, L]
    s = jnp.where(visible[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhtl,blr->bthr", p, c_kv, precision=_HI)
