"""MLA attention (docs/model.md §3.3): `mla_decode_attention` (absorbed, latent cache; kernel in `decode.py`),
`mla_prefill_attention` (expanded heads, causal from any start; flash kernel in `prefill.py`), and the pure-jnp
`reference` they are tested against."""

from pallas_kernels.mla import reference
from pallas_kernels.mla.dispatch import mla_decode_attention, mla_prefill_attention

__all__ = ["mla_decode_attention", "mla_prefill_attention", "reference"]
