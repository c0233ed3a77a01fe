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
    # Per op on the H200 (experiments/RESULTS.md): MoE layer at T = 1 33.4 µs Pallas vs 150-181 µs XLA; KDA decode
    # 5.3 µs per layer vs fla's 5.3-6.4 µs core alone; MLA decode 11 / 23 / 50 µs at L = 1k / 8k / 32k vs XLA's
    # 18 / 51 / 147 µs. Every op with a kernel is faster in Pallas today, so "fast" equals "pallas"; it stays a
    # separate profile because a kernel that loses a later measurement leaves "fast" and stays in "pallas" (what the
    # tests run).
    "fast": {"kda": "pallas", "moe_decode": "pallas", "moe_prefill": "reference", "mla_decode": "pallas",
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


def check_partitioning(params, backend: str) -> None:
    """Pallas calls are opaque to XLA's partitioner: sharded params need the mesh in context, so the layers can
    run each kernel per shard (`ling_jax.sharding.per_shard`) instead of XLA all-gathering its weights."""
    if all(choice == "reference" for choice in resolve(backend).values()):
        return
    try:
        devices = params["lm_head"].sharding.device_set
    except Exception:  # a tracer inside an outer jit: the caller's sharding is not visible here
        return
    from ling_jax.sharding import tp_size

    if len(devices) > 1 and tp_size() != len(devices):
        raise ValueError(f"backend={backend!r} runs Pallas kernels on params sharded over {len(devices)} devices; "
                         f"run under `with jax.set_mesh(mesh):` (a mesh whose 'tp' axis spans those devices) so "
                         "each kernel runs per shard, or use backend='reference'")
