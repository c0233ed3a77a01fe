"""Probe: the [E, D] router's GEMV over D-splits (RouterTuning.k_splits) and rows per program, by device time.

The row-streaming GEMV with no split (E/BE one-warp programs) measured 4.7-5.6 µs for the 5.2 MB fp32 router,
slower than the 3.8 µs of the previous [D, E] split-K kernel (512 programs): too few loads in flight. Here KS
splits each row into KS contiguous segments (E/BE·KS programs) and the top-k sums the KS partials.
NL = 32 routers (168 MB, > the 60 MB L2) in rotation; ids checked against the reference on layer 0.

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_router_splits.py --sweep c7` (c6: session 4's call 6).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_t1 import D, E, ROUTE_KW, record_row  # noqa: E402

from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

NL = 32
OUT = "probe_router_splits.json"
RT = router_mod.RouterTuning
# Written out (not router.DECODE_TUNING / VERIFY_TUNING, which these sweeps changed): _R6 the T = 1 default when c6
# ran, _D the T = 1 default since, _P c8's one-token-program base, _V the N > 1 dot path's field defaults.
_R6 = RT(block_e=2, block_k=512, num_warps=1, t1_gemv="fma_reduce")
_D = RT(block_e=1, block_k=512, k_splits=5, num_warps=1, t1_gemv="fma_reduce")
_P = dataclasses.replace(_D, multi_token="per_token")
_V = RT()
SWEEPS = {  # c6, c7, c8: session 4's calls 6, 7, 8
    "c6": ([dataclasses.replace(_R6, block_e=be, k_splits=ks) for be in (1, 2, 4) for ks in (1, 2, 4, 5, 8, 10)]
           + [dataclasses.replace(_R6, k_splits=5, block_k=256), dataclasses.replace(_R6, k_splits=5, num_warps=2),
              dataclasses.replace(_R6, block_e=8, k_splits=10, num_warps=4, t1_gemv="fma")],
           {6: [dataclasses.replace(_V, k_splits=ks) for ks in (1, 4, 5, 10, 20)]}),
    # the dot's orientation, tile and split for T > 1
    "c7": ([_D, dataclasses.replace(_D, k_splits=4), dataclasses.replace(_D, block_e=2)],
           {t: [dataclasses.replace(_V, dot_gemv=dot, k_splits=ks, block_e=be, block_k=bk)
                for dot in ("dot_x", "dot_w") for ks in (4, 10) for be in (16, 32) for bk in (64, 128)
                if t == 6 or (ks, be, bk) in ((4, 16, 64), (10, 32, 128))] for t in (6, 16)}),
    # one token per program (the T = 1 products; tile re-reads from L2) against the best dot of c7
    "c8": ([_D],
           {t: [_P, dataclasses.replace(_P, block_e=2), dataclasses.replace(_P, k_splits=10),
                dataclasses.replace(_P, k_splits=2, block_k=256), dataclasses.replace(_V, dot_gemv="dot_w", k_splits=4)]
            for t in (2, 6, 16)}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="c8")
    args = ap.parse_args()
    t1, by_t = SWEEPS[args.sweep]
    results = {**run_header(), "sweep": args.sweep, "rows": []}
    layers = [dict(router=jax.random.normal(jax.random.key(l), (E, D), jnp.float32) * D ** -0.5,
                   bias=0.01 * jax.random.normal(jax.random.key(100 + l), (E,), jnp.float32)) for l in range(NL)]

    def ref(x, lay):
        return reference.route(x, lay["router"], lay["bias"], **ROUTE_KW)

    for t, tunings in [(1, t1)] + sorted(by_t.items()):
        x = jax.random.normal(jax.random.key(99 + t), (t, D), jnp.bfloat16)
        for tu in tunings:
            def f(x, lay, tu=tu):
                return router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=tu)
            per_token = t == 1 or tu.multi_token == "per_token"
            label = (f"T={t} BE{tu.block_e} KS{tu.k_splits} BK{tu.block_k} w{tu.num_warps} "
                     + (tu.t1_gemv + (" per token" if t > 1 else "") if per_token else tu.dot_gemv))
            record_row(results, OUT, label, f, x, layers, ref)
    write_results(OUT, results)


if __name__ == "__main__":
    main()
