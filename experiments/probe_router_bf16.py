"""Probe: the T = 1 MoE layer with its router held in bf16, as a BF16 checkpoint stores `mlp.gate.weight`.

The model keeps a router in the dtype the checkpoint stores (LingConfig.router_weight_dtype); the router GEMV widens
each bf16 weight tile to fp32 before the same products, so the selection is exactly its fp32 copy's
(tests/ops/test_moe.py::test_route_bf16_router_is_its_fp32_copy) while the GEMV reads 2.6 MB instead of 5.2. Until
session 12 the layer was measured with fp32 routers only. Rows ("dep:": the dependent chain, as the production
bench's `--chain direct`): the production layer with the fp32 router and with the bf16 one, and bf16 GEMV tunings
around router.DECODE_TUNING (one-warp programs of one expert row split 5 ways, 512-wide: 1 KB per program in bf16
against 2 KB in fp32): two rows per program, fewer and more splits. Each row is checked on layer 0 against the
reference layer over the same router values. (S12 1-2 recorded the rows "bf16 router, 1 row (DECODE_TUNING)" as
"production layer, bf16 router": the production default for a bf16 router is now DECODE_TUNING_BF16, two rows.)

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_router_bf16.py --set s12c1` (s12c2); `--toy`: a CPU
smoke run in interpret mode.
"""

from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp

import probe_moe_fused_router as pf
import probe_moe_splitk as ps
import probe_moe_t1 as pt
from bench_common import run_header, write_results
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

ROUTER32, ROUTER16 = "router32", "router16"


def layer(router_key, **tuning_fields):
    """The production T = 1 layer on lay[router_key], the router tuning DECODE_TUNING with `tuning_fields`."""
    tu = dataclasses.replace(router_mod.DECODE_TUNING, **tuning_fields)

    def f(x, lay):
        w, ids = router_mod.route(x, lay[router_key], lay["bias"], **pt.ROUTE_KW, tuning=tu,
                                  prefetch=(lay["sg"], lay["su"], lay["sd"]))
        return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                    **pt.LIMITS)
    return f


def reference(router_key):
    return lambda x, lay: pt.reference_layer(x, dict(lay, router=lay[router_key].astype(jnp.float32)))


VARIANTS = {
    "s12c1": lambda: [
        ("dep: production layer, fp32 router", layer(ROUTER32), reference(ROUTER32)),
        ("dep: bf16 router, 1 row (DECODE_TUNING)", layer(ROUTER16), reference(ROUTER16)),
        ("dep: bf16 router, 2 rows per GEMV program", layer(ROUTER16, block_e=2), reference(ROUTER16)),
        ("dep: bf16 router, 2 splits (256-wide tiles)", layer(ROUTER16, k_splits=2, block_k=256),
         reference(ROUTER16)),
        ("dep: bf16 router, 10 splits (256-wide)", layer(ROUTER16, k_splits=10, block_k=256), reference(ROUTER16)),
        ("dep: production layer, fp32 router again", layer(ROUTER32), reference(ROUTER32)),
        ("dep: bf16 router, 1 row (DECODE_TUNING) again", layer(ROUTER16), reference(ROUTER16)),
    ],
    # S12 1: 2 rows per program won (33.38 µs against 33.90-34.01 for 1 row, 34.12-34.19 fp32): rows around it
    "s12c2": lambda: [
        ("dep: bf16 router, 1 row (DECODE_TUNING)", layer(ROUTER16), reference(ROUTER16)),
        ("dep: bf16 router, 2 rows per GEMV program", layer(ROUTER16, block_e=2), reference(ROUTER16)),
        ("dep: bf16 router, 4 rows per GEMV program", layer(ROUTER16, block_e=4), reference(ROUTER16)),
        ("dep: bf16 router, 2 rows, 256-wide tiles", layer(ROUTER16, block_e=2, block_k=256), reference(ROUTER16)),
        ("dep: fp32 router, 2 rows per GEMV program", layer(ROUTER32, block_e=2), reference(ROUTER32)),
        ("dep: bf16 router, 2 rows per GEMV program again", layer(ROUTER16, block_e=2), reference(ROUTER16)),
        ("dep: production layer, fp32 router", layer(ROUTER32), reference(ROUTER32)),
    ],
}


def main():
    args, out, x, layers, only = pf.chain_probe_setup("probe_router_bf16", VARIANTS, "s12c1", only_sep=";")
    for lay in layers:  # separate cold buffers per layer and dtype
        lay[ROUTER32] = lay.pop("router")
        lay[ROUTER16] = lay[ROUTER32].astype(jnp.bfloat16)
    results = {**run_header(), "layers": len(layers), "rows": []}
    ps.record_variants(results, out, x, layers, only,
                       [(label, fn, check, False) for label, fn, check in VARIANTS[args.set]()])
    write_results(out, results, to_repo=not args.toy)


if __name__ == "__main__":
    sys.exit(main())
