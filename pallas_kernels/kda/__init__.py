"""Ling-3.0 KDA ops: chunked prefill, fused decode, speculative verify + commit (reference and Pallas)."""

from pallas_kernels.kda import reference
from pallas_kernels.kda.dispatch import kda_commit, kda_decode, kda_prefill, kda_verify

__all__ = ["kda_commit", "kda_decode", "kda_prefill", "kda_verify", "reference"]
