"""Probe: the T = 1 MoE layer in three launches, with the router's top-k as the last GEMV program's tail.

Session 4 (probe_moe_fused_router.py, call S4 1) measured the three-launch layer with the *unsplit* router GEMV
(256 two-row programs): 38.5 µs against 38.1 for the five-launch defaults, its first kernel 9.7 µs because the
one-warp top-k tail took ~5 µs after the GEMV. Since then the GEMV reads D-splits (2560 one-warp programs, 3.1 µs).
Here:
  K1  split router GEMV programs (expert-major) + the shared expert's gate/up programs after them; the last GEMV
      program to arrive (acq_rel counter) sums the KS partials and runs the grouped top-k while the shared rows
      stream. Top-k variants: "cur" (router._select_topk) and "lean" (group top-2 from max + a count of the
      maximum + the max below it, independent reductions instead of argmax-dependent ones; weights gathered per
      pick beside the next argmax pass instead of one [K, E] reduction).
  K2  the routed gate/up (probe_moe_fused_router.routed_gate_up).
  K3  down with the combine done by the last program of each column block (probe_moe_fused_router.down_combine).
Also the top-k kernel alone over warps and variants against a kernel that only sums the partials (its floor), and
the five-launch defaults for reference in the same run. Counters are "keep" buffers (the kernels restore them).

Run on the GPU: `XLA_FLAGS=--xla_allow_excess_precision=false PYTHONPATH=. python3 experiments/probe_moe_three.py`
(`--toy`: a CPU smoke run in interpret mode).
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
import probe_moe_fused_router as pf  # noqa: E402
import probe_moe_t1 as pt  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

OUT = "probe_moe_three.json"


def select_topk_lean(logits, bias, *, topk_group, top_k, scale, norm):
    """router._select_topk with shorter dependency chains (same selection and weights, bit for bit)."""
    n_group, gsz = logits.shape
    e = n_group * gsz
    s = jax.nn.sigmoid(logits)
    choice = s + bias
    neg = jnp.float32(-jnp.inf)
    m1 = jnp.max(choice, axis=1)
    # top-2 sum: a duplicated maximum counts twice (lax.top_k); the count and the max below m1 are independent
    n_max = jnp.sum((choice == m1[:, None]).astype(jnp.int32), axis=1)
    below = jnp.max(jnp.where(choice < m1[:, None], choice, neg), axis=1)
    g_score = m1 + jnp.where(n_max > 1, m1, below)
    gi = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 0)
    gj = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 1)
    sc_g, sc_h = g_score[:, None], g_score[None, :]
    rank = jnp.sum(((sc_h > sc_g) | ((sc_h == sc_g) & (gj < gi))).astype(jnp.int32), axis=1)
    masked = jnp.where((rank < topk_group)[:, None], choice, neg).reshape(e)
    s_flat = s.reshape(e)
    i_e = lax.iota(jnp.int32, e)
    i_k = lax.iota(jnp.int32, top_k)
    ids = jnp.zeros((top_k,), jnp.int32)
    w = jnp.zeros((top_k,), jnp.float32)
    for k in range(top_k):
        ik = jnp.argmax(masked).astype(jnp.int32)
        hit = i_e == ik
        ids = jnp.where(i_k == k, ik, ids)
        w = jnp.where(i_k == k, jnp.sum(jnp.where(hit, s_flat, 0.0)), w)  # off the next pass's chain
        masked = jnp.where(hit, neg, masked)
    if norm:
        w = w / (jnp.sum(w) + 1e-20)
    return w * scale, ids


TOPK = {"cur": router_mod._select_topk, "lean": select_topk_lean}


def k1_kernel(x_ref, w_ref, b_ref, cnt_ref, sg_ref, su_ref, lg_ref, wt_ref, id_ref, *h_out, KS, BK, n_gemv, BI,
              shared, topk):
    # x_ref [1, D]; w_ref [E, D] fp32; b_ref [G, E/G]; cnt_ref [1] int32 (kept at 0 between calls)
    # lg_ref [KS, G, E/G] fp32 partial logits; wt_ref/id_ref [1, K]; h_out: ([S, 1, I] compute dtype) if shared
    p = pl.program_id(0)

    @pl.when(p < n_gemv)
    def _():
        pf._split_gemv_logits(x_ref, w_ref, lg_ref, p, KS=KS, BE=1, BK=BK)
        pf._last_arrival_topk(cnt_ref, n_gemv, wt_ref, id_ref, lambda: TOPK[topk](
            pf._sum_split_logits(lg_ref, KS), b_ref[...], **pf.SELECT_KW))

    if shared:
        @pl.when(p >= n_gemv)
        def _():
            pf._shared_gate_up(x_ref, sg_ref, su_ref, h_out[0], p - n_gemv, BI)


def k1(x, lay, *, KS=5, BK=512, shared=True, topk="lean", BI=2, stages=3):
    e, d = lay["router"].shape
    g = pf.G
    KS = router_mod._split_count(d, KS)
    n_gemv = e * KS
    BK = min(BK, (d // KS) & -(d // KS))
    outs = [jax.ShapeDtypeStruct((KS, g, e // g), jnp.float32), jax.ShapeDtypeStruct((1, pt.K), jnp.float32),
            jax.ShapeDtypeStruct((1, pt.K), jnp.int32)]
    if shared:
        outs.append(jax.ShapeDtypeStruct((pt.K + 1, 1, pt.I), x.dtype))
    res = pl.pallas_call(
        functools.partial(k1_kernel, KS=KS, BK=BK, n_gemv=n_gemv, BI=BI, shared=shared, topk=topk),
        grid=(n_gemv + (pt.I // BI if shared else 0),),
        in_specs=[pl.no_block_spec] * 6, out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
        interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=stages),
        name="moe_k1_router_shared",
    )(x, lay["router"], lay["bias"].reshape(g, e // g), pf._counter(True, 1), lay["sg"], lay["su"])
    return res[1], res[2], (res[3] if shared else None)


def three_launch(**k1_kw):
    def f(x, lay):
        w, ids, h = k1(x, lay, **k1_kw)
        h = pf.routed_gate_up(x, ids, h, lay)
        return pf.down_combine(h, w, ids, lay, pf._counter(True, pt.D // 64), True)
    return f


def k1_router_only(**k1_kw):
    return lambda x, lay: k1(x, lay, shared=False, **k1_kw)[:2]


def topk_kernel(p_ref, b_ref, w_ref, i_ref, *, topk):
    if topk == "sum":  # the floor: read and sum the partials, store 8 of them
        lg = router_mod._sum_partials(p_ref)
        w_ref[0, :] = lg[0, :pt.K]
        i_ref[0, :] = lg[1, :pt.K].astype(jnp.int32)
        return
    w, ids = TOPK[topk](router_mod._sum_partials(p_ref), b_ref[...], **pf.SELECT_KW)
    w_ref[0, :] = w
    i_ref[0, :] = ids


def route_with_topk(topk, warps):
    """The default split GEMV, then the top-k kernel `topk` with `warps` warps."""
    tu = router_mod.DECODE_TUNING

    def f(x, lay):
        e, d = lay["router"].shape
        ks = router_mod._split_count(d, tu.k_splits)
        dk = d // ks
        bk = min(tu.block_k, dk & -dk)
        partial = pl.pallas_call(
            functools.partial(router_mod.router_fwd_kernel_gemv, BK=bk, n_chunks=dk // bk, mode=tu.t1_gemv),
            grid=(e, ks, 1),
            in_specs=[pl.BlockSpec((1, dk), lambda j, k, i: (i, k)), pl.BlockSpec((1, dk), lambda j, k, i: (j, k))],
            out_specs=pl.BlockSpec((None, 1, 1), lambda j, k, i: (k, i, j)),
            out_shape=jax.ShapeDtypeStruct((ks, 1, e), jnp.float32),
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=tu.num_stages),
            interpret=interpret_mode(), name="router_fwd_kernel_gemv")(x, lay["router"])
        g = pf.G
        return pl.pallas_call(
            functools.partial(topk_kernel, topk=topk), grid=(1,),
            in_specs=[pl.BlockSpec((ks, None, g, e // g), lambda i: (0, i, 0, 0)),
                      pl.BlockSpec((g, e // g), lambda i: (0, 0))],
            out_specs=[pl.BlockSpec((1, pt.K), lambda i: (i, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((1, pt.K), jnp.float32), jax.ShapeDtypeStruct((1, pt.K), jnp.int32)],
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
            interpret=interpret_mode(), name=f"router_topk_{topk}_w{warps}",
        )(partial.reshape(ks, 1, g, e // g), lay["bias"].reshape(g, e // g))
    return f


def race_check(layers, n_tok, **k1_kw):
    """ids of n_tok sequential single-token K1 calls vs the reference: tokens with any id different."""
    lay = layers[0]
    xs = jax.random.normal(jax.random.key(7), (n_tok, 1, pt.D), jnp.bfloat16)
    got = jax.jit(lambda xs: lax.map(lambda x: k1(x, lay, shared=False, **k1_kw)[1], xs))(xs)
    ref = jax.jit(lambda xs: lax.map(
        lambda x: reference.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)[1], xs))(xs)
    return int(np.sum(np.any(np.asarray(got) != np.asarray(ref), axis=-1)))


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--race-tokens", type=int, default=1024)
    args = ap.parse_args()
    results = {**run_header(), "rows": []}
    if args.toy:
        OUT = "probe_moe_three_toy.json"
        x, layers = pf.toy_layers()
        for mod in (pt,):
            mod.TO_REPO = False
    else:
        x, layers = pt.make_layers()
    for lay in layers:
        lay["router_t"] = lay["router"]

    def ref_route(x, lay):
        return reference.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)

    def rec(label, fn, check=pt.reference_layer):
        pt.record_row(results, OUT, label, fn, x, layers, check)

    for topk in ("cur", "lean"):
        n_bad = race_check(layers, 64 if args.toy else args.race_tokens, topk=topk)
        print(f"race check K1 topk={topk}: {n_bad} tokens with different ids", flush=True)
        results[f"race_{topk}"] = n_bad
    rec("five launches (defaults)", pt.separate())
    for topk in ("sum", "cur", "lean"):
        for warps in (1, 2, 4, 8):
            rec(f"route: split GEMV + topk {topk} w{warps}", route_with_topk(topk, warps),
                None if topk == "sum" else ref_route)
    for topk in ("cur", "lean"):
        for ks in (5, 4):
            rec(f"K1 router only, topk {topk} KS{ks}", k1_router_only(topk=topk, KS=ks), ref_route)
    for topk in ("cur", "lean"):
        rec(f"three launches, topk {topk}", three_launch(topk=topk))
    rec("three launches, topk lean KS4", three_launch(topk="lean", KS=4))
    rec("three launches, topk lean, shared BI1", three_launch(topk="lean", BI=1))
    rec("five launches (defaults), again", pt.separate())
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
