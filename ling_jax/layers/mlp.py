"""Dense SwiGLU MLP (layers < first_k_dense_replace). Dense layers never clamp (docs/model.md §3.4)."""

import jax
import jax.numpy as jnp

from ling_jax.config import LingConfig
from ling_jax.layers.linear import dense
from ling_jax.params import dense_specs, param_axes


def dense_mlp(p: dict, h: jnp.ndarray, norm: tuple, cfg: LingConfig, *, gemv: str = "reference",
              residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """The block's input h [..., D], normalised by `norm` (weight, eps) -> residual + MLP(x) [..., D]."""
    axes = param_axes(dense_specs(cfg))
    gate = dense(h, p["w_gate"], axes["w_gate"], backend=gemv, norm=norm)
    up = dense(h, p["w_up"], axes["w_up"], backend=gemv, norm=norm)
    return dense(jax.nn.silu(gate) * up, p["w_down"], axes["w_down"], backend=gemv, residual=residual)
