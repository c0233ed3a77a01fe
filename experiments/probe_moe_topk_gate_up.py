"""Probe: the grouped top-k folded into a persistent gate/up kernel (T = 1 MoE layer in four launches).

The five-launch layer (router GEMV, top-k, gate/up, down, combine) spends ~3.3 µs in a one-program top-k launch
while DRAM idles. Earlier fusions put the top-k where one program ran it serially after the GEMV (~5 µs tail), or
into each of 3456 one-warp gate/up programs (many waves of it). Here the gate/up grid is P persistent programs
(P = K · per_slot, one wave on 132 SMs): every program reads the GEMV's partial logits (10 KB, from L2), runs the
same 4-warp top-k (identical in every program; program 0 writes weights and ids for the down kernel), then streams
its rows: I / P rows of the shared expert, whose loads are issued before the top-k so they are in flight while it
runs, and I / per_slot rows of routed slot p // per_slot. The down kernel and the combine are the production ones
(`experts.down_and_combine`).

Result (RESULTS.md, "MoE, session 6"; correct, identical error to the five-launch layer): the fused kernel took
34.8-114 µs against 3.3 + 18.5 for top-k + gate/up. A persistent program's row loop issues a step's loads, then
waits for them (no cp.async pipelining of these FMA loops: 2-4 KB of shared memory), so a few hundred programs
cannot keep HBM busy; more programs were better throughout (per_slot 96: 768 programs, 34.8 µs), and the current
gate/up hides latency with 3456 resident one-warp programs instead, where a top-k in every program repeats ~26
times per SM (session 3: slower).

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_topk_gate_up.py` (`--toy`: CPU smoke run in
interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_fused_router as pf
import probe_moe_t1 as pt
from bench_common import run_header, write_results
from pallas_kernels.common import interpret_mode
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

OUT = "probe_moe_topk_gate_up.json"


def topk_gate_up_kernel(p_ref, b_ref, x_ref, wg_ref, wu_ref, sg_ref, su_ref, w_ref, i_ref, h_ref, *, select_kw,
                        per_slot, BR, BK, limit, shared_limit, evict, unroll_chunks):
    # p_ref [KS, G, E/G] partial logits; b_ref [G, E/G]; x_ref [1, D]; wg/wu [E, I, D]; sg/su [I, D];
    # w_ref/i_ref [1, K]; h_ref [K + 1, 1, I] (slot K: the shared expert)
    p = pl.program_id(0)
    k = i_ref.shape[1]
    d, i_dim, dt = x_ref.shape[1], wg_ref.shape[1], h_ref.dtype
    chunks = [pl.ds(c * BK, BK) for c in range(d // BK)]
    rs = i_dim // (k * per_slot)  # shared rows per program
    srows = pl.ds(pl.multiple_of(p * rs, rs), rs)
    shared = [(sg_ref[srows, ck], su_ref[srows, ck]) for ck in chunks]  # in flight during the top-k

    w, ids = router_mod._select_topk(router_mod._sum_partials(p_ref), b_ref[...], **select_kw)

    @pl.when(p == 0)
    def _():
        w_ref[0, :] = w
        i_ref[0, :] = ids

    acc_g = acc_u = jnp.zeros((1, rs), jnp.float32)
    for ck, (g, u) in zip(chunks, shared):
        xs = x_ref[:, ck]
        acc_g = ex._gu_step("fma_reduce", acc_g, g, xs)
        acc_u = ex._gu_step("fma_reduce", acc_u, u, xs)
    h_ref[k, :, srows] = ex._swiglu(acc_g.astype(dt), acc_u.astype(dt), shared_limit)

    s, j = p // per_slot, p % per_slot
    rpp = i_dim // per_slot
    e = jnp.sum(jnp.where(lax.iota(jnp.int32, k) == s, ids, 0))

    def row_block(rb, carry):
        rows = pl.ds(pl.multiple_of(j * rpp + rb * BR, BR), BR)
        load_g = lambda ck: ex._load(wg_ref, (e, rows, ck), evict)  # noqa: E731
        load_u = lambda ck: ex._load(wu_ref, (e, rows, ck), evict)  # noqa: E731
        if unroll_chunks:  # all 2 · D / BK tiles of the row block issued together
            tiles = [(load_g(ck), load_u(ck)) for ck in chunks]
            ag = au = jnp.zeros((1, BR), jnp.float32)
            for ck, (g, u) in zip(chunks, tiles):
                xs = x_ref[:, ck]
                ag, au = ex._gu_step("fma_reduce", ag, g, xs), ex._gu_step("fma_reduce", au, u, xs)
            hrow = ex._swiglu(ag.astype(dt), au.astype(dt), limit)
        else:
            hrow = ex._gate_up_rows(x_ref, load_g, load_u, BK=BK, n_chunks=len(chunks), bi=BR, to=1,
                                    mode="fma_reduce", limit=limit, dt=dt)
        h_ref[s, :, rows] = hrow
        return carry

    lax.fori_loop(0, rpp // BR, row_block, 0)


@dataclasses.dataclass(frozen=True)
class Fused:
    per_slot: int = 24  # programs per routed slot: P = K · per_slot
    block_r: int = 4  # BR: routed rows per step
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    evict: str | None = "evict_first"
    unroll_chunks: bool = False


def fused_layer(cfg: Fused):
    down_tuning = dataclasses.replace(ex.DECODE_TUNING, routed_eviction=cfg.evict)

    def f(x, lay):
        partial = router_mod.gemv_partials(x, lay["router"], router_mod.DECODE_TUNING)
        ks, _, e = partial.shape
        n_group, k = pf.G, pf.SELECT_KW["top_k"]
        d, i_dim = x.shape[1], lay["sg"].shape[0]
        whole = pl.no_block_spec
        w, ids, h = pl.pallas_call(
            functools.partial(topk_gate_up_kernel, select_kw=pf.SELECT_KW, per_slot=cfg.per_slot, BR=cfg.block_r,
                              BK=min(cfg.block_k, d & -d), limit=pt.LIMITS["limit"],
                              shared_limit=pt.LIMITS["shared_limit"], evict=cfg.evict,
                              unroll_chunks=cfg.unroll_chunks),
            grid=(k * cfg.per_slot,),
            in_specs=[whole] * 7,
            out_specs=[whole] * 3,
            out_shape=[jax.ShapeDtypeStruct((1, k), jnp.float32), jax.ShapeDtypeStruct((1, k), jnp.int32),
                       jax.ShapeDtypeStruct((k + 1, 1, i_dim), x.dtype)],
            compiler_params=pltriton.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
            interpret=interpret_mode(), name="experts_fwd_kernel_topk_gate_up",
        )(partial.reshape(ks, n_group, e // n_group), lay["bias"].reshape(n_group, e // n_group), x, lay["wg"],
          lay["wu"], lay["sg"], lay["su"])
        return ex.down_and_combine(h, ids, w, lay["wd"], lay["sd"], n=1, tuning=down_tuning)
    return f


VARIANTS = [
    Fused(),
    Fused(stages=2),
    Fused(block_r=2),
    Fused(block_r=2, unroll_chunks=True, stages=2),
    Fused(block_r=4, unroll_chunks=True, stages=2),
    Fused(block_r=4, unroll_chunks=True, stages=1),
    Fused(per_slot=48, block_r=2),
    Fused(per_slot=48, block_r=4),
    Fused(per_slot=48, block_r=2, unroll_chunks=True, stages=2),
    Fused(per_slot=96, block_r=2, unroll_chunks=True, stages=2),
    Fused(per_slot=96, block_r=1, warps=2),
    Fused(per_slot=48, block_r=2, warps=8),
    Fused(evict=None),
]


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--only", default="", help="comma-separated variant indices (default: all)")
    args = ap.parse_args()
    variants = VARIANTS
    if args.toy:
        OUT = "probe_moe_topk_gate_up_toy.json"
        x, layers = pf.toy_layers()  # D 256, I 64, E 64: per_slot 2 (shared rows 4), BR 4
        pt.TO_REPO = False
        variants = [Fused(per_slot=2, block_r=4), Fused(per_slot=2, block_r=2, unroll_chunks=True),
                    Fused(per_slot=4, block_r=1, evict=None)]
    else:
        x, layers = pt.make_layers()
    results = {**run_header(), "rows": []}
    pt.record_row(results, OUT, "five launches (defaults)", pt.separate(), x, layers, pt.reference_layer)
    only = {int(v) for v in args.only.split(",") if v.strip()}
    for n, cfg in enumerate(variants):
        if only and n not in only:
            continue
        label = f"[{n}] fused top-k+gate/up " + " ".join(
            f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(Fused(), f.name))
        pt.record_row(results, OUT, label, fused_layer(cfg), x, layers, pt.reference_layer)
    pt.record_row(results, OUT, "five launches (defaults), again", pt.separate(), x, layers, pt.reference_layer)
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
