"""Probe: the T = 1 MoE layer in two launches.

A streaming launch costs ~2-3 µs beyond its bytes (probe_moe_down_slabs: 35.4 MB read alone 11.7 µs, against
~6 µs of marginal rate inside a bigger launch), and the router's top-k is a 3.2 µs launch of pure latency. Here:
  K1 (W warps)  router GEMV programs (BE rows × one D-split each), then the shared expert's gate/up programs; the
                last GEMV program (acq_rel counter) runs the grouped top-k with all W warps while the shared rows
                still stream, zeroes K2's counters and restores its own.
  K2 (1 warp)   three roles in grid order: shared down (h_shared is complete: no wait), routed gate/up (each
                program counts its rows into a per (slot, row split) counter), routed down (a program owns one
                row split × BD columns of one slot: it loads its W_down tile first, then waits for the split's
                gate/up programs, then reads their h rows). Every down program writes an fp32 partial and counts
                into its column block's counter; the last of the (K + 1)·NR programs of a column block combines:
                each expert's partials summed in split order and rounded (the reference rounds each expert's
                output), weighted fp32 sum in slot order, rounded, plus the shared expert in the compute dtype.
Programs only ever wait on programs with a lower grid index (dispatched earlier), so the waits cannot deadlock.
The sync buffer [256] int32 is zero on entry and on exit of K1 (K1 restores slot 0, zeroes K2's counters).

Run on the GPU: `XLA_FLAGS=--xla_allow_excess_precision=false PYTHONPATH=. python3 experiments/probe_moe_two.py`
(`--toy`: CPU interpret smoke run).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
import probe_moe_fused_router as pf  # noqa: E402
import probe_moe_t1 as pt  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_mega import _wait, repeat_check  # noqa: E402

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import experts as ex  # noqa: E402
from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

OUT = "probe_moe_two.json"
SYNC = 1024  # [0] K1 counter; [256, 512) K2 (slot, row split) counters; [512, 768) K2 column-block counters
C_ROWS, C_COLS = 256, 512


def k1_kernel(x_ref, w_ref, b_ref, sg_ref, su_ref, sync_in, lg_ref, wt_ref, id_ref, h_ref, sync_ref, *, KS, BE,
              BK, n_gemv, BI):
    del sync_in  # aliased to sync_ref
    p = pl.program_id(0)

    @pl.when(p < n_gemv)
    def _():
        pf._split_gemv_logits(x_ref, w_ref, lg_ref, p, KS=KS, BE=BE, BK=BK)

        @pl.when(pf._arrive(sync_ref, 0) == n_gemv - 1)
        def _():
            w, ids = router_mod._select_topk(pf._sum_split_logits(lg_ref, KS), b_ref[...], **pf.SELECT_KW)
            wt_ref[0, :] = w
            id_ref[0, :] = ids
            sync_ref[pl.ds(C_ROWS, 512)] = jnp.zeros((512,), jnp.int32)
            sync_ref[pl.ds(0, 1)] = jnp.zeros((1,), jnp.int32)

    @pl.when(p >= n_gemv)
    def _():
        pf._shared_gate_up(x_ref, sg_ref, su_ref, h_ref, p - n_gemv, BI)


def k1(x, lay, sync, *, warps=4, KS=5, BE=4, BK=512, BI=8, stages=3):
    e, d = lay["router"].shape
    g = pf.G
    KS = router_mod._split_count(d, KS)
    dk = d // KS
    BK = min(BK, dk & -dk)
    n_gemv = (e // BE) * KS
    outs = [jax.ShapeDtypeStruct((KS, g, e // g), jnp.float32), jax.ShapeDtypeStruct((1, pt.K), jnp.float32),
            jax.ShapeDtypeStruct((1, pt.K), jnp.int32), jax.ShapeDtypeStruct((pt.K + 1, 1, pt.I), x.dtype),
            jax.ShapeDtypeStruct(sync.shape, jnp.int32)]  # h: K1 writes the shared row, K2 the routed ones
    res = pl.pallas_call(
        functools.partial(k1_kernel, KS=KS, BE=BE, BK=BK, n_gemv=n_gemv, BI=BI),
        grid=(n_gemv + pt.I // BI,), in_specs=[pl.no_block_spec] * 6, out_specs=[pl.no_block_spec] * len(outs),
        out_shape=outs, input_output_aliases={5: 4}, interpret=interpret_mode(),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages), name="moe_t1_router_shared",
    )(x, lay["router"], lay["bias"].reshape(g, e // g), lay["sg"], lay["su"], sync)
    return res[1], res[2], res[3], res[4]


def k2_kernel(x_ref, id_ref, wt_ref, wg_ref, wu_ref, wd_ref, sd_ref, h_in, sync_in, h_ref, part_ref, y_ref,
              sync_ref, *, BI, BK, BD, NR, limit):
    del h_in, sync_in
    p = pl.program_id(0)
    K = pt.K
    d = x_ref.shape[1]
    i_dim = wg_ref.shape[1]
    n_cols = d // BD
    rs = i_dim // NR  # rows per split
    n_sd, n_gu = NR * n_cols, K * (i_dim // BI)
    dt = h_ref.dtype

    def pick(ref, s):
        row = ref[0, :]
        return jnp.sum(jnp.where(lax.iota(jnp.int32, row.shape[0]) == s, row, jnp.zeros_like(row)))

    def finish_down(s, r, cb, partial):
        cols = pl.ds(pl.multiple_of(cb * BD, BD), BD)
        part_ref[s, r, :, cols] = partial[None, :]

        @pl.when(pf._arrive(sync_ref, C_COLS + cb) == (K + 1) * NR - 1)
        def _():
            routed = jnp.zeros((1, BD), jnp.float32)
            for si in range(K + 1):
                ys = pf._vload(part_ref.at[jnp.int32(si), jnp.int32(0), :, cols])
                for ri in range(1, NR):
                    ys = ys + pf._vload(part_ref.at[jnp.int32(si), jnp.int32(ri), :, cols])
                if si < K:
                    routed = routed + pick(wt_ref, si) * ys.astype(dt).astype(jnp.float32)
                else:
                    y_ref[:, cols] = routed.astype(dt) + ys.astype(dt)

    def down_product(tile, h_rows):
        return jnp.sum(tile.astype(jnp.float32) * h_rows.astype(jnp.float32)[:, None], axis=0)  # [BD]

    @pl.when(p < n_sd)  # shared down: h_shared written by K1
    def _():
        r, cb = p // n_cols, p % n_cols
        rows = pl.ds(pl.multiple_of(r * rs, rs), rs)
        tile = sd_ref[rows, pl.ds(pl.multiple_of(cb * BD, BD), BD)]
        finish_down(K, r, cb, down_product(tile, h_ref[K, 0, rows]))

    @pl.when((p >= n_sd) & (p < n_sd + n_gu))  # routed gate/up
    def _():
        q = p - n_sd
        s, j = q // (i_dim // BI), q % (i_dim // BI)
        e = pick(id_ref, s)
        rows = pl.ds(pl.multiple_of(j * BI, BI), BI)
        h_ref[s, :, rows] = ex._gate_up_rows(
            x_ref, lambda ks: wg_ref[e, rows, ks], lambda ks: wu_ref[e, rows, ks], BK=BK, n_chunks=d // BK, bi=BI,
            to=1, mode="fma_reduce", limit=limit, dt=dt)
        pf._arrive(sync_ref, C_ROWS + s * NR + (j * BI) // rs)

    @pl.when(p >= n_sd + n_gu)  # routed down: tile first, then wait for the split's h rows
    def _():
        q = p - n_sd - n_gu
        s, rem = q // (NR * n_cols), q % (NR * n_cols)
        r, cb = rem // n_cols, rem % n_cols
        e = pick(id_ref, s)
        rows = pl.ds(pl.multiple_of(r * rs, rs), rs)
        tile = wd_ref[e, rows, pl.ds(pl.multiple_of(cb * BD, BD), BD)]
        zero = _wait(sync_ref, C_ROWS + s * NR + r, rs // BI)
        h_rows = pf._vload(h_ref.at[s + zero, 0, rows])
        finish_down(s, r, cb, down_product(tile, h_rows))


def k2(x, w, ids, h, sync, lay, *, BI=2, BK=512, BD=64, NR=12, stages=3):
    d = x.shape[1]
    i_dim = lay["wg"].shape[1]
    rs = i_dim // NR
    if i_dim % NR or rs & (rs - 1) or rs % BI:
        raise ValueError(f"NR={NR} must split I={i_dim} into power-of-two row blocks (multiples of BI={BI})")
    BK = min(BK, d)
    n_prog = NR * (d // BD) + pt.K * (i_dim // BI) + pt.K * NR * (d // BD)
    outs = [jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct((pt.K + 1, NR, 1, d), jnp.float32),
            jax.ShapeDtypeStruct((1, d), x.dtype), jax.ShapeDtypeStruct(sync.shape, jnp.int32)]
    res = pl.pallas_call(
        functools.partial(k2_kernel, BI=BI, BK=BK, BD=BD, NR=NR, limit=pt.LIMITS["limit"]),
        grid=(n_prog,), in_specs=[pl.no_block_spec] * 9, out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
        input_output_aliases={7: 0, 8: 3}, interpret=interpret_mode(),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=stages), name="moe_t1_experts",
    )(x, ids, w, lay["wg"], lay["wu"], lay["wd"], lay["sd"], h, sync)
    return res[2], res[3]


def two_launch(k1_kw=None, k2_kw=None):
    def f(x, lay):
        sync = jnp.zeros((SYNC,), jnp.int32)  # the model threads one through its layers (zero on exit of K1)
        w, ids, h, sync = k1(x, lay, sync, **(k1_kw or {}))
        return k2(x, w, ids, h, sync, lay, **(k2_kw or {}))[0]
    return f


def k1_router_only(**kw):
    def f(x, lay):
        return k1(x, lay, jnp.zeros((SYNC,), jnp.int32), **kw)[:2]
    return f


VARIANTS = [  # (label, K1 kwargs, K2 kwargs)
    ("K1 w4 BE4 BI8, K2 BD64 NR12", dict(), dict()),
    ("K1 w4 BE4 BI4, K2 BD64 NR12", dict(BI=4), dict()),
    ("K1 w2 BE2 BI4, K2 BD64 NR12", dict(warps=2, BE=2, BI=4), dict()),
    ("K1 w4, K2 BD64 NR24", dict(), dict(NR=24)),
    ("K1 w4, K2 BD32 NR12", dict(), dict(BD=32)),
    ("K1 w4, K2 BD64 NR6", dict(), dict(NR=6)),
]


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--repeat", type=int, default=32)
    ap.add_argument("--variants", default=None, help="comma-separated indices into VARIANTS")
    args = ap.parse_args()
    results = {**run_header(), "rows": []}
    if args.toy:
        OUT = "probe_moe_two_toy.json"
        x, layers = pf.toy_layers()
    else:
        x, layers = pt.make_layers()
    variants = VARIANTS if args.variants is None else [VARIANTS[int(i)] for i in args.variants.split(",")]
    if args.toy:  # I = 64: power-of-two row splits only
        variants = [(lb, k1k, {**k2k, "NR": 4 if k2k.get("NR", 12) > 6 else 2}) for lb, k1k, k2k in variants]

    def ref_route(x, lay):
        return reference.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)

    def rec(label, fn, check=pt.reference_layer):
        pt.record_row(results, OUT, label, fn, x, layers, check)

    print("repeat check: compiling and running (a hang here is a handshake bug)", flush=True)
    err = repeat_check(x, layers[0], two_launch(*variants[0][1:]), 4 if args.toy else args.repeat)
    print(f"repeat check: worst rel err {err:.3g} over the calls", flush=True)
    results["repeat_err"] = err
    rec("five launches (defaults)", pt.separate())
    for kw in (dict(), dict(warps=2, BE=2, BI=4), dict(warps=8, BE=8, BI=8)):
        rec(f"K1 router only {kw}", k1_router_only(**kw), ref_route)
    for label, k1_kw, k2_kw in variants:
        rec(f"two launches: {label}", two_launch(k1_kw, k2_kw))
    rec("five launches (defaults), again", pt.separate())
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
