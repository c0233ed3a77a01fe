"""Block-FP8 weights: E4M3 values with one float32 scale per 128-wide block (docs/model.md §4, the `-fp8` release).

`Fp8Weight` is a pytree (its arrays are leaves, its layout static), so params, shardings and shard_map specs hold
it wherever they hold a plain weight. The dequantised weight is `q · scale` in float32; `dequantize` is that
definition, rounded to the dtype it is asked for. The kernels keep the dequantised weight in float32 (their
references take `dequantize(w, float32)`); XLA's GEMMs (prefill, the reference backend) take it rounded to the
compute dtype.

Three layouts (ling_jax/params.py stores ROWS and OUT_IN):
    ROWS    q [*out, *in] (the projections, as torch stores them: each output row contiguous along its inputs;
            the last n_in axes are inputs, In = prod(in)): scale [*out, ceil(In/128)], one scale per output row and
            128 input columns. A checkpoint's 128x128 block scale is repeated over the block's 128 output rows, so
            any packing of output rows (fused per-head projections) stays exact; it costs 4 bytes per 128 weight
            bytes (3 %). pallas_kernels/gemv/rows.py streams it.
    OUT_IN  q [..., O, I] (the MoE experts, kept as torch stores them): scale [..., ceil(O/128), ceil(I/128)],
            the checkpoint's own 128x128 blocks.
    IN_OUT  q [*in, *out] (n_in leading input axes): scale [ceil(In/128), *out], ROWS's scales transposed; the
            layout of pallas_kernels/gemv/kernel.py, which the benchmarks still compare.
`convert_layout` turns an IN_OUT or OUT_IN weight into ROWS exactly (a transpose, or the block scale repeated over
its rows) and a ROWS weight back into IN_OUT. `as_in_out` is any projection weight as the dense [*in, *out] matrix
that XLA's einsums take.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

BLOCK = 128
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite E4M3 value
IN_OUT, OUT_IN, ROWS = "in_out", "out_in", "rows"
LAYOUTS = (IN_OUT, OUT_IN, ROWS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array  # float8_e4m3fn, the weight's shape
    scale: jax.Array  # float32, see the module docstring
    layout: str = dataclasses.field(default=IN_OUT, metadata=dict(static=True))
    # IN_OUT: the leading input axes; ROWS: the trailing ones
    n_in: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def scale_shape(shape: tuple[int, ...], layout: str, n_in: int = 1) -> tuple[int, ...]:
    if layout == IN_OUT:
        return (math.ceil(math.prod(shape[:n_in]) / BLOCK),) + tuple(shape[n_in:])
    if layout == OUT_IN:
        return tuple(shape[:-2]) + (math.ceil(shape[-2] / BLOCK), math.ceil(shape[-1] / BLOCK))
    if layout == ROWS:
        return tuple(shape[:-n_in]) + (math.ceil(math.prod(shape[-n_in:]) / BLOCK),)
    raise ValueError(f"FP8 layout {layout!r} must be one of {LAYOUTS}")


def check_fp8(name: str, w: Fp8Weight, layout: str | tuple[str, ...] | None = None) -> None:
    """A clear error for a mistyped or mis-shaped FP8 weight or scale (`layout`: the one, or the ones, an op takes)."""
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"{name} is {type(w).__name__}; expected an Fp8Weight")
    allowed = (layout,) if isinstance(layout, str) else layout
    if allowed is not None and w.layout not in allowed:
        raise ValueError(f"{name} has FP8 layout {w.layout!r}; this op needs {' or '.join(map(repr, allowed))} "
                         "(pallas_kernels/common/fp8.py)")
    if w.layout not in LAYOUTS:
        raise ValueError(f"{name} has FP8 layout {w.layout!r}; must be one of {LAYOUTS}")
    if w.layout == ROWS and not 1 <= w.n_in < w.ndim:
        raise ValueError(f"{name}.n_in={w.n_in} must leave an output and an input axis in the {ROWS} shape {w.shape}")
    if jnp.dtype(w.q.dtype) != FP8_DTYPE:
        raise ValueError(f"{name}.q.dtype={jnp.dtype(w.q.dtype)} must be {FP8_DTYPE}")
    if jnp.dtype(w.scale.dtype) != jnp.float32:
        raise ValueError(f"{name}.scale.dtype={jnp.dtype(w.scale.dtype)} must be float32 (the checkpoint's "
                         "weight_scale_inv)")
    want = scale_shape(w.shape, w.layout, w.n_in)
    if tuple(w.scale.shape) != want:
        raise ValueError(f"{name}.scale.shape={tuple(w.scale.shape)} must be {want} for a {w.layout} weight of shape "
                         f"{w.shape} (128-wide blocks)")


def expanded_scale(w: Fp8Weight) -> jax.Array:
    """The scale repeated to the weight's shape (float32)."""
    if w.layout == IN_OUT:
        rows = math.prod(w.shape[:w.n_in])
        s = jnp.repeat(w.scale.reshape(w.scale.shape[0], -1), BLOCK, axis=0)[:rows]
        return s.reshape(w.shape)
    if w.layout == ROWS:
        cols = math.prod(w.shape[-w.n_in:])
        s = jnp.repeat(w.scale, BLOCK, axis=-1)[..., :cols]
        return s.reshape(w.shape)
    o, i = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(w.scale, BLOCK, axis=-2)[..., :o, :], BLOCK, axis=-1)
    return s[..., :i]


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """q · scale in float32, rounded to `dtype`; a plain array passes through (cast to `dtype`)."""
    if not isinstance(w, Fp8Weight):
        return w.astype(dtype)
    return (w.q.astype(jnp.float32) * expanded_scale(w)).astype(dtype)


