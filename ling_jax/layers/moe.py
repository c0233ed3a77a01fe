"""MoE FFN (SPEC §2.5): sigmoid router with grouped top-k, routed experts + shared expert, per-layer clamps."""

import jax.numpy as jnp

from ling_jax.config import LingConfig
from pallas_kernels import moe as moe_ops


def moe_block(p: dict, x: jnp.ndarray, cfg: LingConfig, layer: int, *, backend: str) -> jnp.ndarray:
    """x [..., D] -> [..., D]; `layer` picks the SwiGLU clamp limits (MTP layers index past num_layers)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = moe_ops.route(
        flat, p["router"], p["expert_bias"], n_group=cfg.n_group, topk_group=cfg.topk_group,
        top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob, backend=backend)
    limit, shared_limit = cfg.swiglu_limits(layer)
    y = moe_ops.moe_experts(
        flat, weights, ids, p["we_gate"], p["we_up"], p["we_down"],
        p.get("ws_gate"), p.get("ws_up"), p.get("ws_down"),
        limit=limit, shared_limit=shared_limit, backend=backend)
    return y.reshape(x.shape)
