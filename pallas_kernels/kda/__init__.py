"""Ling-3.0 KDA ops: chunked prefill, fused decode, speculative verify + commit (reference and Pallas)."""

from pallas_kernels.kda import reference
from pallas_kernels.kda.dispatch import (
    KDAStaged,
    kda_commit,
    kda_decode,
    kda_prefill,
    kda_replay,
    kda_verify,
)

__all__ = ["KDAStaged", "kda_commit", "kda_decode", "kda_prefill", "kda_replay", "kda_verify", "reference"]
