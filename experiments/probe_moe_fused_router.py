"""Probe: fewer launches for the T = 1 MoE layer with "last program" counters.

Session 3's layer is five kernels (router GEMV, top-k, gate/up, down, XLA combine); two of them (top-k 3.9 µs,
combine 1.5 µs) move almost no bytes. Here:
  K1  router GEMV over the router stored [E, D] (programs read whole fp32 rows), then the last program to finish
      (an atomic counter, released after a CTA barrier) runs the grouped top-k and resets the counter. Optionally
      the shared expert's gate/up programs run in the same grid after the GEMV programs, so the top-k tail
      overlaps their streaming.
  K2  the routed gate/up (shared row already written by K1: the h buffer is aliased through).
  K3  down; optionally the last of the NG + 1 programs of a column block sums the fp32 partials, rounds and adds
      the shared expert (no XLA combine).
Counter: "alias" = a fresh zero buffer aliased in and out (XLA zero-fills it every call); "keep" = a constant
zero buffer the kernel restores (every program that increments it is followed by the last one resetting it).

Also (--sweep static): the session-3 layer with its fixed-count loops written out (loads issued up front) and
fewer pipeline stages.
Run on the GPU: `XLA_FLAGS=--xla_allow_excess_precision=false PYTHONPATH=. python3 experiments/probe_moe_fused_router.py
--sweep c1` (session 4's call 1), `--sweep static` (call 2).

As run: with W_down stored [E, I, D] and pallas_kernels/moe/experts.py of its commit (RESULTS.md names it).
Session 10 stores W_down [E, D, I] (probe_moe_t1.make_layers too) and removed `experts._down_cols` / `_dot`;
run this probe at its commit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_t1 import (D, I, K, E, LIMITS, ROUTE_KW, make_layers, record_row,  # noqa: E402
                          reference_layer, separate)

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import experts as ex  # noqa: E402
from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

G = ROUTE_KW["n_group"]
SELECT_KW = dict(topk_group=ROUTE_KW["topk_group"], top_k=K, scale=ROUTE_KW["routed_scaling_factor"], norm=True)
OUT = "probe_moe_fused_router.json"


def _arrive(cnt_ref, idx):
    """Release everything this program stored (CTA barrier: every thread's stores precede thread 0's acq_rel
    atomic), then count the arrival; returns the old count."""
    if not interpret_mode():  # interpreted programs run one after another
        pltriton.debug_barrier()
    return pltriton.atomic_add(cnt_ref, (jnp.asarray(idx, jnp.int32),), jnp.int32(1))


def _vload(ref):
    """A load that sees other programs' stores (volatile; interpreted programs run one after another)."""
    return ref[...] if interpret_mode() else pltriton.load(ref, volatile=True)


def _split_gemv_logits(x_ref, w_ref, lg_ref, p, *, KS, BE, BK):
    """Program p's partial logits: expert rows [b·BE, (b+1)·BE) (b = p // KS) over D-split k = p % KS of the fp32
    router w_ref [E, D], into lg_ref[k] ([KS, G, E/G])."""
    blk, k = p // KS, p % KS
    dk = x_ref.shape[1] // KS
    rows = pl.ds(pl.multiple_of(blk * BE, BE), BE)

    def body(c, acc):
        ks = pl.ds(pl.multiple_of(k * dk + c * BK, BK), BK)
        return acc + jnp.sum(w_ref[rows, ks] * x_ref[:, ks].astype(jnp.float32), axis=1)

    e0, gsz = blk * BE, lg_ref.shape[2]
    lg_ref[k, e0 // gsz, pl.ds(pl.multiple_of(e0 % gsz, BE), BE)] = lax.fori_loop(
        0, dk // BK, body, jnp.zeros((BE,), jnp.float32))


def _sum_split_logits(lg_ref, KS):
    """The KS partial logits of lg_ref [KS, G, E/G] summed in split order (one power-of-two block per load)."""
    logits = _vload(lg_ref.at[jnp.int32(0)])
    for j in range(1, KS):
        logits = logits + _vload(lg_ref.at[jnp.int32(j)])
    return logits


def _shared_gate_up(x_ref, sg_ref, su_ref, h_ref, q, BI, BK=512):
    """Shared expert's gate/up + SwiGLU for intermediate rows block q (BI rows) into h_ref[K] ([S, 1, I])."""
    rows = pl.ds(pl.multiple_of(q * BI, BI), BI)
    bk = min(BK, x_ref.shape[1])
    h_ref[K, :, rows] = ex._gate_up_rows(
        x_ref, lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], BK=bk, n_chunks=x_ref.shape[1] // bk,
        bi=BI, to=1, mode="fma_reduce", limit=LIMITS["shared_limit"], dt=h_ref.dtype)


