"""Projections with the reference numerics: accumulate in float32, round the output to the compute dtype once.

`proj` is the einsum every mode can run (XLA's GEMM or GEMV). `dense` runs the same product through
`pallas_kernels.gemv` when the `gemv` op runs Pallas and the step has at most `GEMV_MAX_TOKENS` tokens (decode,
verify, a short prompt), with the block's RMSNorm as the kernel's prologue and the residual add as its epilogue: one
Pallas launch, plus an XLA fusion summing fp32 partials where the tuning splits K. Under tensor parallelism the kernel runs per shard (`per_shard`), its specs derived from the
weight's logical axes: column-parallel weights (heads or vocab on an output axis) give sharded outputs, row-parallel
ones (heads or ffn on an input axis) partial sums added across devices before the residual.

Block-FP8 weights (`Fp8Weight`, pallas_kernels/common/fp8.py) go through both: `proj` dequantises to the compute
dtype (prefill's XLA GEMMs, the reference backend: bf16 tensor cores), the GEMV kernel keeps the dequantised weight
in fp32, scaling each 128-row block's partial sum by its scale (docs/model.md §4).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.layers.norms import rms_norm
from ling_jax.params import scale_axes
from ling_jax.sharding import RULES, TP, logical_to_spec, per_shard, tp_size
from pallas_kernels.common.fp8 import Fp8Weight, dequantize
from pallas_kernels.gemv.kernel import MAX_TOKENS as GEMV_MAX_TOKENS  # the kernel's token limit: one 16-row dot


def proj(eq: str, x: jnp.ndarray, w: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """einsum(eq, x, w) with fp32 accumulation, rounded to `out_dtype` (default: x's dtype).

    torch's bf16 matmul accumulates in fp32 and rounds once, so this matches it to the rounding of the sum.
    `w` is cast to x's dtype first (fp32-class weights such as the router keep their own path); a block-FP8 weight is
    dequantised to it.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jnp.einsum(eq, x, dequantize(w, x.dtype), preferred_element_type=jnp.float32,
                   precision="highest")
    return y.astype(out_dtype)


def uses_gemv(backend: str, n_tokens: int) -> bool:
    """Whether `dense` runs the Pallas GEMV for a step of n_tokens (batch x positions)."""
    return backend == "pallas" and n_tokens <= GEMV_MAX_TOKENS


def dense(x: jnp.ndarray, w: jnp.ndarray, axes: tuple, *, n_in: int = 1, backend: str = "reference",
          norm: tuple | None = None, residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """x [..., *in] · w [*in, *out] -> [..., *out] in x's dtype, as `proj`; the first n_in axes of w are inputs.

    `axes`: w's logical axes (ling_jax/params.py), which place the kernel's shards. `norm` (weight, eps): x is
    `rms_norm(x, weight, eps)` first. `residual` [..., *out]: added after the rounding, as a block's h + proj(x).
    """
    lead = x.shape[:x.ndim - n_in]
    if not uses_gemv(backend, math.prod(lead)):
        xn = x if norm is None else rms_norm(x, norm[0], norm[1])
        letters = "abcdefghijklmnopqrstuvwxyz"
        xs, ws = letters[:xn.ndim], letters[len(lead):xn.ndim + w.ndim - n_in]
        y = proj(f"{xs},{ws}->{xs[:len(lead)]}{ws[n_in:]}", xn, w)
        return y if residual is None else residual + y
    return _dense_gemv(x, w, tuple(axes), n_in, lead, norm, residual)


def _dense_gemv(x, w, axes, n_in, lead, norm, residual):
    from pallas_kernels.gemv import gemv

    row_parallel = tp_size() > 1 and any(RULES.get(a) for a in axes[:n_in] if a is not None)
    if row_parallel and norm is not None:
        raise ValueError(f"dense: a norm prologue needs the whole input row, but w's input axes {axes[:n_in]} are "
                         "split over devices; normalise first")
    none = (None,) * len(lead)
    out_spec = logical_to_spec(none + axes[n_in:])
    # Sharded row-parallel outputs are partial sums: the residual is added once, after the sum.
    fused_residual = None if row_parallel else residual
    extras = ([(norm[0], P())] if norm is not None else []) + (
        [(fused_residual, out_spec)] if fused_residual is not None else [])

    def run(x, w, *extra):
        it = iter(extra)
        nrm = (next(it), norm[1]) if norm is not None else None
        res = next(it).reshape(math.prod(lead), -1) if fused_residual is not None else None
        y = gemv(x.reshape(math.prod(lead), -1), _as_matrix(w, n_in), res, norm=nrm, backend="pallas")
        return y.reshape(lead + w.shape[n_in:])

    w_spec = logical_to_spec(axes)
    if isinstance(w, Fp8Weight):
        w_spec = Fp8Weight(w_spec, logical_to_spec(scale_axes(axes, w.layout, w.n_in)), w.layout, w.n_in)
    specs = (logical_to_spec(none + axes[:n_in]), w_spec) + tuple(s for _, s in extras)
    y = per_shard(run, specs, out_spec, sum_outputs=row_parallel)(x, w, *(a for a, _ in extras))
    return y + residual if row_parallel and residual is not None else y


def _as_matrix(w, n_in: int):
    """w [*in, *out] -> [In, Out] (free on the contiguous array); an FP8 weight's scale [ceil(In/128), Out]."""
    rows = math.prod(w.shape[:n_in])
    if not isinstance(w, Fp8Weight):
        return w.reshape(rows, -1)
    return Fp8Weight(w.q.reshape(rows, -1), w.scale.reshape(w.scale.shape[0], -1), w.layout, 1)


def dense_argmax(x: jnp.ndarray, w: jnp.ndarray, axes: tuple, *, norm: tuple) -> jnp.ndarray:
    """argmax over the output axis of rms_norm(x)·w (the logits rounded to x's dtype, as `proj` rounds them), by the
    Pallas greedy head: x [..., D], w [D, V] -> int32 [...], the lowest index among equal maxima (`jnp.argmax`).

    Vocabulary-split (w's output axis sharded): each device picks in its columns, then one all-gather of a
    (max, index) pair per token and device chooses the first device holding the largest, so the pick is still the
    lowest index overall; no logits leave the kernel.
    """
    from pallas_kernels.gemv import greedy_head

    lead = x.shape[:-1]
    split = tp_size() > 1 and RULES.get(axes[-1]) is not None

    def run(x, w, norm_w):
        ids, best = greedy_head(x.reshape(-1, x.shape[-1]), w, norm=(norm_w, norm[1]), backend="pallas")
        if not split:
            return ids.reshape(lead)
        ids = ids + jax.lax.axis_index(TP) * w.shape[-1]
        all_ids, all_best = jax.lax.all_gather(ids, TP), jax.lax.all_gather(best, TP)  # [n, tokens]
        shard = jnp.argmax(all_best, axis=0)  # the first device with the maximum (NaN first, as jnp.argmax)
        return jnp.take_along_axis(all_ids, shard[None], axis=0)[0].reshape(lead)

    specs = (logical_to_spec((None,) * len(lead) + (None,)), logical_to_spec(axes), P())
    return per_shard(run, specs, P())(x, w, norm[0])
