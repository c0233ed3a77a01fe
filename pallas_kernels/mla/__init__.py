"""MLA attention (docs/model.md §3.3): `mla_decode_attention` (absorbed, latent cache), `mla_prefill_attention`
(expanded heads), and the pure-jnp `reference` they are tested against."""

from pallas_kernels.mla import reference
from pallas_kernels.mla.dispatch import mla_decode_attention, mla_prefill_attention

__all__ = ["mla_decode_attention", "mla_prefill_attention", "reference"]
