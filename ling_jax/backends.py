"""Which implementation runs each op: `backend` is "reference", "pallas", "fast", or per op, e.g.
"kda=pallas,moe_decode=pallas,mla_decode=reference".

"pallas" means every op that has a Pallas kernel (what the tests exercise); "fast" means, per op, whichever
implementation measured faster on the H200 (experiments/RESULTS.md; update it with every new measurement).
Prefill-sized MoE and MLA prefill have no kernel (the MoE kernels are built for decode/verify, T <= 64; prefill
is compute-bound and XLA's ragged_dot / attention serve it), so they run the reference under every profile. This table is the only place that says so: ops never fall back on
their own.
"""

from __future__ import annotations

import functools

OPS = ("kda", "moe_decode", "moe_prefill", "mla_decode", "mla_prefill")
NO_KERNEL = ("moe_prefill", "mla_prefill")
CHOICES = ("reference", "pallas")
PROFILES = {
    "reference": dict.fromkeys(OPS, "reference"),
    "pallas": {op: "reference" if op in NO_KERNEL else "pallas" for op in OPS},
    # RESULTS.md, 2026-11-29: MoE layer at T=1 56 us Pallas vs 186 us XLA; MLA decode at L=1k 76 us Pallas, slower
    # than XLA's fused attention, so the reference stays there until the kernel is reworked.
    "fast": {"kda": "pallas", "moe_decode": "pallas", "moe_prefill": "reference", "mla_decode": "reference",
             "mla_prefill": "reference"},
}


@functools.cache
def resolve(backend: str) -> dict[str, str]:
    if backend in PROFILES:
        return PROFILES[backend]
    chosen = dict(PROFILES["reference"])
    for item in backend.split(","):
        op, _, choice = item.partition("=")
        if op not in OPS or choice not in CHOICES:
            raise ValueError(f"backend={backend!r}: expected one of {tuple(PROFILES)}, or comma-separated op=choice "
                             f"with op in {OPS} and choice in {CHOICES}")
        if op in NO_KERNEL and choice == "pallas":
            raise ValueError(f"backend {op}=pallas: {op} has no Pallas kernel; use reference")
        chosen[op] = choice
    return chosen


def op_backend(backend: str, op: str) -> str:
    return resolve(backend)[op]
