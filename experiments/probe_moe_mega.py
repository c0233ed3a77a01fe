"""Probe: the whole T = 1 MoE layer (router GEMV, top-k, shared + routed gate/up, down) in one Pallas launch.

Why: the session-3 layer is five launches; each costs ~1.7 µs of ramp/tail on top of its bytes, and the top-k
(~2.5-5 µs of serial reductions) stalls the machine between the GEMV and the expert streaming. One launch of
1-warp programs with roles by ticket (an atomic counter at program start, so every program a program waits for
has started: no deadlock whatever order the hardware dispatches in):
  GEMV      E/BE programs: fp32 router rows [BE, D] (router stored [E, D]) -> logits; the last to finish (arrival
            counter) runs the grouped top-k and publishes weights/ids (flag).
  shared    I/BI programs: shared gate/up rows, no wait (they stream while the top-k runs).
  routed    K·I/BI programs: wait for the ids flag, then gate/up rows of their expert.
  down      (K + 1)·D/BD programs: wait until every gate/up program of their slot arrived, then BD columns.
An XLA fusion sums the K weighted fp32 partials, rounds, and adds the shared one (as the session-3 layer).
Handshake: producers store, CTA barrier, then one thread's acq_rel atomic; consumers poll with volatile loads and
issue `fence.acq_rel.gpu` (inline asm) whose result feeds the indices of their dependent loads.
Counters [16] int32: 0 ticket, 1 GEMV arrivals, 2 ids flag, 3..3+K slot arrivals, 15 finished programs.
"keep": one constant zero buffer, reset by the last program to finish; "alias": XLA zero-fills a fresh one per call.

Run on the GPU: `XLA_FLAGS=--xla_allow_excess_precision=false PYTHONPATH=. timeout 280 python3
experiments/probe_moe_mega.py --repeat 32` (session 4's call 4; call 5: `--repeat 16 --variants 0,2,8,9`, which also
runs the top-k + shared rows). A hang would be a handshake bug: keep the timeout.

As run: with W_down stored [E, I, D] and pallas_kernels/moe/experts.py of its commit (RESULTS.md names it).
Session 10 stores W_down [E, D, I] (probe_moe_t1.make_layers too) and removed `experts._down_cols` / `_dot`;
run this probe at its commit.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
import probe_moe_fused_router as fr  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_t1 import K, LIMITS, ROUTE_KW, record_row, reference_layer, separate  # noqa: E402

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import experts as ex  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

OUT = "probe_moe_mega.json"
C_TICKET, C_GEMV, C_IDS, C_SLOT, C_DONE = 0, 1, 2, 3, 15


def _wait(cnt_ref, idx, target):
    """Poll cnt[idx] until >= target, then an acquire fence; returns an int32 zero that depends on the fence
    (added to the indices of the loads that must see the producers' data)."""
    if interpret_mode():  # interpreted programs run in ticket order: every producer is done
        return jnp.int32(0)
    ref = cnt_ref.at[pl.ds(idx, 1)]
    v = lax.while_loop(lambda v: jnp.min(v) < target, lambda v: pltriton.load(ref, volatile=True),
                       pltriton.load(ref, volatile=True))
    fenced, = pltriton.elementwise_inline_asm(
        "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", args=[v], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.minimum(jnp.min(fenced) - target, 0)  # 0 at run time; the compiler cannot know it


def _pick(row, k):
    """Element k (traced) of a [K] vector."""
    return jnp.sum(jnp.where(lax.iota(jnp.int32, row.shape[0]) == k, row, jnp.zeros_like(row)))


def mega_kernel(x_ref, rt_ref, b_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, cnt_ref,
                lg_ref, wt_ref, id_ref, h_ref, part_ref, *maybe_cnt_out, BE, BK, BI, BD, BKI, ticket, keep,
                with_down):
    D = x_ref.shape[1]
    E, I = rt_ref.shape[0], wg_ref.shape[1]
    n_gemv, n_rows, n_cols = E // BE, I // BI, D // BD
    lo_shared = n_gemv
    lo_routed = lo_shared + n_rows
    lo_down = lo_routed + K * n_rows
    total = lo_down + ((K + 1) * n_cols if with_down else 0)
    dt = h_ref.dtype
    t = pltriton.atomic_add(cnt_ref, (jnp.int32(C_TICKET),), jnp.int32(1)) if ticket else pl.program_id(0)

    def gate_up(load_g, load_u, lim):
        return ex._gate_up_rows(x_ref, load_g, load_u, BK=BK, n_chunks=D // BK, bi=BI, to=1, mode="fma_reduce",
                                limit=lim, dt=dt)

    @pl.when(t < lo_shared)
    def _():
        fr._gemv_logits(x_ref, rt_ref, lg_ref, t, BE, BK)

        @pl.when(fr._arrive(cnt_ref, C_GEMV) == n_gemv - 1)
        def _():
            lg = lg_ref[...] if interpret_mode() else pltriton.load(lg_ref, volatile=True)
            w, ids = router_mod._select_topk(lg, b_ref[...], **fr.SELECT_KW)
            wt_ref[0, :] = w
            id_ref[0, :] = ids
            fr._arrive(cnt_ref, C_IDS)

    @pl.when((t >= lo_shared) & (t < lo_routed))
    def _():
        rows = pl.ds(pl.multiple_of((t - lo_shared) * BI, BI), BI)
        h_ref[K, :, rows] = gate_up(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], LIMITS["shared_limit"])
        fr._arrive(cnt_ref, C_SLOT + K)

    @pl.when((t >= lo_routed) & (t < lo_down))
    def _():
        s, j = (t - lo_routed) // n_rows, (t - lo_routed) % n_rows
        zero = _wait(cnt_ref, C_IDS, 1)
        e = _pick(id_ref[0, pl.ds(zero, K)], s)
        rows = pl.ds(pl.multiple_of(j * BI, BI), BI)
        h_ref[s, :, rows] = gate_up(lambda ks: wg_ref[e, rows, ks], lambda ks: wu_ref[e, rows, ks], LIMITS["limit"])
        fr._arrive(cnt_ref, C_SLOT + s)

    @pl.when((t >= lo_down) & with_down)
    def _():
        g, i_d = (t - lo_down) // n_cols, (t - lo_down) % n_cols
        cols = pl.ds(pl.multiple_of(i_d * BD, BD), BD)
        zero = _wait(cnt_ref, C_SLOT + g, n_rows)

        def out(load_d):
            return ex._down_cols(lambda ks: h_ref[g + zero, :, ks], load_d, BKI=BKI, n_chunks=I // BKI, bd=BD, to=1,
                                 dt=dt)

        @pl.when(g < K)
        def _():
            e = _pick(id_ref[0, pl.ds(zero, K)], g)
            part_ref[g, :, cols] = _pick(wt_ref[0, pl.ds(zero, K)], g) * out(lambda ks: wd_ref[e, ks, cols])

        @pl.when(g == K)
        def _():
            part_ref[K, :, cols] = out(lambda ks: sd_ref[ks, cols])

    if keep:  # the last program to finish leaves the counters as it found them: zero
        @pl.when(fr._arrive(cnt_ref, C_DONE) == total - 1)
        def _():
            cnt_ref[...] = jnp.zeros(cnt_ref.shape, jnp.int32)


def mega_layer(keep=True, ticket=True, BE=2, BK=512, BI=2, BD=64, BKI=64, warps=1, stages=3, with_down=True):
    def f(x, lay):
        D = x.shape[1]
        E, I = lay["router_t"].shape[0], lay["wg"].shape[1]
        G = ROUTE_KW["n_group"]
        bk, bki = min(BK, D), min(BKI, I)
        cnt = fr._counter(keep, 16)
        outs = [jax.ShapeDtypeStruct((G, E // G), jnp.float32), jax.ShapeDtypeStruct((1, K), jnp.float32),
                jax.ShapeDtypeStruct((1, K), jnp.int32), jax.ShapeDtypeStruct((K + 1, 1, I), x.dtype),
                jax.ShapeDtypeStruct((K + 1, 1, D), jnp.float32)]
        aliases = {}
        if not keep:
            aliases = {9: len(outs)}
            outs.append(jax.ShapeDtypeStruct((16,), jnp.int32))
        n_prog = E // BE + (K + 1) * (I // BI) + ((K + 1) * (D // BD) if with_down else 0)
        res = pl.pallas_call(
            functools.partial(mega_kernel, BE=BE, BK=bk, BI=BI, BD=BD, BKI=bki, ticket=ticket, keep=keep,
                              with_down=with_down),
            grid=(n_prog,), in_specs=[pl.no_block_spec] * 10, out_specs=[pl.no_block_spec] * len(outs),
            out_shape=outs, input_output_aliases=aliases, interpret=interpret_mode(),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages), name="moe_layer_mega",
        )(x, lay["router_t"], lay["bias"].reshape(G, E // G), lay["wg"], lay["wu"], lay["wd"], lay["sg"],
          lay["su"], lay["sd"], cnt)
        if not with_down:  # the session-3 down kernel + XLA combine
            return fr.down_xla_combine(res[3], res[1], res[2], lay)
        parts = res[4]
        return jnp.sum(parts[:K], axis=0).astype(x.dtype) + parts[K].astype(x.dtype)
    return f


def repeat_check(x, lay, fn, n):
    """n sequential calls (lax.map over different tokens) against the reference layer: the worst relative error."""
    xs = x[None] + 0.5 * jax.random.normal(jax.random.key(3), (n,) + x.shape, x.dtype)
    # lay is an argument, not a closure: closed-over weights would become GBs of HLO constants
    got = jax.jit(lambda xs, lay: lax.map(lambda x: fn(x, lay), xs))(xs, lay)
    ref = jax.jit(lambda xs, lay: lax.map(lambda x: reference_layer(x, lay), xs))(xs, lay)
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(max(np.linalg.norm(g[i] - r[i]) / np.linalg.norm(r[i]) for i in range(n)))


def topk_shared_kernel(lg_ref, b_ref, x_ref, sg_ref, su_ref, wt_ref, id_ref, h_ref, *, BI, BK):
    """Program 0: the grouped top-k; programs 1..I/BI: the shared expert's gate/up rows (they stream while the
    top-k's serial reductions run)."""
    p = pl.program_id(0)

    @pl.when(p == 0)
    def _():
        w, ids = router_mod._select_topk(lg_ref[...], b_ref[...], **fr.SELECT_KW)
        wt_ref[0, :] = w
        id_ref[0, :] = ids

    @pl.when(p > 0)
    def _():
        fr._shared_gate_up(x_ref, sg_ref, su_ref, h_ref, p - 1, BI, BK)


def topk_shared_layer(BI=8, warps=4, BK=512):
    """Router GEMV (2 expert rows per 1-warp program, no D-split) | top-k + shared gate/up | routed gate/up | down |
    XLA combine."""
    def f(x, lay):
        D = x.shape[1]
        E, I = lay["router"].shape[0], lay["wg"].shape[1]
        G, bk = ROUTE_KW["n_group"], min(BK, D)
        logits = pl.pallas_call(
            functools.partial(router_mod.router_fwd_kernel_gemv, BK=bk, n_chunks=D // bk, mode="fma_reduce"),
            grid=(E // 2, 1), in_specs=[pl.BlockSpec((1, D), lambda j, i: (i, 0)), pl.BlockSpec((2, D), lambda j, i: (j, 0))],
            out_specs=pl.BlockSpec((1, 2), lambda j, i: (i, j)), out_shape=jax.ShapeDtypeStruct((1, E), jnp.float32),
            interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=3),
            name="router_fwd_kernel_gemv")(x, lay["router"])
        w, ids, h = pl.pallas_call(
            functools.partial(topk_shared_kernel, BI=BI, BK=bk), grid=(1 + I // BI,),
            in_specs=[pl.no_block_spec] * 5, out_specs=[pl.no_block_spec] * 3,
            out_shape=[jax.ShapeDtypeStruct((1, K), jnp.float32), jax.ShapeDtypeStruct((1, K), jnp.int32),
                       jax.ShapeDtypeStruct((K + 1, 1, I), x.dtype)],
            interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3),
            name="router_topk_shared")(logits.reshape(G, E // G), lay["bias"].reshape(G, E // G), x, lay["sg"], lay["su"])
        h = fr.routed_gate_up(x, ids, h, lay)
        return fr.down_xla_combine(h, w, ids, lay)
    return f


VARIANTS = [("keep ticket", dict()), ("alias ticket", dict(keep=False)), ("keep no-ticket", dict(ticket=False)),
            ("keep BD32 BKI128", dict(BD=32, BKI=128)), ("keep BKI128", dict(BKI=128)),
            ("keep BE1", dict(BE=1)), ("keep stages2", dict(stages=2)), ("keep BD128 BKI32", dict(BD=128, BKI=32)),
            ("keep no-ticket, down separate", dict(ticket=False, with_down=False)),
            ("keep no-ticket stages1", dict(ticket=False, stages=1))]
TOPK_SHARED = [dict(BI=8, warps=4), dict(BI=4, warps=4), dict(BI=4, warps=2), dict(BI=16, warps=4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--repeat", type=int, default=256)
    ap.add_argument("--variants", default="all")
    args = ap.parse_args()
    global OUT
    results = {**run_header(), "rows": []}
    if args.toy:
        OUT = "probe_moe_mega_toy.json"
        x, layers = fr.toy_layers()
    else:
        x, layers = fr.make_layers()
    for lay in layers:
        lay["router_t"] = lay["router"]  # stored [E, D]
    variants = VARIANTS if args.variants == "all" else [VARIANTS[int(i)] for i in args.variants.split(",")]
    print("repeat check: compiling and running (a hang here is a handshake bug)", flush=True)
    err = repeat_check(x, layers[0], mega_layer(), args.repeat)
    print(f"repeat check (keep ticket): worst rel err {err:.2e} over {args.repeat} calls", flush=True)
    results["repeat_worst_err"] = err
    record_row(results, OUT, "layer: route + experts (defaults)", separate(), x, layers, reference_layer)
    for label, kw in variants:
        record_row(results, OUT, f"mega {label}", mega_layer(**kw), x, layers, reference_layer)
    for kw in TOPK_SHARED:
        record_row(results, OUT, f"top-k + shared gate/up {kw}", topk_shared_layer(**kw), x, layers, reference_layer)
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
