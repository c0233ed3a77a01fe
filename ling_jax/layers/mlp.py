"""Dense SwiGLU MLP (layers < first_k_dense_replace). Dense layers never clamp (docs/model.md §3.4)."""

import jax
import jax.numpy as jnp

from ling_jax.layers.linear import proj


def dense_mlp(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    gate = proj("...d,di->...i", x, p["w_gate"])
    up = proj("...d,di->...i", x, p["w_up"])
    return proj("...i,id->...d", jax.nn.silu(gate) * up, p["w_down"])
