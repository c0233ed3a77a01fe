"""Projections with the reference numerics: accumulate in float32, round the output to the compute dtype once.

`proj` is the einsum every mode can run (XLA's GEMM or GEMV). `dense` runs the same product through
`pallas_kernels.gemv` when the `gemv` op runs Pallas and the step has at most `GEMV_MAX_TOKENS` tokens (decode,
verify, a short prompt), with the block's RMSNorm as the kernel's prologue and the residual add as its epilogue: one
Pallas launch, plus an XLA fusion summing fp32 partials where the tuning splits K. Under tensor parallelism the kernel runs per shard (`per_shard`), its specs derived from the
weight's logical axes: column-parallel weights (heads or vocab on an output axis) give sharded outputs, row-parallel
ones (heads or ffn on an input axis) partial sums added across devices before the residual.

Block-FP8 weights (`Fp8Weight`, pallas_kernels/common/fp8.py) are stored ROWS, [*out, *in] (ling_jax/params.py),
and go through both: `proj` takes every weight as the [*in, *out] matrix `fp8.as_in_out` makes, dequantised to
the compute dtype (prefill's XLA GEMMs, the reference backend: bf16 tensor cores); the GEMV kernel
(pallas_kernels/gemv/rows.py) keeps the dequantised weight in fp32, scaling each output row's partial sum over a
128-column block by its scale (docs/model.md §4). The gemv op's "w8a8" choice (`--fp8-activations`) runs them
through pallas_kernels/gemv/w8a8.py instead: the activations quantised per token and 128 columns to E4M3, SGLang's
recipe, ~2.5e-2 from the weight-only numerics per projection. A weight's logical axes are in its stored order, so
the input axes that decide row parallelism are the last n_in of a ROWS weight and the first n_in of any other.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.backends import W8A8
from ling_jax.layers.norms import rms_norm
from ling_jax.params import scale_axes
from ling_jax.sharding import RULES, TP, logical_to_spec, per_shard, tp_size
from pallas_kernels.common.fp8 import ROWS, Fp8Weight, as_in_out
from pallas_kernels.common.norm import GroupRMS
from pallas_kernels.gemv.kernel import MAX_TOKENS as GEMV_MAX_TOKENS  # the kernel's token limit: one 16-row dot


def proj(eq: str, x: jnp.ndarray, w: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """einsum(eq, x, w) with fp32 accumulation, rounded to `out_dtype` (default: x's dtype).

    torch's bf16 matmul accumulates in fp32 and rounds once, so this matches it to the rounding of the sum.
    `eq` names w's axes as [*in, *out]. `w` is cast to x's dtype first (fp32-class weights such as the router keep
    their own path); a block-FP8 weight is dequantised to it, in that order of axes whatever its layout.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jnp.einsum(eq, x, as_in_out(w, x.dtype), preferred_element_type=jnp.float32,
                   precision="highest")
    return y.astype(out_dtype)


def uses_gemv(backend: str, n_tokens: int) -> bool:
    """Whether `dense` runs a Pallas GEMV ("pallas", or "w8a8" for FP8 weights) for a step of n_tokens (batch x
    positions)."""
    return backend in ("pallas", W8A8) and n_tokens <= GEMV_MAX_TOKENS


def dense(x: jnp.ndarray, w: jnp.ndarray, axes: tuple, *, n_in: int = 1, backend: str = "reference",
          norm: tuple | None = None, residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """x [..., *in] · w [*in, *out] (a ROWS Fp8Weight: [*out, *in]) -> [..., *out] in x's dtype, as `proj`; w has
    n_in input axes.

    `axes`: w's logical axes in its stored order (ling_jax/params.py), which place the kernel's shards. `norm`
    (weight, eps): x is `rms_norm(x, weight, eps)` first. `residual` [..., *out]: added after the rounding, as a
    block's h + proj(x). x may be a `GroupRMS` (KDA's output with its per-head RMS scaling still to apply), which
    the GEMV kernel applies in its prologue where it can (pallas_kernels/gemv/rows.py) and XLA first elsewhere.
    """
    if isinstance(w, Fp8Weight) and w.n_in != n_in:
        raise ValueError(f"dense: n_in={n_in} but the Fp8Weight has n_in={w.n_in}")
    grouped = isinstance(x, GroupRMS)
    values = x.values if grouped else x
    lead = values.shape[:values.ndim - n_in]
    # XLA's GEMMs and the W8A8 kernel (which quantises the scaled x) take it applied.
    if grouped and (not uses_gemv(backend, math.prod(lead)) or backend == W8A8):
        x = x.apply()
    if not uses_gemv(backend, math.prod(lead)):
        xn = x if norm is None else rms_norm(x, norm[0], norm[1])
        letters = "abcdefghijklmnopqrstuvwxyz"
        xs, ws = letters[:xn.ndim], letters[len(lead):xn.ndim + w.ndim - n_in]
        y = proj(f"{xs},{ws}->{xs[:len(lead)]}{ws[n_in:]}", xn, w)
        return y if residual is None else residual + y
    return _dense_gemv(x, w, tuple(axes), n_in, lead, norm, residual, w8a8=backend == W8A8)


def _is_rows(w) -> bool:
    return isinstance(w, Fp8Weight) and w.layout == ROWS


def in_out_axes(w, axes: tuple, n_in: int) -> tuple[tuple, tuple]:
    """(input axes, output axes) of w's logical `axes` (given in its stored order) or of its shape."""
    if _is_rows(w):
        return tuple(axes[len(axes) - n_in:]), tuple(axes[:len(axes) - n_in])
    return tuple(axes[:n_in]), tuple(axes[n_in:])


def _dense_gemv(x, w, axes, n_in, lead, norm, residual, w8a8=False):
    from pallas_kernels.gemv import gemv, w8a8 as w8a8_gemv

    # E4M3 activations (the gemv op's "w8a8" choice) for FP8 weights only: an option, not the reference numerics.
    project = w8a8_gemv.gemv if w8a8 and _is_rows(w) else functools.partial(gemv, backend="pallas")

    in_axes, out_axes = in_out_axes(w, axes, n_in)
    row_parallel = tp_size() > 1 and any(RULES.get(a) for a in in_axes if a is not None)
    if row_parallel and norm is not None:
        raise ValueError(f"dense: a norm prologue needs the whole input row, but w's input axes {in_axes} are "
                         "split over devices; normalise first")
    none = (None,) * len(lead)
    out_spec = logical_to_spec(none + out_axes)
    grouped = isinstance(x, GroupRMS)
    x_spec = logical_to_spec(none + in_axes)
    if grouped:  # the sums of squares [*lead, G, P] split with the first input axis (heads)
        x_spec = GroupRMS(x_spec, logical_to_spec(none + (in_axes[0], None)), x.eps, x.dtype)
    # Sharded row-parallel outputs are partial sums: the residual is added once, after the sum.
    fused_residual = None if row_parallel else residual
    extras = ([(norm[0], P())] if norm is not None else []) + (
        [(fused_residual, out_spec)] if fused_residual is not None else [])

    def run(x, w, *extra):
        it = iter(extra)
        nrm = (next(it), norm[1]) if norm is not None else None
        res = next(it).reshape(math.prod(lead), -1) if fused_residual is not None else None
        flat = x.reshape(math.prod(lead)) if isinstance(x, GroupRMS) else x.reshape(math.prod(lead), -1)
        y = project(flat, _as_matrix(w, n_in), res, norm=nrm)
        return y.reshape(lead + in_out_axes(w, w.shape, n_in)[1])

    w_spec = logical_to_spec(axes)
    if isinstance(w, Fp8Weight):
        w_spec = Fp8Weight(w_spec, logical_to_spec(scale_axes(axes, w.layout, w.n_in)), w.layout, w.n_in)
    specs = (x_spec, w_spec) + tuple(s for _, s in extras)
    y = per_shard(run, specs, out_spec, sum_outputs=row_parallel)(x, w, *(a for a, _ in extras))
    return y + residual if row_parallel and residual is not None else y


def _as_matrix(w, n_in: int):
    """The GEMV's 2-D weight, a reshape (free on the contiguous array): w [*in, *out] -> [In, Out], its FP8 scale
    [ceil(In/128), Out]; a ROWS w [*out, *in] -> [Out, In], its scale [Out, ceil(In/128)]."""
    if _is_rows(w):
        return Fp8Weight(w.q.reshape(-1, math.prod(w.shape[w.ndim - n_in:])), w.scale.reshape(-1, w.scale.shape[-1]),
                         ROWS, 1)
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
