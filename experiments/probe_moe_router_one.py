"""Probe: the T = 1 router (GEMV + grouped top-k) and the shared expert's L2 prefetch in ONE launch.

Production (router.py) runs the router as two launches: the D-split GEMV (2560 one-warp programs, 3.1 µs) and the
top-k (one 4-warp program, 3.3 µs; 3.6 with the 96 programs that prefetch the shared expert into L2). Session 4
folded the top-k into the GEMV launch's last-arriving program and lost (7.7-11.3 µs against 6.8): its programs were
whole expert rows (256-512 programs stream 5 MB slowly) of one warp (the top-k then ran on one warp, ~5 µs).
Here the GEMV keeps production's D-split shape (program = BE expert rows x one of KS D-splits), but every program
has the top-k's 4 warps, so the last GEMV program to arrive (an arrival counter, XLA-zeroed and aliased) runs the
production selection (`router._select_topk`) at full speed; the prefetch programs ride in the same grid, after the
GEMV programs. One launch latency and one ramp instead of two; the selection then overlaps the prefetch's tail.

Result (RESULTS.md, "Session 9", S9 5): dropped. The one launch took 8.3-8.6 µs with the prefetch (every shape;
8 warps 9.2) against 6.6 for GEMV + top-k; without the prefetch 5.7 (the router alone) to 6.45 (in the layer),
plus a 0.9 µs copy that zeroes the counter every layer: the prefetch no longer hides behind a selection (it
competes with the GEMV's reads, and the selection waits for the last GEMV program). Correct: ids identical to the reference over 64 sequential calls.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_router_one.py --set s9c5`; `--toy`: a CPU
smoke run in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_fused_router as pf
import probe_moe_splitk as ps
import probe_moe_t1 as pt
from bench_common import run_header, write_results
from pallas_kernels.common import interpret_mode
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod


def router_one_kernel(x_ref, w_ref, b_ref, cnt_ref, *refs, KS, BE, BK, n_gemv, chunks, select_kw):
    # x_ref [1, D]; w_ref [E, D] fp32; b_ref [G, E/G]; cnt_ref [1] int32 (zero on entry, aliased to the last output)
    # refs: the flat arrays to prefetch, then logits partials [KS, G, E/G] fp32, weights [1, K], ids [1, K], counter
    n_pref = len(chunks)
    pref, (lg_ref, wt_ref, id_ref, _) = refs[:n_pref], refs[n_pref:]
    p = pl.program_id(0)

    @pl.when(p < n_gemv)
    def _():
        pf._split_gemv_logits(x_ref, w_ref, lg_ref, p, KS=KS, BE=BE, BK=BK)

        @pl.when(pf._arrive(cnt_ref, 0) == n_gemv - 1)
        def _():
            w, ids = router_mod._select_topk(pf._sum_split_logits(lg_ref, KS), b_ref[...], **select_kw)
            wt_ref[0, :] = w
            id_ref[0, :] = ids

    router_mod.issue_prefetch_chunks(pref, chunks, p - n_gemv, evict_last=False)


def route_one(x, lay, *, BE=4, KS=5, BK=512, warps=4, prefetch=True, chunk_bytes=120 * 1024):
    router, bias = lay["router"], lay["bias"]
    e, d = router.shape
    g, k = pf.G, pf.SELECT_KW["top_k"]
    KS = router_mod._split_count(d, KS)  # toy sizes: the largest split count <= KS dividing D
    dk = d // KS
    BK = min(BK, dk & -dk)
    assert dk % BK == 0 and e % BE == 0
    n_gemv = (e // BE) * KS
    pref = [lay[n].reshape(-1) for n in ("sg", "su", "sd")] if prefetch else []
    chunks = router_mod._prefetch_chunks(pref, chunk_bytes)
    outs = [jax.ShapeDtypeStruct((KS, g, e // g), jnp.float32), jax.ShapeDtypeStruct((1, k), jnp.float32),
            jax.ShapeDtypeStruct((1, k), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)]
    res = pl.pallas_call(
        functools.partial(router_one_kernel, KS=KS, BE=BE, BK=BK, n_gemv=n_gemv, chunks=chunks,
                          select_kw=pf.SELECT_KW),
        grid=(n_gemv + sum(c for _, c, _ in chunks),),
        in_specs=[pl.no_block_spec] * (4 + len(pref)), out_specs=[pl.no_block_spec] * 4, out_shape=outs,
        input_output_aliases={3: 3},
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3),
        interpret=interpret_mode(), name="router_fwd_kernel_one",
    )(x, router, bias.reshape(g, e // g), jnp.zeros((1,), jnp.int32), *pref)
    return res[1], res[2]


def one_layer(**kw):
    def f(x, lay):
        w, ids = route_one(x, lay, **kw)
        return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                    **pt.LIMITS)
    return f


def route_only(**kw):
    return lambda x, lay: route_one(x, lay, **kw)


def prod_route(x, lay):
    return router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW, prefetch=(lay["sg"], lay["su"], lay["sd"]))


def ref_route(x, lay):
    from pallas_kernels.moe import reference
    return reference.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)


# (label, fn, check: "layer" = the reference layer, "route" = ids against the reference router)
VARIANTS = {
    "s9c5": lambda: [
        ("dep: production layer", ps.prod_layer, "layer"),
        ("dep: one-launch router BE4 KS5 4w", one_layer(), "layer"),
        ("dep: one-launch router BE2 KS5 4w", one_layer(BE=2), "layer"),
        ("dep: one-launch router BE8 KS5 4w", one_layer(BE=8), "layer"),
        ("dep: one-launch router BE4 KS10 4w", one_layer(KS=10, BK=256), "layer"),
        ("dep: one-launch router BE2 KS5 2w", one_layer(BE=2, warps=2), "layer"),
        ("dep: one-launch router BE4 KS5 8w", one_layer(warps=8), "layer"),
        ("dep: one-launch router BE4 KS5 4w, no prefetch", one_layer(prefetch=False), "layer"),
        ("router alone: production", prod_route, "route"),
        ("router alone: one launch BE4 KS5 4w", route_only(), "route"),
        ("router alone: one launch BE4 KS5 4w, no prefetch", route_only(prefetch=False), "route"),
        ("dep: production layer again", ps.prod_layer, "layer"),
        ("dep: one-launch router BE4 KS5 4w again", one_layer(), "layer"),
    ],
}


def main():
    args, out, x, layers, only = pf.chain_probe_setup("probe_moe_router_one", VARIANTS, "s9c5", only_sep=";")
    results = {**run_header(), "layers": len(layers), "rows": []}
    refs = {"layer": pt.reference_layer, "route": ref_route}
    ps.record_variants(results, out, x, layers, only,
                       [(label, fn, refs[check], False) for label, fn, check in VARIANTS[args.set]()])
    if not only:  # many sequential calls through the XLA-zeroed counter: ids identical to the reference router
        import numpy as np
        f, r = jax.jit(route_only()), jax.jit(ref_route)
        bad = 0
        for t in range(64):
            xt = jax.random.normal(jax.random.key(1000 + t), x.shape, x.dtype)
            bad += int(np.sum(np.asarray(f(xt, layers[t % len(layers)])[1]) !=
                              np.asarray(r(xt, layers[t % len(layers)])[1])))
        results["ids_differ_of_64_calls"] = bad
        print(f"one-launch router, 64 sequential calls: {bad} ids differ from the reference", flush=True)
    write_results(out, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
