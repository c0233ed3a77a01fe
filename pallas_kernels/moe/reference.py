"""Pure-jnp MoE router and experts: the specification the Pallas kernels are tested against (docs/model.md §3.5).

Router (`route`): fp32 GEMV over the router [E, D] (torch's [out, in], contracted in place; a bf16-stored router
widened exactly), sigmoid, `expert_bias` for selection only, grouped top-k (sum of the top-2 biased scores per
group, best `topk_group` groups, then `top_k` experts among them; ties toward the lower index, which is what
`lax.top_k` does), weights from the unbiased scores, renormalised (eps 1e-20) and scaled.

Experts (`moe_experts`): SwiGLU MLP per selected expert in the compute dtype (fp32-accumulated matmuls rounded to
the compute dtype), the optional post-SiLU clamp min(silu(g), L) * clip(u, -L, L) (SGLang's `BailingMLP` form),
fp32 weighted combine rounded once, plus the shared expert (no routing weight) added in the compute dtype.
Every expert matrix is [out, in] as torch stores it (ling_jax/params.py: gate/up [.., I, D], down [.., D, I]): each
product below contracts the input axis in place (einsum / dot_general / ragged_dot_general), so no transposed copy
of the stacked weights is made.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Above this many (token, expert) pairs the gather path would materialise too many expert weights
# (each pair copies 3·D·I values); the sorted ragged_dot path computes the same math without the copies.
GATHER_MAX_PAIRS = 256

_HI = lax.Precision.HIGHEST


def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True):
    """x [N, D], router [E, D] fp32 or bf16 ([out, in]), expert_bias [E] fp32 -> (weights [N, top_k] fp32,
    ids [N, top_k] int32)."""
    # [N, E] = x·routerᵀ, contracting the router's D axis in place (no transposed copy).
    logits = lax.dot_general(x.astype(jnp.float32), router.astype(jnp.float32), (((1,), (1,)), ((), ())),
                             precision=_HI)
    s = jax.nn.sigmoid(logits)
    choice = s + expert_bias.astype(jnp.float32)[None, :]
    n, e = choice.shape
    group_scores = lax.top_k(choice.reshape(n, n_group, e // n_group), 2)[0].sum(-1)  # [N, G]
    _, top_groups = lax.top_k(group_scores, topk_group)  # [N, topk_group]
    group_keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    expert_keep = jnp.repeat(group_keep, e // n_group, axis=1)  # [N, E]
    masked = jnp.where(expert_keep, choice, -jnp.inf)
    _, ids = lax.top_k(masked, top_k)  # [N, top_k]
    w = jnp.take_along_axis(s, ids, axis=1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return (w * routed_scaling_factor).astype(jnp.float32), ids.astype(jnp.int32)


def swiglu(g, u, limit):
    """g, u in the compute dtype -> act in the compute dtype. SiLU in fp32, rounded, then the product rounded."""
    dt = g.dtype
    sg = jax.nn.silu(g.astype(jnp.float32)).astype(dt)
    if limit:
        sg = jnp.minimum(sg, jnp.asarray(limit, dt))
        u = jnp.clip(u, jnp.asarray(-limit, dt), jnp.asarray(limit, dt))
    return sg * u


def _matmul(x, w, contract, prec):
    """x [N, C] · w (w's axis `contract` has size C) -> [N, out] fp32, contracting w in place."""
    return lax.dot_general(x, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=prec)


def expert_mlp(x, w_gate, w_up, w_down, limit):
    """One SwiGLU expert (the shared one), gate/up [I, D], down [D, I]: x [N, D] -> [N, D] compute dtype."""
    dt = x.dtype
    prec = _HI if dt == jnp.float32 else None
    g = _matmul(x, w_gate, 1, prec).astype(dt)
    u = _matmul(x, w_up, 1, prec).astype(dt)
    return _matmul(swiglu(g, u, limit), w_down, 1, prec).astype(dt)


def _routed_gather(x, weights, ids, we_gate, we_up, we_down, limit):
    """Per (token, k): gather the expert's weights. [N, D] -> [N, D] fp32 (unrounded combine)."""
    dt = x.dtype
    prec = _HI if dt == jnp.float32 else None
    wg, wu, wd = we_gate[ids], we_up[ids], we_down[ids]  # [N, K, I, D], [N, K, I, D], [N, K, D, I]
    g = jnp.einsum("nd,nkid->nki", x, wg, preferred_element_type=jnp.float32, precision=prec).astype(dt)
    u = jnp.einsum("nd,nkid->nki", x, wu, preferred_element_type=jnp.float32, precision=prec).astype(dt)
    h = swiglu(g, u, limit)
    out = jnp.einsum("nki,nkdi->nkd", h, wd, preferred_element_type=jnp.float32, precision=prec).astype(dt)
    return jnp.einsum("nk,nkd->nd", weights, out.astype(jnp.float32), precision=_HI)


# ragged_dot with rhs [G, out, in] (every expert matrix): lhs rows grouped along dim 0, rhs grouped along dim 0
# and contracted on its last dim (plain `lax.ragged_dot` wants [G, in, out], which would need a transposed copy of
# the stacked weights, 2-4 GB per layer at Flash size). On GPU this lowers to one chlo.ragged_dot with these
# dimension numbers (XLA picks the operand layouts); on CPU to a masked dense dot, as `lax.ragged_dot` does.
_RAGGED_OUT_IN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                               lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def _ragged_out_in(lhs, rhs, sizes, prec):
    return lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED_OUT_IN, precision=prec,
                                  preferred_element_type=jnp.float32)


def _routed_sorted(x, weights, ids, we_gate, we_up, we_down, limit):
    """Same math as `_routed_gather`, grouping (token, k) pairs by expert and using ragged dots (large N)."""
    dt = x.dtype
    n, k = ids.shape
    e = we_gate.shape[0]
    prec = _HI if dt == jnp.float32 else None
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[tok]  # [N·K, D]
    g = _ragged_out_in(xs, we_gate, sizes, prec).astype(dt)
    u = _ragged_out_in(xs, we_up, sizes, prec).astype(dt)
    h = swiglu(g, u, limit)
    out = _ragged_out_in(h, we_down, sizes, prec).astype(dt)
    contrib = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    # Sum the K contributions per token in k order (scatter back to [N, K, D] first) so the fp32 sum matches
    # the gather path's order exactly.
    per_pair = jnp.zeros((n * k, x.shape[1]), jnp.float32).at[order].set(contrib).reshape(n, k, -1)
    return per_pair.sum(1)


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *,
                limit=0.0, shared_limit=0.0, path="auto"):
    """x [N, D] -> y [N, D] compute dtype; we_gate/we_up [E, I, D], we_down [E, D, I], ws_gate/ws_up [Is, D],
    ws_down [D, Is] (every matrix [out, in], as torch stores it).
    `path`: "gather", "sorted" or "auto" (gather for small N·top_k)."""
    if path == "auto":
        path = "gather" if ids.size <= GATHER_MAX_PAIRS else "sorted"
    fn = {"gather": _routed_gather, "sorted": _routed_sorted}[path]
    routed = fn(x, weights.astype(jnp.float32), ids, we_gate, we_up, we_down, limit).astype(x.dtype)
    if ws_gate is None:
        return routed
    return routed + expert_mlp(x, ws_gate, ws_up, ws_down, shared_limit)
