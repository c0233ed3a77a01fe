"""MoE FFN (docs/model.md §3.5): sigmoid router with grouped top-k, routed experts + shared expert, per-layer clamps."""

import functools

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.config import LingConfig
from ling_jax.params import is_fp8, moe_specs
from ling_jax.sharding import logical_to_spec, per_shard, tp_size
from pallas_kernels import moe as moe_ops
from pallas_kernels.common.fp8 import Fp8Weight

_ROUTED = ("we_gate", "we_up", "we_down")
_SHARED = ("ws_gate", "ws_up", "ws_down")


def _partition_specs(cfg: LingConfig, names) -> tuple:
    """The shard_map specs of the MoE params `names`, from their declared logical axes (ling_jax/params.py), so a
    Pallas call sees the same shards as the params' shardings."""
    specs = moe_specs(cfg)

    def one(s):
        if is_fp8(s):
            return Fp8Weight(logical_to_spec(s.q.axes), logical_to_spec(s.scale.axes), s.layout, s.n_in)
        return logical_to_spec(s.axes)
    return tuple(one(specs[name]) for name in names)


def moe_block(p: dict, h: jnp.ndarray, norm: tuple, cfg: LingConfig, layer: int, *, backend: str,
              residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """The FFN of the block input h [..., D] normed by `norm` (weight, eps) -> [..., D] (+ `residual` [..., D], the
    block's h); `layer` picks the SwiGLU clamp limits (MTP layers index past num_layers). The router norms h (on
    Pallas in its GEMV's prologue, no launch of its own) and hands the normed x to the experts."""
    flat = h.reshape(-1, h.shape[-1])
    eps = norm[1]

    def route(x, router, bias, norm_weight, *prefetch):
        return moe_ops.route(x, router, bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                             top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
                             norm_topk_prob=cfg.norm_topk_prob, backend=backend, prefetch=prefetch,
                             norm=(norm_weight, eps))

    limit, shared_limit = cfg.swiglu_limits(layer)
    experts = functools.partial(moe_ops.moe_experts, limit=limit, shared_limit=shared_limit, backend=backend)
    shared_names = _SHARED if "ws_gate" in p else ()
    shared = tuple(p[name] for name in shared_names)
    # The router's L2 prefetch hint takes arrays: an FP8 shared expert's values (its scales are 3 % of them).
    prefetch = tuple(w.q if isinstance(w, Fp8Weight) else w for w in shared)
    if backend == "pallas":
        # Routing is replicated (every device routes alike); its top-k launch prefetches this device's shard of
        # the shared expert into L2 for the experts kernels (a hint; router.RouterTuning.prefetch_chunk_bytes).
        route = per_shard(route, (P(),) + _partition_specs(cfg, ("router", "expert_bias")) + (P(),) + tuple(
            s.q if isinstance(s, Fp8Weight) else s for s in _partition_specs(cfg, shared_names)), (P(), P(), P()))
        experts = per_shard(experts, (P(), P(), P()) + _partition_specs(cfg, _ROUTED + shared_names), P(),
                            sum_outputs=True)
    weights, ids, x = route(flat, p["router"], p["expert_bias"], norm[0], *prefetch)
    # One token on one device: the Pallas down kernel adds the residual in its epilogue (no add launch). Sharded,
    # each device's output is a partial sum, so the residual is added once, after the psum. Elsewhere XLA adds it in
    # h's own shape: a residual stream reshaped to [N, D] and back in every layer chains bitcasts through fusions
    # that XLA's CPU tiling expands exponentially (the toy's verify step compiles in 2 s, against over 5 minutes).
    fused = residual is not None and tp_size() <= 1 and backend == "pallas" and flat.shape[0] == 1
    res = {"residual": residual.reshape(flat.shape)} if fused else {}
    y = experts(x, weights, ids, *(p[name] for name in _ROUTED), *shared, **res).reshape(h.shape)
    return y + residual if residual is not None and not fused else y
