"""Projections of a few tokens (decode, verify) and the greedy lm_head: `gemv` (x·w plus an optional residual),
`greedy_head` (argmax of the logits without writing them; with backend="pallas" the kernels of kernel.py, up to
kernel.MAX_TOKENS tokens), both optionally after the RMSNorm of x (`norm=`), and the pure-jnp `reference` they are
tested against."""

from pallas_kernels.gemv import reference
from pallas_kernels.gemv.dispatch import gemv, greedy_head

__all__ = ["gemv", "greedy_head", "reference"]
