"""MoE router and experts (docs/model.md §3.5): `route`, `moe_experts` (with backend="pallas": the decode/verify
kernels of experts.py up to experts.MAX_TOKENS tokens, the grouped GEMM of grouped.py beyond), and the pure-jnp
`reference` they are tested against."""

from pallas_kernels.moe import reference
from pallas_kernels.moe.dispatch import moe_experts, route

__all__ = ["moe_experts", "reference", "route"]
