"""MoE FFN (docs/model.md §3.5): sigmoid router with grouped top-k, routed experts + shared expert, per-layer clamps."""

import functools

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.config import LingConfig
from ling_jax.sharding import TP, per_shard, tp_size
from pallas_kernels import moe as moe_ops

# Per shard: every expert's slice of the intermediate dim; the partial outputs are summed across `tp`. Gate/up are
# [.., Ie, D] and down [.., D, Ie] (ling_jax/params.py): gate/up shard their Ie rows, down its Ie columns.
_EXPERT_SPECS = (P(), P(), P(), P(None, TP, None), P(None, TP, None), P(None, None, TP), P(TP, None), P(TP, None),
                 P(None, TP))


def route_then_prefetch(route):
    """route(x, router, bias, *prefetch): the arrays after the bias go to the router's `prefetch` hint."""
    return lambda x, router, bias, *prefetch: route(x, router, bias, prefetch=prefetch)


def moe_block(p: dict, x: jnp.ndarray, cfg: LingConfig, layer: int, *, backend: str,
              residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """x [..., D] -> [..., D] (+ `residual` [..., D], the block's h); `layer` picks the SwiGLU clamp limits (MTP
    layers index past num_layers)."""
    flat = x.reshape(-1, x.shape[-1])
    route = route_then_prefetch(functools.partial(
        moe_ops.route, n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, backend=backend))
    limit, shared_limit = cfg.swiglu_limits(layer)
    experts = functools.partial(moe_ops.moe_experts, limit=limit, shared_limit=shared_limit, backend=backend)
    shared = (p["ws_gate"], p["ws_up"], p["ws_down"]) if "ws_gate" in p else (None, None, None)
    prefetch = shared if shared[0] is not None else ()
    if backend == "pallas":
        # Routing is replicated (every device routes alike); its top-k launch prefetches this device's shard of
        # the shared expert into L2 for the experts kernels (a hint; router.RouterTuning.prefetch_chunk_bytes).
        route = per_shard(route, (P(), P(), P()) + _EXPERT_SPECS[6:][:len(prefetch)], (P(), P()))
        specs = _EXPERT_SPECS if shared[0] is not None else _EXPERT_SPECS[:6] + (None, None, None)
        experts = per_shard(experts, specs, P(), sum_outputs=True)
    weights, ids = route(flat, p["router"], p["expert_bias"], *prefetch)
    # One device: the experts kernels add the residual themselves (at T = 1 in the down kernel's epilogue, no add
    # launch). Sharded, each device's output is a partial sum, so the residual is added once, after the psum.
    fused = residual is not None and tp_size() <= 1
    res = {"residual": residual.reshape(flat.shape)} if fused else {}
    y = experts(flat, weights, ids, p["we_gate"], p["we_up"], p["we_down"], *shared, **res).reshape(x.shape)
    return y + residual if residual is not None and not fused else y
