"""Interleaved (GPT-J) RoPE on MLA's rope dims (docs/model.md §3.3).

All `qk_rope_head_dim` dims rotate (partial_rotary_factor is not applied to MLA). Pairs (x[2i], x[2i+1]) rotate by
pos * theta^(-2i/P). Like the reference, the output is written de-interleaved, [rotated evens | rotated odds]; q
and k share the layout, so q.k is the plain GPT-J product. cos/sin are computed in fp32 and rounded to the compute
dtype before use, as the reference does.
"""

import jax.numpy as jnp


def rope_cos_sin(positions: jnp.ndarray, dim: int, theta: float, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [..., T] int -> cos, sin [..., T, dim/2] in `dtype`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, (heads,) P]; cos/sin [B or 1, T, P/2], broadcast over a heads axis when x has one."""
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
