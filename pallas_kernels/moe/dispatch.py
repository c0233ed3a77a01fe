"""Public MoE entry points: validate shapes and dtypes, then run the chosen backend (never a silent fallback).

`backend="reference"` runs `reference.py` (pure jnp). `backend="pallas"` runs the Pallas-Triton kernels (compiled
on a GPU, interpreted on CPU): `router.py` for routing; for the experts `experts.py` up to experts.MAX_TOKENS tokens
(decode, verify: each selected expert read once) and `grouped.py` beyond (prefill: a grouped GEMM over the pairs
sorted by expert).

FP8 experts: every expert matrix of `moe_experts` (routed and shared, each on its own) may be an `fp8.Fp8Weight` of
layout OUT_IN (E4M3 q of the matrix's shape, the checkpoint's float32 128x128 block scales); x stays in the compute
dtype. Both backends keep the weight in float32 (`fp8.dequantize(w, jnp.float32)`, never rounded to the compute
dtype) and take its products in fp32: the reference by fp32 matmuls, the Pallas kernels as the exact E4M3 values'
fp32 sums per 128-block times the block's scale.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import COMPUTE_DTYPES, check_backend, check_dtype, check_rank, check_shape, fp8
from pallas_kernels.gemv import reference as gemv_reference
from pallas_kernels.moe import reference


def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True,
          backend="reference", prefetch=(), norm=None):
    """Grouped top-k sigmoid router (docs/model.md §3.5 steps 1-7).

    Args:
      x: [N, D] compute dtype (float32 or bfloat16).
      router: [E, D] float32 or bfloat16 (torch's [out, in]: the checkpoint's `mlp.gate.weight` as it is, in its
        stored dtype); the logits are fp32 sums of fp32 products either way (a bf16 weight widens exactly).
      expert_bias: [E] float32; added to the sigmoid scores for selection only.
      n_group, topk_group, top_k: E splits into n_group equal groups; the best topk_group groups (by the sum of
        their top-2 biased scores) are kept and top_k experts are chosen among them. Ties go to the lower index.
      routed_scaling_factor: multiplies the (renormalised) weights.
      norm_topk_prob: renormalise the selected unbiased scores to sum to 1 (eps 1e-20).
      backend: "reference" | "pallas".
      prefetch: arrays the caller reads right after routing (the shared expert's gate, up, down). With
        backend="pallas" and a tuning that prefetches (the defaults up to 16 tokens), the top-k launch hands their
        bytes to L2 while it computes (pallas_kernels/common/prefetch.py). A performance hint only: no result
        depends on it, and the reference backend has nothing to overlap it with, so it does not read them.
      norm: None, or (weight [D] float, eps: a Python float): x is the block's input before its RMSNorm, routed as
        `rms_norm(x, weight, eps)` (the model's roundings), which comes back as a third result for the experts. On
        Pallas the router's GEMV norms x in its prologue and its first expert block writes the normed x, so the norm
        takes no launch of its own; its sums of squares are left to XLA, which fuses them into x's producer.
    Returns:
      weights [N, top_k] float32, ids [N, top_k] int32 (and the normed x [N, D] with `norm`).
    """
    check_backend(backend)
    check_rank("x", x, 2, "[N, D]")
    check_dtype("x", x, COMPUTE_DTYPES)
    n, d = x.shape
    check_rank("router", router, 2, "[E, D]")
    if router.shape[1] != d:
        hint = " (a [D, E] router from before: pass router.T)" if router.shape[0] == d else ""
        raise ValueError(f"router.shape={tuple(router.shape)} must be [E, D] (torch's [out, in], the checkpoint's "
                         f"mlp.gate.weight as it is) with D = x.shape[1] = {d}{hint}")
    check_dtype("router", router, (jnp.float32, jnp.bfloat16))
    e = router.shape[0]
    check_shape("expert_bias", expert_bias, (e,), "[E]")
    check_dtype("expert_bias", expert_bias, (jnp.float32,))
    if n_group < 1 or e % n_group:
        raise ValueError(f"{n_group=} must divide the number of experts E={e}")
    if e // n_group < 2:
        raise ValueError(f"group size E/n_group={e // n_group} must be >= 2 (group score = sum of the top-2)")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{topk_group=} must be in [1, {n_group=}]")
    if not 1 <= top_k <= topk_group * (e // n_group):
        raise ValueError(f"{top_k=} must be in [1, topk_group·E/n_group = {topk_group * (e // n_group)}]")
    prefetch = tuple(prefetch)
    for j, a in enumerate(prefetch):
        if isinstance(a, fp8.Fp8Weight):
            raise ValueError(f"prefetch[{j}] is an Fp8Weight; pass its values (w.q: the scales are 3 % of the bytes)")
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise ValueError(f"prefetch[{j}] is {type(a).__name__}; it must be an array (e.g. the shared expert's "
                             "ws_gate, ws_up, ws_down)")
        if (a.size * jnp.dtype(a.dtype).itemsize) % 16:
            raise ValueError(f"prefetch[{j}] shape {tuple(a.shape)} {a.dtype} is not a multiple of 16 bytes, which an "
                             "L2 bulk prefetch needs; leave it out of `prefetch`")
    if norm is not None:
        _check_norm(norm, d)
    kw = dict(n_group=n_group, topk_group=topk_group, top_k=top_k, routed_scaling_factor=routed_scaling_factor,
              norm_topk_prob=norm_topk_prob)
    if backend == "reference":
        if norm is None:
            return reference.route(x, router, expert_bias, **kw)
        xn = gemv_reference.rms_norm(x, *norm)
        return (*reference.route(xn, router, expert_bias, **kw), xn)
    from pallas_kernels.moe import router as router_kernel

    norm_kw = {} if norm is None else dict(norm_weight=norm[0], eps=float(norm[1]))
    return router_kernel.route(x, router, expert_bias, **kw, prefetch=prefetch, **norm_kw)


def _check_norm(norm, d):
    if not isinstance(norm, tuple) or len(norm) != 2:
        raise ValueError(f"norm (a {type(norm).__name__} of length {len(norm) if isinstance(norm, tuple) else '-'}) "
                         "must be None or a pair (weight [D], eps)")
    weight, eps = norm
    check_shape("norm[0]", weight, (d,), "[D]")
    check_dtype("norm[0]", weight, (jnp.float32, jnp.bfloat16))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"norm eps={eps!r} must be a static Python float > 0")


def _check_down(name, w, want, names):
    """Down projections are [.., D, I] (torch's [out, in]); name the layout change for an [.., I, D] array (when
    I = D the two cannot be told apart by shape)."""
    swapped = tuple(want[:-2]) + tuple(want[-2:][::-1])
    if tuple(w.shape) == swapped and swapped != tuple(want):
        fix = ("swap the last two axes of its q and of its scale" if isinstance(w, fp8.Fp8Weight) else
               "swap its last two axes (jnp.swapaxes(w, -1, -2))")
        raise ValueError(f"{name}.shape={tuple(w.shape)} must be {names} = {tuple(want)} (torch's [out, in]); it looks "
                         f"like the [.., I, D] down layout of an older ling-jax checkpoint: {fix}, or convert the "
                         f"checkpoint again")
    check_shape(name, w, want, names)


def _check_matrix(name, w, want, names, dtype, down=False):
    """One expert matrix: a plain array of shape `want` in the compute dtype, or an Fp8Weight of layout OUT_IN whose
    q has that shape (E4M3) and whose scale is float32 [.., ceil(out/128), ceil(in/128)]."""
    is_fp8 = isinstance(w, fp8.Fp8Weight)
    if is_fp8 and w.layout != fp8.OUT_IN:
        raise ValueError(f"{name} is an Fp8Weight of layout {w.layout!r}; the expert matrices need {fp8.OUT_IN!r} "
                         f"(q [.., out, in] as torch stores it, the checkpoint's 128x128 block scales): "
                         f"fp8.quantize(w, fp8.OUT_IN), or the checkpoint's weight and weight_scale_inv as they are")
    (_check_down if down else check_shape)(name, w, want, names)
    if is_fp8:
        fp8.check_fp8(name, w, fp8.OUT_IN)
    elif jnp.dtype(w.dtype) == fp8.FP8_DTYPE:
        raise ValueError(f"{name}.dtype={fp8.FP8_DTYPE} is a bare E4M3 array: pass it with its block scales as "
                         f"fp8.Fp8Weight(q, scale, fp8.OUT_IN)")
    else:
        check_dtype(name, w, (dtype,))


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, backend="reference", residual=None):
    """Routed SwiGLU experts with weighted combine, plus the optional shared expert (docs/model.md §3.5).

    Args:
      x: [N, D] compute dtype (float32 or bfloat16).
      weights: [N, K] float32 routing weights; ids: [N, K] int32 expert ids in [0, E).
      we_gate, we_up: [E, I, D]; we_down: [E, D, I]; compute dtype (every expert matrix [out, in], as torch stores
        it: ling_jax/params.py), or each an fp8.Fp8Weight of layout OUT_IN: q that shape in float8_e4m3fn, scale
        float32 [E, ceil(out/128), ceil(in/128)] (the checkpoint's weight_scale_inv), computed with the float32
        weight fp8.dequantize(w, jnp.float32) and fp32 products (each product's fp32 result then rounded to the
        compute dtype as for a plain weight).
      ws_gate, ws_up: [Is, D]; ws_down: [D, Is]; compute dtype or Fp8Weight (same convention, scale
        [ceil(out/128), ceil(in/128)]); all three or none. Plain and FP8 matrices may be mixed.
      limit, shared_limit: static floats, 0 = no clamp; else act = min(silu(g), L) · clip(u, -L, L).
      backend: "reference" | "pallas". Pallas: N <= experts.MAX_TOKENS runs the decode/verify kernels
        (experts.py), larger N the grouped GEMM (grouped.py).
      residual: optional [N, D] in the compute dtype, added last (a pre-norm block's h + MoE(x)). The Pallas T = 1
        down kernel adds it in its epilogue, saving the separate add launch.
    Returns:
      y [N, D] in the compute dtype: fp32 combine of the routed experts rounded once, plus the shared expert (plus
      `residual`, in the compute dtype).
    """
    check_backend(backend)
    check_rank("x", x, 2, "[N, D]")
    check_dtype("x", x, COMPUTE_DTYPES)
    n, d = x.shape
    check_rank("ids", ids, 2, "[N, K]")
    if ids.shape[0] != n:
        raise ValueError(f"ids.shape={tuple(ids.shape)} must be [N, K] with N = x.shape[0] = {n}")
    check_dtype("ids", ids, (jnp.int32,))
    k = ids.shape[1]
    check_shape("weights", weights, (n, k), "[N, K]")
    check_dtype("weights", weights, (jnp.float32,))
    check_rank("we_gate", we_gate, 3, "[E, I, D]")
    e, i, _ = we_gate.shape
    _check_matrix("we_gate", we_gate, (e, i, d), "[E, I, D]", x.dtype)
    _check_matrix("we_up", we_up, (e, i, d), "[E, I, D]", x.dtype)
    _check_matrix("we_down", we_down, (e, d, i), "[E, D, I]", x.dtype, down=True)
    shared = (ws_gate, ws_up, ws_down)
    if any(w is None for w in shared) and not all(w is None for w in shared):
        raise ValueError("ws_gate, ws_up and ws_down must be given together (all three or none)")
    if ws_gate is not None:
        check_rank("ws_gate", ws_gate, 2, "[Is, D]")
        i_s = ws_gate.shape[0]
        _check_matrix("ws_gate", ws_gate, (i_s, d), "[Is, D]", x.dtype)
        _check_matrix("ws_up", ws_up, (i_s, d), "[Is, D]", x.dtype)
        _check_matrix("ws_down", ws_down, (d, i_s), "[D, Is]", x.dtype, down=True)
    for name, lim in (("limit", limit), ("shared_limit", shared_limit)):
        if not isinstance(lim, (int, float)) or lim < 0:
            raise ValueError(f"{name}={lim!r} must be a static Python float >= 0 (0 = no clamp)")
    limit, shared_limit = float(limit), float(shared_limit)
    if residual is not None:
        check_shape("residual", residual, (n, d), "[N, D]")
        check_dtype("residual", residual, (x.dtype,))
    if backend == "reference":
        y = reference.moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down,
                                  limit=limit, shared_limit=shared_limit)
        return y if residual is None else residual + y
    from pallas_kernels.moe import experts as experts_kernel

    if n > experts_kernel.MAX_TOKENS:
        from pallas_kernels.moe import grouped

        return grouped.moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                                   shared_limit=shared_limit, residual=residual)
    return experts_kernel.moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down,
                                      limit=limit, shared_limit=shared_limit, residual=residual)