def as_in_out(w, dtype=jnp.float32) -> jax.Array:
    """A projection weight as a dense [*in, *out] array in `dtype`: a plain array (stored so) cast, an Fp8Weight
    dequantised (`dequantize`: q · scale in float32, rounded once) with a ROWS weight's axes moved to [*in, *out]
    (a transpose XLA folds into the GEMM reading it)."""
    if isinstance(w, Fp8Weight) and w.layout == OUT_IN:
        raise ValueError("as_in_out takes a projection; an OUT_IN weight is an expert matrix [..., O, I] "
                         "(pallas_kernels/moe)")
    x = dequantize(w, dtype)
    if isinstance(w, Fp8Weight) and w.layout == ROWS:
        n_out = w.ndim - w.n_in
        x = jnp.transpose(x, tuple(range(n_out, w.ndim)) + tuple(range(n_out)))
    return x


def _block_scales(w2: jax.Array, rows: int, cols: int) -> jax.Array:
    """amax / 448 over [rows, cols] blocks of the last two axes of w2 (float32; 1 for an all-zero block)."""
    *lead, o, i = w2.shape
    po, pi = -o % rows, -i % cols
    padded = jnp.pad(jnp.abs(w2), [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    blocks = padded.reshape(*lead, (o + po) // rows, rows, (i + pi) // cols, cols)
    amax = blocks.max(axis=(-3, -1))
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize(w: jax.Array, layout: str = IN_OUT, n_in: int = 1) -> Fp8Weight:
    """Block-FP8 of a float weight: scale = block amax / 448 (stored as the checkpoint's scale_inv), q = w / scale
    rounded to E4M3. IN_OUT blocks are 128 input rows x one output column, ROWS one output row x 128 input
    columns (the same blocks of the transposed weight), OUT_IN the checkpoint's 128x128."""
    w32 = jnp.asarray(w, jnp.float32)
    if layout == IN_OUT:
        rows = math.prod(w.shape[:n_in])
        scale = _block_scales(w32.reshape(rows, -1), BLOCK, 1).reshape(scale_shape(w.shape, layout, n_in))
    elif layout == ROWS:
        cols = math.prod(w.shape[-n_in:])
        scale = _block_scales(w32.reshape(-1, cols), 1, BLOCK).reshape(scale_shape(w.shape, layout, n_in))
    else:
        scale = _block_scales(w32, BLOCK, BLOCK)
    probe = Fp8Weight(jnp.zeros(w.shape, FP8_DTYPE), scale, layout, n_in)
    q = jnp.clip(w32 / expanded_scale(probe), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Fp8Weight(q, scale, layout, n_in)


def convert_layout(w: Fp8Weight, layout: str) -> Fp8Weight:
    """The same dequantised weight in another layout, exactly (no value or scale is recomputed): IN_OUT -> ROWS
    transposes q [*in, *out] to [*out, *in] and moves the scale's block axis last; OUT_IN -> ROWS repeats each
    128x128 block scale over its 128 rows (q stays); ROWS -> IN_OUT undoes the first. OUT_IN is only ever the
    source: a ROWS or IN_OUT scale need not be uniform over 128 rows."""
    check_fp8("w", w)
    if w.layout == layout:
        return w
    n_in = w.n_in
    if (w.layout, layout) == (IN_OUT, ROWS):
        order = tuple(range(n_in, w.ndim)) + tuple(range(n_in))
        return Fp8Weight(jnp.transpose(w.q, order), jnp.moveaxis(w.scale, 0, -1), ROWS, n_in)
    if (w.layout, layout) == (ROWS, IN_OUT):
        n_out = w.ndim - n_in
        order = tuple(range(n_out, w.ndim)) + tuple(range(n_out))
        return Fp8Weight(jnp.transpose(w.q, order), jnp.moveaxis(w.scale, -1, 0), IN_OUT, n_in)
    if (w.layout, layout) == (OUT_IN, ROWS):
        scale = jnp.repeat(w.scale, BLOCK, axis=-2)[..., :w.shape[-2], :]
        return Fp8Weight(w.q, scale, ROWS, 1)
    raise ValueError(f"convert_layout takes {IN_OUT!r} or {OUT_IN!r} to {ROWS!r} and {ROWS!r} to {IN_OUT!r}; got "
                     f"{w.layout!r} -> {layout!r}")


def weight_dtype(w):
    """The dtype a check compares: the FP8 dtype for an Fp8Weight, else the array's."""
    return jnp.dtype(w.q.dtype if isinstance(w, Fp8Weight) else w.dtype)