def _gemv_logits(x_ref, w_ref, lg_ref, p, BE, BK):
    """Program p's BE logits (rows [p·BE, (p+1)·BE) of the fp32 router w_ref [E, D], whole rows) into lg_ref
    [G, E/G]."""
    rows = pl.ds(pl.multiple_of(p * BE, BE), BE)

    def body(c, acc):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        return acc + jnp.sum(w_ref[rows, ks] * x_ref[0, ks].astype(jnp.float32)[None, :], axis=1)

    gsz = lg_ref.shape[1]
    lg_ref[(p * BE) // gsz, pl.ds(pl.multiple_of((p * BE) % gsz, BE), BE)] = lax.fori_loop(
        0, x_ref.shape[1] // BK, body, jnp.zeros((BE,), jnp.float32))


def _last_arrival_topk(cnt_ref, n_gemv, wt_ref, id_ref, select):
    """Counts this GEMV program's arrival; the last of the n_gemv runs select() -> (weights, ids) on the logits
    they stored, publishes them and resets the counter (zero again for the next call)."""
    @pl.when(_arrive(cnt_ref, 0) == n_gemv - 1)
    def _():
        w, ids = select()
        wt_ref[0, :] = w
        id_ref[0, :] = ids
        cnt_ref[0] = jnp.int32(0)


def router_kernel(x_ref, w_ref, b_ref, cnt_ref, sg_ref, su_ref, *outs, BE, BK, n_gemv, BI, shared, keep):
    # x_ref [1, D]; w_ref [E, D] fp32; b_ref [G, E/G]; cnt_ref [1] int32; sg/su [I, D]
    # outs: logits [G, E/G] fp32, weights [1, K], ids [1, K], (h [S, 1, I] if shared), (cnt out unless keep)
    lg_ref, wt_ref, id_ref = outs[:3]
    p = pl.program_id(0)

    @pl.when(p < n_gemv)
    def _():
        _gemv_logits(x_ref, w_ref, lg_ref, p, BE, BK)
        _last_arrival_topk(cnt_ref, n_gemv, wt_ref, id_ref, lambda: router_mod._select_topk(
            pltriton.load(lg_ref, volatile=True), b_ref[...], **SELECT_KW))

    if shared:
        @pl.when(p >= n_gemv)
        def _():
            _shared_gate_up(x_ref, sg_ref, su_ref, outs[3], p - n_gemv, BI)


def fused_route(x, router_t, bias, sg, su, cnt, *, BE=2, BK=512, warps=1, shared=False, keep=False, BI=2):
    n_gemv, BK = E // BE, min(BK, D)
    outs = [jax.ShapeDtypeStruct((G, E // G), jnp.float32), jax.ShapeDtypeStruct((1, K), jnp.float32),
            jax.ShapeDtypeStruct((1, K), jnp.int32)]
    if shared:
        outs.append(jax.ShapeDtypeStruct((K + 1, 1, I), x.dtype))
    aliases = {}
    if not keep:
        aliases = {3: len(outs)}
        outs.append(jax.ShapeDtypeStruct(cnt.shape, jnp.int32))
    res = pl.pallas_call(
        functools.partial(router_kernel, BE=BE, BK=BK, n_gemv=n_gemv, BI=BI, shared=shared, keep=keep),
        grid=(n_gemv + (I // BI if shared else 0),),
        in_specs=[pl.no_block_spec] * 6, out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
        input_output_aliases=aliases,
        interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3), name="moe_router_fused",
    )(x, router_t, bias.reshape(G, E // G), cnt, sg, su)
    return res[1], res[2], (res[3] if shared else None)


def _counter(keep, n):
    # keep: a jit-time constant the kernel leaves at zero; alias: XLA fills a fresh buffer every call
    return jnp.asarray(np.zeros(n, np.int32)) if keep else jnp.zeros((n,), jnp.int32)


def routed_gate_up(x, ids, h, lay, tuning=ex.DECODE_TUNING):
    bi, bk = tuning.block_i, min(tuning.block_k, D)
    kern = functools.partial(ex.experts_fwd_kernel_gate_up, BK=bk, n_chunks=D // bk, n_routed=K,
                             limit=LIMITS["limit"], shared_limit=0.0, has_shared=False, mode=tuning.t1_gate_up)
    dummy = jnp.zeros((1, 1), x.dtype)
    return pl.pallas_call(
        lambda x_r, i_r, g_r, u_r, sg_r, su_r, _h_in, h_out: kern(x_r, i_r, g_r, u_r, sg_r, su_r, h_out),
        grid=(K, I // bi), in_specs=[pl.no_block_spec] * 7,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)), out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        input_output_aliases={6: 0},
        interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        name="experts_fwd_kernel_gate_up",
    )(x, ids.reshape(-1), lay["wg"], lay["wu"], dummy, dummy, h)


def down_combine_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, cnt_ref, part_ref, y_ref, *outs, BKI, keep):
    g, i_d = pl.program_id(0), pl.program_id(1)
    bd = 64
    cols = pl.ds(pl.multiple_of(i_d * bd, bd), bd)
    dt = wd_ref.dtype

    def expert_out(s, load_d):
        return ex._down_cols(lambda ks: h_ref[s, :, ks], load_d, BKI=BKI, n_chunks=I // BKI, bd=bd, to=1, dt=dt)

    @pl.when(g < K)
    def _():
        ids_flat = ids_ref[...]
        e, owner = ex._ownership(ids_flat, g, K)
        w_tok = jnp.sum(jnp.where(ids_flat == e, w_ref[...], 0.0))  # a repeated id gets both weights

        @pl.when(owner)
        def _():
            part_ref[g, :, cols] = w_tok * expert_out(g, lambda ks: wd_ref[e, ks, cols])

        @pl.when(jnp.logical_not(owner))
        def _():
            part_ref[g, :, cols] = jnp.zeros((1, bd), jnp.float32)

    @pl.when(g == K)
    def _():
        part_ref[K, :, cols] = expert_out(K, lambda ks: sd_ref[ks, cols])

    @pl.when(_arrive(cnt_ref, i_d) == K)  # the last of the K + 1 slot programs of this column block
    def _():
        routed = pltriton.load(part_ref.at[jnp.int32(0), :, cols], volatile=True)
        for s in range(1, K):
            routed = routed + pltriton.load(part_ref.at[jnp.int32(s), :, cols], volatile=True)
        shared = pltriton.load(part_ref.at[jnp.int32(K), :, cols], volatile=True)
        y_ref[:, cols] = routed.astype(dt) + shared.astype(dt)
        cnt_ref[i_d] = jnp.int32(0)


def down_combine(h, w, ids, lay, cnt, keep, BKI=256):
    n_cols, BKI = D // 64, min(BKI, I)
    outs = [jax.ShapeDtypeStruct((K + 1, 1, D), jnp.float32), jax.ShapeDtypeStruct((1, D), h.dtype)]
    aliases = {}
    if not keep:
        aliases = {5: 2}
        outs.append(jax.ShapeDtypeStruct(cnt.shape, jnp.int32))
    res = pl.pallas_call(
        functools.partial(down_combine_kernel, BKI=BKI, keep=keep), grid=(K + 1, n_cols),
        in_specs=[pl.no_block_spec] * 6, out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
        input_output_aliases=aliases,
        interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3), name="experts_fwd_kernel_down_combine",
    )(h, ids.reshape(-1), w.reshape(-1), lay["wd"], lay["sd"], cnt)
    return res[1]


def down_xla_combine(h, w, ids, lay, tuning=ex.DECODE_TUNING):
    bki = min(tuning.block_ki, I)
    kern = functools.partial(ex.experts_fwd_kernel_down, BKI=bki, n_chunks=I // bki, n_routed=K, group=1,
                             n_groups=K)
    parts = pl.pallas_call(
        kern, grid=(K + 1, D // tuning.block_d), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, tuning.block_d), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((K + 1, 1, D), jnp.float32),
        interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        name="experts_fwd_kernel_down",
    )(h, ids.reshape(-1), ids, w, lay["wd"], lay["sd"])
    return (jnp.sum(parts[:K], axis=0).astype(h.dtype) + parts[K].astype(h.dtype))


def fused_layer(keep=True, shared=True, fuse_combine=True, **rk):
    def f(x, lay):
        w, ids, h = fused_route(x, lay["router_t"], lay["bias"], lay["sg"], lay["su"], _counter(keep, 1),
                                shared=shared, keep=keep, **rk)
        if not shared:
            return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"],
                                        lay["sd"], **LIMITS)
        h = routed_gate_up(x, ids, h, lay)
        if fuse_combine:
            return down_combine(h, w, ids, lay, _counter(keep, D // 64), keep)
        return down_xla_combine(h, w, ids, lay)
    return f


def router_only(keep=True, **rk):
    def f(x, lay):
        return fused_route(x, lay["router_t"], lay["bias"], lay["sg"], lay["su"], _counter(keep, 1), keep=keep,
                           **rk)[:2]
    return f


def race_check(layers, n_tok, keep):
    """ids of n_tok sequential single-token fused-router calls (one kernel each) vs the reference: mismatches."""
    lay = layers[0]
    xs = jax.random.normal(jax.random.key(7), (n_tok, 1, D), jnp.bfloat16)
    fn = router_only(keep)
    got = jax.jit(lambda xs: lax.map(lambda x: fn(x, lay)[1], xs))(xs)
    ref = jax.jit(lambda xs: lax.map(lambda x: reference.route(x, lay["router"], lay["bias"], **ROUTE_KW)[1], xs))(xs)
    return int(np.sum(np.any(np.asarray(got) != np.asarray(ref), axis=-1)))


def chain_probe_setup(prefix, sets, default, only_sep=","):
    """The command line of the probes that time named sets of T = 1 layer variants over the cold chain:
    -> (args, results file name, x, layers, labels from --only). --toy: toy sizes, interpreted, nothing written into
    experiments/results/."""
    import probe_moe_t1

    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--layers", type=int, default=8, help="cold layers in the chain (8: 48 GB of experts)")
    ap.add_argument("--only", default="", help=f"{only_sep!r}-separated labels to run (default: all)")
    ap.add_argument("--set", choices=sorted(sets), default=default)
    args = ap.parse_args()
    if args.toy:
        x, layers = toy_layers()
        return args, f"{prefix}_toy.json", x, layers, _only(args.only, only_sep)
    probe_moe_t1.NL = args.layers
    x, layers = probe_moe_t1.make_layers()
    return args, f"{prefix}_{args.set}.json", x, layers, _only(args.only, only_sep)


def _only(text, sep):
    return [s.strip() for s in text.split(sep) if s.strip()]


def toy_layers():
    global D, I, E, OUT
    OUT = "probe_moe_fused_router_toy.json"
    import probe_moe_t1
    probe_moe_t1.TO_REPO = False  # smoke runs leave experiments/results/ alone
    D, I, E = probe_moe_t1.D, probe_moe_t1.I, probe_moe_t1.E = 256, 64, 64
    probe_moe_t1.NL = 2
    return make_layers()


class _StaticLax:
    """jax.lax with fori_loop written out when its bounds are Python ints (all loads issued up front)."""

    def __getattr__(self, name):
        return getattr(lax, name)

    @staticmethod
    def fori_loop(lo, hi, body, init):
        if not (isinstance(lo, int) and isinstance(hi, int)):
            return lax.fori_loop(lo, hi, body, init)
        for c in range(lo, hi):
            init = body(jnp.int32(c), init)  # an array: pl.multiple_of takes no Python int
        return init


@contextlib.contextmanager
def static_loops():
    ex.lax = _StaticLax()
    ex.moe_experts_fused.clear_cache()
    try:
        yield
    finally:
        ex.lax = lax
        ex.moe_experts_fused.clear_cache()


def static_sweep(rec):
    dec = ex.DECODE_TUNING
    rec("layer: route + experts (defaults)", separate())
    for label, tu in (("defaults", dec), ("gate/up stages 1", dataclasses.replace(dec, stages_gate_up=1)),
                      ("stages 1 both", dataclasses.replace(dec, stages_gate_up=1, stages_down=1)),
                      ("stages 1, BI 1", dataclasses.replace(dec, stages_gate_up=1, block_i=1)),
                      ("stages 1, BI 4", dataclasses.replace(dec, stages_gate_up=1, block_i=4)),
                      ("stages 1, BI 4 w2", dataclasses.replace(dec, stages_gate_up=1, block_i=4, warps_gate_up=2)),
                      ("stages 1 both, BKI 128", dataclasses.replace(dec, stages_gate_up=1, stages_down=1,
                                                                     block_ki=128)),
                      ("stages 1 both, BD 128 w8", dataclasses.replace(dec, stages_gate_up=1, stages_down=1,
                                                                       block_d=128, warps_down=8))):
        with static_loops():
            rec(f"layer: static loops, {label}", separate(tu))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", choices=("c1", "static"), default="static")
    ap.add_argument("--race-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    args = ap.parse_args()
    results = {**run_header(), "rows": []}
    x, layers = toy_layers() if args.toy else make_layers()
    layers = layers[:args.layers]
    for lay in layers:
        lay["router_t"] = lay["router"]  # stored [E, D]

    def rec(label, fn, check=reference_layer):
        record_row(results, OUT, label, fn, x, layers, check)

    def ref_route(x, lay):
        return reference.route(x, lay["router"], lay["bias"], **ROUTE_KW)

    if args.sweep == "static":
        static_sweep(rec)
        write_results(OUT, results, to_repo=not args.toy)
        return
    for keep in (True, False):
        n_bad = race_check(layers, args.race_tokens, keep)
        print(f"race check keep={keep}: {n_bad} of {args.race_tokens} tokens with different ids", flush=True)
        results[f"race_keep{keep}"] = n_bad
    rec("route (defaults)", lambda x, lay: router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW),
        ref_route)
    for rk in (dict(), dict(BE=4), dict(BE=4, warps=2), dict(BE=8, warps=4), dict(BE=1), dict(BK=256)):
        for keep in (True, False):
            rec(f"fused router keep={keep} {rk}", router_only(keep, **rk), ref_route)
    rec("layer: route + experts (defaults)", separate())
    rec("layer: fused router + experts", fused_layer(shared=False))
    rec("layer: fused router+shared, gate/up, down, XLA combine", fused_layer(fuse_combine=False))
    for keep in (True, False):
        rec(f"layer: fused router+shared, gate/up, down+combine keep={keep}", fused_layer(keep=keep))
    rec("layer: same, BE=4", fused_layer(BE=4))
    for st in (2, 4):
        rec(f"layer: route + experts, gate/up stages {st}",
            separate(dataclasses.replace(ex.DECODE_TUNING, stages_gate_up=st)))
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
