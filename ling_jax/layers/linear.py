"""Projections with the reference numerics: accumulate in float32, round the output to the compute dtype once."""

import jax.numpy as jnp


def proj(eq: str, x: jnp.ndarray, w: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """einsum(eq, x, w) with fp32 accumulation, rounded to `out_dtype` (default: x's dtype).

    torch's bf16 matmul accumulates in fp32 and rounds once, so this matches it to the rounding of the sum.
    `w` is cast to x's dtype first (fp32-class weights such as the router keep their own path).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jnp.einsum(eq, x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision="highest")
    return y.astype(out_dtype)
