"""Gated multi-head latent attention (docs/model.md §3.3).

Prefill expands the latents into per-head keys and values (the reference's eager attention). A later prefill
chunk ("extend") expands the whole latent cache the same way, so its queries see every earlier position and,
causally, their own chunk; the expansion covers the cache's static length L, not just start + T, a cost of
L·R·H·(Dn + Dv)·2 FLOPs per chunk (275 GFLOP per layer at L = 32768, ~10 % of that chunk-set's attention) that a
kernel reading the latent cache directly would remove. Decode and verify attend in the latent space
("absorbed"): q_nope is multiplied into W_uk so scores read the cached [c_kv | k_rope] rows directly, and the
attention output is lifted back through W_uv. Every mode writes the new latents into the cache at positions
[start, start + T).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.cache import MLACache
from ling_jax.config import LingConfig
from ling_jax.layers.linear import dense, proj
from ling_jax.layers.norms import rms_norm
from ling_jax.params import mla_qg_parts, mla_specs, param_axes

# q_a_layernorm and kv_a_layernorm keep their own eps whatever rms_norm_eps says (docs/model.md §3.3).
LATENT_NORM_EPS = 1e-6
from ling_jax.layers.rope import apply_rope, rope_cos_sin
from ling_jax.sharding import TP, per_shard
from pallas_kernels import mla as mla_ops

# Per shard of heads; the latent cache and the start position are the same on every device.
_Q = P(None, None, TP, None)


def _queries_and_gate(p: dict, h: jnp.ndarray, norm: tuple, cfg: LingConfig, axes: dict, gemv: str):
    """-> (q [B, T, H, Dn + P], gate logits [B, T, H])."""
    if cfg.q_lora_rank is None:
        qg = dense(h, p["w_qg"], axes["w_qg"], backend=gemv, norm=norm)
        width = mla_qg_parts(cfg)["q"]
        return qg[..., :width], qg[..., width]
    x = rms_norm(h, *norm)
    q_a = rms_norm(proj("btd,dr->btr", x, p["w_q_a"]), p["q_a_norm"], LATENT_NORM_EPS)
    return proj("btr,rhe->bthe", q_a, p["w_q_b"]), proj("btd,dh->bth", x, p["w_gate"])


def mla_block(p: dict, h: jnp.ndarray, norm: tuple, cache: MLACache, start: jax.Array, cfg: LingConfig, *,
              mode: str, backend: str, gemv: str, residual: jnp.ndarray | None = None):
    """The block's input h [B, T, D] (normalised by `norm`, (weight, eps)), tokens at positions start..start+T-1
    -> (residual + out [B, T, D], MLACache with them written); `gemv`: the projections' backend (linear.dense)."""
    B, T, _ = h.shape
    x_dtype = h.dtype
    axes = param_axes(mla_specs(cfg))
    R, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    positions = start + jnp.arange(T, dtype=jnp.int32)[None, :]  # [1, T]
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, x_dtype)

    q, gate_logits = _queries_and_gate(p, h, norm, cfg, axes, gemv)
    q_nope, q_rope = q[..., :Dn], apply_rope(q[..., Dn:], cos, sin)
    latent = dense(h, p["w_kv_a"], axes["w_kv_a"], backend=gemv, norm=norm)  # [B, T, R + P]
    c_kv = rms_norm(latent[..., :R], p["kv_a_norm"], LATENT_NORM_EPS)
    k_rope = apply_rope(latent[..., R:], cos, sin)  # [B, T, P], shared by all heads
    kv = jax.lax.dynamic_update_slice(cache.kv, jnp.concatenate([c_kv, k_rope], -1).astype(cache.kv.dtype),
                                      (0, start, 0))
    scale = cfg.qk_head_dim ** -0.5

    if mode in ("prefill", "extend"):
        # A first chunk attends among its own tokens; a later one over the whole cache, masked past its end.
        if mode == "prefill":
            c_all, r_all = c_kv, k_rope
        else:
            c_all, r_all = kv[..., :R].astype(x_dtype), kv[..., R:].astype(x_dtype)
        k_nope = proj("btr,rhn->bthn", c_all, p["w_k_b"])
        v = proj("btr,rhv->bthv", c_all, p["w_v_b"])
        k = jnp.concatenate([k_nope, jnp.broadcast_to(r_all[:, :, None, :], (*k_nope.shape[:3], r_all.shape[-1]))],
                            axis=-1)
        attend = functools.partial(mla_ops.mla_prefill_attention, scale=scale, backend=backend)
        if backend == "pallas":
            attend = per_shard(attend, (_Q, _Q, _Q, P()), _Q)
        o = attend(jnp.concatenate([q_nope, q_rope], -1), k, v, start if mode == "extend" else jnp.int32(0))
    else:
        q_latent = proj("bthn,rhn->bthr", q_nope, p["w_k_b"], out_dtype=jnp.float32)
        attend = functools.partial(mla_ops.mla_decode_attention, scale=scale, backend=backend)
        if backend == "pallas":
            attend = per_shard(attend, (_Q, _Q, P(), P()), _Q)
        o_latent = attend(q_latent, q_rope, kv, start)
        # Round the latent output to the compute dtype (as the expanded path rounds its probabilities) rather
        # than casting W_uv up to fp32 on every step.
        o = proj("bthr,rhv->bthv", o_latent.astype(x_dtype), p["w_v_b"])

    gate = jax.nn.sigmoid(gate_logits.astype(jnp.float32)).astype(x_dtype)
    o = o * gate[..., None]
    return dense(o, p["w_o"], axes["w_o"], n_in=2, backend=gemv, residual=residual), MLACache(kv)
