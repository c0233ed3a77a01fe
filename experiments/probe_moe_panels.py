"""Probe: gate/up weights stored as column panels, so that the T = 1 gate/up launch sweeps memory in address order.

The gate/up kernel's 3456 one-warp programs (2 I-rows of one expert each) are all resident from the start and move
in near lockstep through their rows in BK-wide steps. Stored [E, I, D], step c of every program reads columns
[c·BK, (c+1)·BK) of its two rows: 2 × BK·2-byte pieces, one per 5 KB row, so at any moment the DRAM serves pieces
scattered at a 5 KB stride over all 18 expert matrices. Stored as panels [E, D/BK, I, BK] (panel c holds columns
[c·BK, (c+1)·BK) of every row, rows contiguous), step c of program j reads rows 2j, 2j+1 of panel c: the programs'
pieces are adjacent, so the launch sweeps panel after panel in address order, as XLA's row reductions (4.75 TB/s
steady against Pallas' 4.05, RESULTS.md "MoE, session 3") sweep theirs. Same bytes, same products, same order of
summation (per row: BK-chunks in order), so results are identical to the row layout's.

Timing without extra copies: each layer's wg/wu (and sg/su) memory is read as panels by the panel kernel and as
rows by the production kernel (the values differ per interpretation, the access pattern is each layout's own);
every variant is checked against the reference on the weights as it interprets them (layer 0 re-laid-out for the
check only).

Result (RESULTS.md, "Session 9", S9 8): no gain. Panels of BK 512 ran gate/up in 17.15-17.18 µs against 17.18-17.22
for rows in the same call (BK 256: 18.8, BK 128: 25.3): the kernel is not limited by the DRAM locality of its reads.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_panels.py --set s9c8`; `--toy`: a CPU smoke
run in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_splitk as ps
import probe_moe_t1 as pt
from pallas_kernels.common import interpret_mode
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

TU = ex.DECODE_TUNING


def as_panels(w, bk):
    """The memory of w [.., I, D] read as panels [.., D/BK, I, BK] (a reshape: no data moves)."""
    *lead, i, d = w.shape
    return w.reshape(*lead, d // bk, i, bk)


def panels_to_rows(p):
    """The logical [.., I, D] matrix that panels [.., D/BK, I, BK] hold (a copy; for the reference check)."""
    *lead, nc, i, bk = p.shape
    nd = len(lead)
    return jnp.moveaxis(p, nd, nd + 1).reshape(*lead, i, nc * bk)


def gate_up_panels_kernel(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, *, BK, n_chunks, n_routed, limit,
                          shared_limit, eviction):
    # wg_ref/wu_ref [E, D/BK, I, BK]; sg_ref/su_ref [D/BK, I, BK]; h_ref [1, BI]; grid (K + 1 slots, I / BI)
    s, j = pl.program_id(0), pl.program_id(1)
    bi = h_ref.shape[1]
    e, owner = ex._ownership(ids_ref[...], s, n_routed)
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)
    whole = pl.ds(0, BK)

    def panel(ks):
        return ks.start // BK  # ks = pl.ds(c·BK, BK) from ex._gate_up_rows

    def compute(load_g, load_u, lim):
        h_ref[...] = ex._gate_up_rows(x_ref, load_g, load_u, BK=BK, n_chunks=n_chunks, bi=bi, to=1,
                                      mode=TU.t1_gate_up, limit=lim, dt=h_ref.dtype)

    @pl.when(owner)
    def _():
        compute(lambda ks: ex._load(wg_ref, (e, panel(ks), rows, whole), eviction),
                lambda ks: ex._load(wu_ref, (e, panel(ks), rows, whole), eviction), limit)

    @pl.when(s == n_routed)
    def _():
        compute(lambda ks: sg_ref[panel(ks), rows, whole], lambda ks: su_ref[panel(ks), rows, whole], shared_limit)


def gate_up_panels(x, ids, wg, wu, sg, su, *, bk, bi=TU.block_i, warps=TU.warps_gate_up, stages=TU.stages_gate_up):
    """experts.moe_experts_fused's T = 1 gate/up launch over panel-laid-out weights -> h [K + 1, 1, I]."""
    _, d = x.shape
    i = sg.shape[1]
    k = ids.shape[1]
    return pl.pallas_call(
        functools.partial(gate_up_panels_kernel, BK=bk, n_chunks=d // bk, n_routed=k, limit=pt.LIMITS["limit"],
                          shared_limit=pt.LIMITS["shared_limit"], eviction=TU.routed_eviction),
        grid=(k + 1, i // bi), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret_mode(), name="experts_fwd_kernel_gate_up_panels",
    )(x, ids.reshape(-1), wg, wu, sg, su)


def panels_layer(bk, **kw):
    def f(x, lay):
        bk_ = min(bk, x.shape[1])
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW,
                                  prefetch=(lay["sg"], lay["su"], lay["sd"]))
        h = gate_up_panels(x, ids, *(as_panels(lay[n], bk_) for n in ("wg", "wu", "sg", "su")), bk=bk_, **kw)
        return ex.down_and_combine(h, ids, w, lay["wd"], lay["sd"], n=1, tuning=TU)
    return f


def panels_reference(bk):
    """The reference layer on the weights as the panel kernel reads them."""
    def ref(x, lay):
        bk_ = min(bk, x.shape[1])
        logical = {n: panels_to_rows(as_panels(lay[n], bk_)) for n in ("wg", "wu", "sg", "su")}
        return pt.reference_layer(x, {**lay, **logical})
    return ref


VARIANTS = {
    "s9c8": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        ("dep: gate/up panels BK 512", panels_layer(512), panels_reference(512)),
        ("dep: gate/up panels BK 256", panels_layer(256), panels_reference(256)),
        ("dep: gate/up panels BK 128", panels_layer(128), panels_reference(128)),
        ("dep: gate/up panels BK 512, 4 rows 2 warps", panels_layer(512, bi=4, warps=2), panels_reference(512)),
        ("dep: gate/up panels BK 256, 2 stages", panels_layer(256, stages=2), panels_reference(256)),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
        ("dep: gate/up panels BK 512 again", panels_layer(512), panels_reference(512)),
    ],
}


if __name__ == "__main__":
    ps.run_sets("probe_moe_panels", VARIANTS, "s9c8")
