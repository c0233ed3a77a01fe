"""The RMSNorm pieces a kernel applies in its prologue, with `rms_norm`'s roundings (x·rsqrt rounded to x's dtype,
times the weight in x's dtype, rounded again)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax


def rms_normed(xs, g, inv_rms):
    """`rms_norm` of an x tile ([BK] or [rows, BK]) given its tokens' inv_rms ([] or [rows]) and the norm weight's
    tile g [BK]."""
    dt = xs.dtype
    if xs.ndim == 2:
        inv_rms, g = inv_rms[:, None], g[None, :]
    normed = (xs.astype(jnp.float32) * inv_rms).astype(dt)
    # A product of two bf16 values is exact in fp32, so one rounding of it is the reference's bf16 multiply.
    return (g.astype(dt).astype(jnp.float32) * normed.astype(jnp.float32)).astype(dt)


def group_rms_scaled(xs, sum_sq, group: int, eps: float, dtype):
    """A GroupRMS piece inside one group, in a kernel's prologue: the fp32 values xs times rsqrt(Σ sum_sq / S + eps)
    of its group's partial sums `sum_sq` [P], rounded to `dtype`. The partial sums add in a tree here and in order in
    `GroupRMS.apply`, so a bf16 rounding of the two may differ."""
    return (xs * lax.rsqrt(jnp.sum(sum_sq) / group + eps)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupRMS:
    """An activation whose RMS scaling per group of columns is still to be applied, so that the consumer's prologue
    can apply it instead of a launch of its own (KDA's gated RMSNorm: its kernel splits each head's columns over
    several programs, so no program sees a head's whole sum of squares).

    sum_sq: float32 [*lead, G, P], P partial sums of squares per group of S columns (of the values before the norm
    weight and any gate), summed in order; values: float32 [*lead, G, S] or [*lead, G·S], everything but the
    scaling (weight and gate applied). Applied: values · rsqrt(Σ_p sum_sq / S + eps), rounded to `dtype`.
    """
    values: jax.Array
    sum_sq: jax.Array
    eps: float = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))  # the compute dtype's name

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.sum_sq.shape[:-2])

    @property
    def group(self) -> int:
        """S: the columns per group."""
        return math.prod(self.values.shape[len(self.lead):]) // self.sum_sq.shape[-2]

    def reshape(self, *lead: int) -> "GroupRMS":
        """Leading axes reshaped to `lead`: values [*lead, G·S], sum_sq [*lead, G, P]."""
        g, p = self.sum_sq.shape[-2:]
        return GroupRMS(self.values.reshape(*lead, -1), self.sum_sq.reshape(*lead, g, p), self.eps, self.dtype)

    def apply(self) -> jax.Array:
        """The scaled activation in `dtype`, values' shape, by XLA: one fusion."""
        p = self.sum_sq.shape[-1]
        # Unrolled adds, not a reduce: XLA emits a reduce as a launch of its own, the adds fuse with the scaling.
        total = functools.reduce(jnp.add, [self.sum_sq[..., j:j + 1] for j in range(1, p)], self.sum_sq[..., :1])
        scale = lax.rsqrt(total / self.group + self.eps)  # [*lead, G, 1]
        grouped = self.values.reshape(*self.sum_sq.shape[:-1], self.group)
        return (grouped * scale).reshape(self.values.shape).astype(self.dtype)
