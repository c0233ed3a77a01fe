"""Probe: T = 1 gate/up with small programs, and a down projection over [E, D, I] (torch layout) that also does the
whole combine (no XLA fusion after it): each program owns BD output rows and walks the 8 routed slots and the
shared expert, reading [BD, I] contiguous blocks. Device time per kernel (JAX profiler), NL = 8 cold Flash-size
layers, each variant checked compiled against the reference first.

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_moe_down_rows.py`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_header  # noqa: E402
from probe_moe_t1 import D, I, K, LIMITS, ROUTE_KW, make_layers, record_row, reference_layer  # noqa: E402

from pallas_kernels.moe import experts as ex  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402
from pallas_kernels.moe.experts import ExpertsTuning  # noqa: E402

ROUTER = router_mod.DECODE_TUNING


def down_rows_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, y_ref, *, BKI, n_chunks):
    # h_ref [K + 1, 1, I]; ids_ref/w_ref [1, K]; wd_ref [E, D, I]; sd_ref [D, I]; y_ref [1, BD] compute dtype
    bd = y_ref.shape[1]
    dt = wd_ref.dtype
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
    ids, wts = ids_ref[0, :], w_ref[0, :]
    k = ids.shape[0]
    i_k = lax.iota(jnp.int32, k)

    def expert(load_w, s):
        def body(c, acc):
            ks = pl.ds(pl.multiple_of(c * BKI, BKI), BKI)
            return acc + jnp.sum(load_w(ks).astype(jnp.float32) * h_ref[s, :, ks].astype(jnp.float32), axis=1)
        return lax.fori_loop(0, n_chunks, body, jnp.zeros((bd,), jnp.float32)).astype(dt).astype(jnp.float32)

    def slot(s, tot):
        e = jnp.sum(jnp.where(i_k == s, ids, 0))
        owner = jnp.min(jnp.where(ids == e, i_k, k)) == s  # a repeated id: its first slot takes both weights
        w_e = jnp.where(owner, jnp.sum(jnp.where(ids == e, wts, 0.0)), 0.0)
        return tot + w_e * expert(lambda ks: wd_ref[e, rows, ks], s)

    routed = lax.fori_loop(0, k, slot, jnp.zeros((bd,), jnp.float32)).astype(dt)
    y_ref[0, :] = routed + expert(lambda ks: sd_ref[rows, ks], k).astype(dt)


def gate_up_h(x, ids, wg, wu, sg, su, tu):
    n_slots, bi, bk = K + 1, tu.block_i, tu.block_k
    return pl.pallas_call(
        functools.partial(ex.experts_fwd_kernel_gate_up, BK=bk, n_chunks=D // bk, n_routed=K, limit=4.0,
                          shared_limit=5.0, has_shared=True, mode=tu.t1_gate_up),
        grid=(n_slots, I // bi), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_slots, 1, I), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tu.warps_gate_up, num_stages=tu.stages_gate_up),
        name="experts_fwd_kernel_gate_up")(x, ids.reshape(-1), wg, wu, sg, su)


def with_down_rows(tu, bd, bki, warps):
    def f(x, lay):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=ROUTER)
        h = gate_up_h(x, ids, lay["wg"], lay["wu"], lay["sg"], lay["su"], tu)
        return pl.pallas_call(
            functools.partial(down_rows_kernel, BKI=bki, n_chunks=I // bki), grid=(D // bd,),
            in_specs=[pl.no_block_spec] * 5, out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((1, D), x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3),
            name="experts_fwd_kernel_down_rows")(h, ids, w, lay["wd_rows"], lay["sd_rows"])
    return f


def separate(tu):
    def f(x, lay):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=ROUTER)
        return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                    **LIMITS, tuning=tu)
    return f


E_ = ExpertsTuning
FR = "fma_reduce"
GATE_UP = [("fma_reduce BI8 BK512 w4", E_(t1_gate_up=FR, block_i=8, block_k=512)),
           ("fma_reduce BI4 BK512 w2", E_(t1_gate_up=FR, block_i=4, block_k=512, warps_gate_up=2)),
           ("fma_reduce BI4 BK512 w4", E_(t1_gate_up=FR, block_i=4, block_k=512)),
           ("fma_reduce BI2 BK512 w1", E_(t1_gate_up=FR, block_i=2, block_k=512, warps_gate_up=1)),
           ("fma_reduce BI4 BK512 w1", E_(t1_gate_up=FR, block_i=4, block_k=512, warps_gate_up=1)),
           ("fma_reduce BI8 BK512 w8", E_(t1_gate_up=FR, block_i=8, block_k=512, warps_gate_up=8)),
           ("fma BI4 BK512 w2", E_(block_i=4, block_k=512, warps_gate_up=2)),
           ("fma BI2 BK512 w1", E_(block_i=2, block_k=512, warps_gate_up=1))]
DOWN_ROWS = [(8, 256, 4), (8, 256, 2), (4, 256, 2), (4, 256, 1), (16, 256, 4), (8, 128, 2), (2, 256, 1)]


def main():
    results = {**run_header(), "rows": []}
    x, layers = make_layers()
    for lay in layers:
        lay["wd_rows"] = jnp.swapaxes(lay["wd"], 1, 2) + 0  # [E, D, I]
        lay["sd_rows"] = jnp.swapaxes(lay["sd"], 0, 1) + 0

    def record(label, fn):
        record_row(results, "probe_moe_down_rows.json", label, fn, x, layers, reference_layer)

    for label, tu in GATE_UP:
        record(f"gate/up {label}", separate(tu))
    best_gu = E_(t1_gate_up=FR, block_i=4, block_k=512, warps_gate_up=2)
    for bd, bki, warps in DOWN_ROWS:
        record(f"down rows BD{bd} BKI{bki} w{warps}", with_down_rows(best_gu, bd, bki, warps))


if __name__ == "__main__":
    main()
