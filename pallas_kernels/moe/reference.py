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

FP8 (any expert matrix an OUT_IN `fp8.Fp8Weight`): the weight stays float32, `fp8.dequantize(w, jnp.float32)`
(q·scale, never rounded to the compute dtype), and its products are fp32 (the activations widened exactly,
precision HIGHEST) with fp32 sums; what follows each product (its rounding to the compute dtype, SwiGLU, the
combine) is the math above. The kernels compute the same values as sum over 128-blocks b of scale_b · sum_{i in b}
x_i·q_i, exact E4M3 values with the scale applied to each block's fp32 sum: equal up to fp32 rounding and
summation order. The gather path dequantises the gathered experts only (the same values, elementwise per expert);
the sorted path dequantises the whole stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import fp8

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


def _operands(x, w):
    """(x, w, precision) of one product: a float32 weight (an FP8 one dequantised, or the fp32 path's) with x widened
    exactly and HIGHEST precision (fp32 products); a bf16 one as it is (fp32-accumulated bf16 products)."""
    if jnp.dtype(w.dtype) == jnp.float32:
        return x.astype(jnp.float32), w, _HI
    return x, w, None


def _matmul(x, w, contract):
    """x [N, C] · w (w's axis `contract` has size C) -> [N, out] fp32, contracting w in place."""
    x, w, prec = _operands(x, w)
    return lax.dot_general(x, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=prec)


def _einsum(spec, x, w):
    x, w, prec = _operands(x, w)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32, precision=prec)


def _weight(w):
    """An Fp8Weight as its float32 weight (fp8.dequantize(w, jnp.float32)); a plain array as it is."""
    return fp8.dequantize(w, jnp.float32) if isinstance(w, fp8.Fp8Weight) else w


def _gathered(w, ids):
    """w[ids] (the selected experts' matrices); an Fp8Weight gathered with its scales, then dequantised (fp32)."""
    if not isinstance(w, fp8.Fp8Weight):
        return w[ids]
    return _weight(fp8.Fp8Weight(w.q[ids], w.scale[ids], w.layout, w.n_in))


def expert_mlp(x, w_gate, w_up, w_down, limit):
    """One SwiGLU expert (the shared one), gate/up [I, D], down [D, I] (plain or Fp8Weight): x [N, D] -> [N, D]
    compute dtype."""
    dt = x.dtype
    w_gate, w_up, w_down = (_weight(w) for w in (w_gate, w_up, w_down))
    g = _matmul(x, w_gate, 1).astype(dt)
    u = _matmul(x, w_up, 1).astype(dt)
    return _matmul(swiglu(g, u, limit), w_down, 1).astype(dt)


def _routed_gather(x, weights, ids, we_gate, we_up, we_down, limit):
    """Per (token, k): gather the expert's weights. [N, D] -> [N, D] fp32 (unrounded combine)."""
    dt = x.dtype
    wg, wu, wd = (_gathered(w, ids) for w in (we_gate, we_up, we_down))  # [N, K, I, D] x2, [N, K, D, I]
    g = _einsum("nd,nkid->nki", x, wg).astype(dt)
    u = _einsum("nd,nkid->nki", x, wu).astype(dt)
    h = swiglu(g, u, limit)
    out = _einsum("nki,nkdi->nkd", h, wd).astype(dt)
    return jnp.einsum("nk,nkd->nd", weights, out.astype(jnp.float32), precision=_HI)


# ragged_dot with rhs [G, out, in] (every expert matrix): lhs rows grouped along dim 0, rhs grouped along dim 0
# and contracted on its last dim (plain `lax.ragged_dot` wants [G, in, out], which would need a transposed copy of
# the stacked weights, 2-4 GB per layer at Flash size). On GPU this lowers to one chlo.ragged_dot with these
# dimension numbers (XLA picks the operand layouts); on CPU to a masked dense dot, as `lax.ragged_dot` does.
_RAGGED_OUT_IN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                               lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def _ragged_out_in(lhs, rhs, sizes):
    lhs, rhs, prec = _operands(lhs, rhs)
    return lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED_OUT_IN, precision=prec,
                                  preferred_element_type=jnp.float32)


def _routed_sorted(x, weights, ids, we_gate, we_up, we_down, limit):
    """Same math as `_routed_gather`, grouping (token, k) pairs by expert and using ragged dots (large N)."""
    dt = x.dtype
    n, k = ids.shape
    e = we_gate.shape[0]
    we_gate, we_up, we_down = (_weight(w) for w in (we_gate, we_up, we_down))
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[tok]  # [N·K, D]
    g = _ragged_out_in(xs, we_gate, sizes).astype(dt)
    u = _ragged_out_in(xs, we_up, sizes).astype(dt)
    h = swiglu(g, u, limit)
    out = _ragged_out_in(h, we_down, sizes).astype(dt)
    contrib = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    # Sum the K contributions per token in k order (scatter back to [N, K, D] first) so the fp32 sum matches
    # the gather path's order exactly.
    per_pair = jnp.zeros((n * k, x.shape[1]), jnp.float32).at[order].set(contrib).reshape(n, k, -1)
    return per_pair.sum(1)


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *,
                limit=0.0, shared_limit=0.0, path="auto"):
    """x [N, D] -> y [N, D] compute dtype; we_gate/we_up [E, I, D], we_down [E, D, I], ws_gate/ws_up [Is, D],
    ws_down [D, Is] (every matrix [out, in], as torch stores it; each a plain array or an OUT_IN Fp8Weight).
    `path`: "gather", "sorted" or "auto" (gather for small N·top_k)."""
    if path == "auto":
        path = "gather" if ids.size <= GATHER_MAX_PAIRS else "sorted"
    fn = {"gather": _routed_gather, "sorted": _routed_sorted}[path]
    routed = fn(x, weights.astype(jnp.float32), ids, we_gate, we_up, we_down, limit).astype(x.dtype)
    if ws_gate is None:
        return routed
    return routed + expert_mlp(x, ws_gate, ws_up, ws_down, shared_limit)
