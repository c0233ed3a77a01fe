"""MoE FFN (SPEC §2.5): sigmoid router with grouped top-k, routed experts + shared expert, per-layer clamps."""

import functools

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.config import LingConfig
from ling_jax.sharding import TP, per_shard
from pallas_kernels import moe as moe_ops

# Per shard: every expert's slice of the intermediate dim; the partial outputs are summed across `tp`. Every
# expert matrix is [.., Ie, D] (ling_jax/params.py), so all shard their Ie rows.
_EXPERT_SPECS = (P(), P(), P(), P(None, TP, None), P(None, TP, None), P(None, TP, None), P(TP, None), P(TP, None),
                 P(TP, None))


def moe_block(p: dict, x: jnp.ndarray, cfg: LingConfig, layer: int, *, backend: str) -> jnp.ndarray:
    """x [..., D] -> [..., D]; `layer` picks the SwiGLU clamp limits (MTP layers index past num_layers)."""
    flat = x.reshape(-1, x.shape[-1])
    route = functools.partial(
        moe_ops.route, n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, backend=backend)
    limit, shared_limit = cfg.swiglu_limits(layer)
    experts = functools.partial(moe_ops.moe_experts, limit=limit, shared_limit=shared_limit, backend=backend)
    shared = (p["ws_gate"], p["ws_up"], p["ws_down"]) if "ws_gate" in p else (None, None, None)
    if backend == "pallas":
        route = per_shard(route, (P(), P(), P()), (P(), P()))  # replicated: every device routes alike
        specs = _EXPERT_SPECS if shared[0] is not None else _EXPERT_SPECS[:6] + (None, None, None)
        experts = per_shard(experts, specs, P(), sum_outputs=True)
    weights, ids = route(flat, p["router"], p["expert_bias"])
    y = experts(flat, weights, ids, p["we_gate"], p["we_up"], p["we_down"], *shared)
    return y.reshape(x.shape)
