"""Probe: asynchronous bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, pallas_kernels/common/prefetch.py) in the
T = 1 MoE layer's launches.

Session 6 prefetched the shared expert into L2 with loads into registers: the shared rows then came from L2
(gate/up −1.6 µs, down −0.55) but the launch that carried the loads grew by as much. A bulk prefetch is one
instruction per range from one thread, with nothing to wait for, so the launch that issues it should not grow;
the bytes then move while DRAM would otherwise idle. Placements (each layer prefetches only its own weights, so its
timeline span pays for every byte):
  - the shared expert (gate, up, down: 11.8 MB, independent of the routing) from the router GEMV's programs
    (`gemv`: DRAM at ~1.7 TB/s for 3.1 µs) or from extra programs of the top-k launch (`topk`: DRAM idle 3.3 µs);
  - the routed down rows from the gate/up programs (`down_frac` of each expert's rows; program (s, j) prefetches
    the down rows of its own block at its end, `down_where="end"`, to fill the gate/up tail and the down launch's
    ramp, or at its start);
  - each down program prefetching whole rows of its expert at its start (`down_self`: more bytes in flight during
    the down kernel's ramp than its 128-byte column stripes give).
Also: the top-k program prefetching the selected experts' first gate/up rows (`head_rows`), gate/up programs
prefetching their own rows (`gu_self`), experts tunings with the prefetch (s8c3), the down kernel alone on cold and
on L2-resident weights (s8c3), GEMV tunings, a top-k "skeleton" that keeps the launch's memory traffic but not its
selection (a timing control that routes wrongly; s8c4), a top-k ranking each group's top-8 list (s8c5), and the
down kernel's rows split over several programs per column block (s8c7).
Every variant is checked against the reference (a prefetch changes no result: identical error expected).

Result (RESULTS.md, "Session 8"): the top-k launch's extra programs prefetching the shared expert in 120 KiB chunks
took the layer from 36.9-37.2 to 35.4-35.6 µs and went into router.DECODE_TUNING; every other placement lost. A
launch lasts until its prefetched bytes have landed, so the bytes only come free in a launch that waits on latency
anyway (the top-k's selection, ~1.9 µs of its 3.3).

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_bulk_prefetch.py --set s8c1` (session 8's
call 1; s8c2-s8c5: calls 2-5, s8c7: call 7); `--toy`: a CPU smoke run in interpret mode (the prefetches are then
no-ops; it checks the plumbing and the results).

As run: with W_down stored [E, I, D] and pallas_kernels/moe/experts.py of its commit (RESULTS.md names it).
Session 10 stores W_down [E, D, I] (probe_moe_t1.make_layers too) and removed `experts._down_cols` / `_dot`;
run this probe at its commit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_fused_router as pf
import probe_moe_t1 as pt
from bench_common import run_header, write_results
from pallas_kernels.common import interpret_mode
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.common.prefetch import prefetch_l2
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

TU = ex.DECODE_TUNING


def _issue_chunk(pref, q, rows, last):
    """Program-local chunk q of the concatenated [R, D] matrices `pref`, `rows` rows each (R % rows == 0)."""
    if any(r.shape[0] % rows for r in pref):
        raise ValueError(f"prefetch chunks of {rows} rows must divide every matrix's {pref[0].shape[0]} rows")
    per = pref[0].shape[0] // rows
    for m, ref in enumerate(pref):
        @pl.when((q >= m * per) & (q < (m + 1) * per))
        def _():
            d = ref.shape[1]
            prefetch_l2(ref, (q - m * per) * rows * d, rows * d * ref.dtype.itemsize, evict_last=last)


def gemv_pf_kernel(x_ref, w_ref, *refs, BK, n_chunks, mode, n_pref, rows, ks, last, at_end):
    pref, (l_ref,) = refs[:n_pref], refs[n_pref:]
    q = pl.program_id(0) * ks + pl.program_id(1)
    if pref and not at_end:  # before the GEMV's own loads
        _issue_chunk(pref, q, rows, last)
    l_ref[...] = router_mod._gemv_rows(x_ref, w_ref, BK=BK, n_chunks=n_chunks, mode=mode)
    if pref and at_end:  # after them (the store waits for the loads)
        _issue_chunk(pref, q, rows, last)


def gemv_partials_pf(x, router, pref, *, rows, last, at_end=False, tu=router_mod.DECODE_TUNING):
    e, d = router.shape
    ks = router_mod._split_count(d, tu.k_splits)
    dk = d // ks
    bk = min(tu.block_k, dk & -dk)
    assert tu.block_e == 1 and sum(r.shape[0] for r in pref) // rows <= e * ks
    return pl.pallas_call(
        functools.partial(gemv_pf_kernel, BK=bk, n_chunks=dk // bk, mode=tu.t1_gemv, n_pref=len(pref), rows=rows,
                          ks=ks, last=last, at_end=at_end),
        grid=(e, ks, 1),
        in_specs=[pl.BlockSpec((1, dk), lambda j, k, i: (i, k)), pl.BlockSpec((1, dk), lambda j, k, i: (j, k))] +
                 [pl.no_block_spec] * len(pref),
        out_specs=pl.BlockSpec((None, 1, 1), lambda j, k, i: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((ks, 1, e), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tu.num_warps, num_stages=tu.num_stages),
        interpret=interpret_mode(), name="router_fwd_kernel_gemv_pf")(x, router, *pref)


def _select_topk_listed(logits, bias, *, topk_group, top_k, scale, norm):
    """In-kernel grouped top-k of one token: logits, bias [G, E/G] fp32 -> (weights [K] fp32, ids [K] int32).

    Every group's own top-T (T = min(K, E/G)) first, by T passes of row max + first row argmax: a row is a group,
    so these reductions stay inside a warp. The global top-K among the kept groups is among their top-T lists, and
    a listed expert's global rank is its place in its list plus, for every other kept group, how many of that
    group's T listed experts beat it (exact whenever it is < K: a group with an unlisted expert that beats it lists
    T that do too). So the K picks come from one [G, T, G, T] count instead of K argmax passes over all E experts,
    each a reduction across the program's warps (the flat passes: ~1.9 µs of the 3.3 µs top-k launch on the H200).
    Exact (tests/ops/test_moe.py's router tests passed with it in place of router._select_topk), but slower on
    the H200: top-k 3.9 µs against 3.3 (RESULTS.md, session 8, S8 5); kept here for that record.
    Order: "beats" is a larger score, or an equal one at a lower index, so ranks follow lax.top_k exactly."""
    n_group, gsz = logits.shape
    e = n_group * gsz
    n_list = min(top_k, gsz)
    s = jax.nn.sigmoid(logits)  # [G, E/G]
    row = s + bias
    neg = jnp.float32(-jnp.inf)
    col = lax.broadcasted_iota(jnp.int32, (n_group, gsz), 1)
    slot = lax.broadcasted_iota(jnp.int32, (n_group, n_list), 1)
    top_v = jnp.zeros((n_group, n_list), jnp.float32)
    top_i = jnp.zeros((n_group, n_list), jnp.int32)
    for t in range(n_list):
        m = jnp.max(row, axis=1)
        a = jnp.min(jnp.where(row == m[:, None], col, gsz), axis=1)  # first index of the maximum
        top_v = jnp.where(slot == t, m[:, None], top_v)
        top_i = jnp.where(slot == t, a[:, None], top_i)
        row = jnp.where(col == a[:, None], neg, row)
    # Group scores: top-2 sum (a duplicated maximum counts twice, as in lax.top_k). Best groups by rank counting:
    # group g is kept when fewer than topk_group groups beat it (larger, or equal at a lower index).
    g_score = jnp.sum(jnp.where(slot < 2, top_v, 0.0), axis=1)  # [G]
    gi = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 0)
    gj = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 1)
    sc_g, sc_h = g_score[:, None], g_score[None, :]
    beats = (sc_h > sc_g) | ((sc_h == sc_g) & (gj < gi))  # [g, h]: h beats g
    kept = jnp.sum(beats.astype(jnp.int32), axis=1) < topk_group  # [G]
    # Global rank of listed expert (g, t): t + sum over kept groups h != g of #{u: (h, u) beats (g, t)}; a tie
    # across groups goes to the lower group (all its indices are lower).
    shape4 = (n_group, n_list, n_group, n_list)
    g4 = lax.broadcasted_iota(jnp.int32, shape4, 0)
    h4 = lax.broadcasted_iota(jnp.int32, shape4, 2)
    v_gt = top_v[:, :, None, None]
    v_hu = top_v[None, None, :, :]
    other = (h4 != g4) & kept[None, None, :, None]
    win = other & ((v_hu > v_gt) | ((v_hu == v_gt) & (h4 < g4)))
    rank = jnp.sum(jnp.sum(win.astype(jnp.int32), axis=3), axis=2) + slot  # [G, T]
    picked = kept[:, None] & (rank < top_k)
    expert = lax.broadcasted_iota(jnp.int32, (n_group, n_list), 0) * gsz + top_i
    # ids[k]: the listed expert of rank k (exactly one, as ranks < K are exact and distinct).
    k3 = lax.broadcasted_iota(jnp.int32, (top_k, n_group, n_list), 0)
    hit = picked[None] & (rank[None] == k3)
    ids = jnp.sum(jnp.sum(jnp.where(hit, expert[None], 0), axis=2), axis=1)  # [K]
    # Weights: the unbiased scores of the K picks in one [K, E] reduction.
    i_e = lax.iota(jnp.int32, e)
    w = jnp.sum(jnp.where(i_e[None, :] == ids[:, None], s.reshape(e)[None, :], 0.0), axis=1)
    if norm:
        w = w / (jnp.sum(w) + 1e-20)
    return w * scale, ids


def _skeleton_select(logits, bias, *, top_k, **_):
    """Timing control, not a router: the top-k launch's loads and stores with one reduction in place of the
    selection (ids: the K largest column indices of the best row; wrong routing, same memory traffic)."""
    best = jnp.argmax(jnp.max(logits + bias, axis=1)).astype(jnp.int32)
    ids = best * logits.shape[1] + lax.iota(jnp.int32, top_k)
    return jnp.full((top_k,), 0.25, jnp.float32), ids


def topk_pf_kernel(p_ref, b_ref, wg_ref, wu_ref, *refs, n_pref, rows, last, head_rows, skeleton, listed, select_kw):
    pref, (w_ref, i_ref) = refs[:n_pref], refs[n_pref:]
    p = pl.program_id(0)

    @pl.when(p == 0)
    def _():
        select = (_skeleton_select if skeleton else _select_topk_listed if listed else router_mod._select_topk)
        w, ids = select(router_mod._sum_partials(p_ref), b_ref[...], **select_kw)
        w_ref[0, :] = w
        i_ref[0, :] = ids
        if head_rows:  # the first rows of every selected expert's gate and up, for the gate/up launch's start
            _, i, d = wg_ref.shape
            i_k = lax.iota(jnp.int32, ids.shape[0])
            for k in range(ids.shape[0]):
                e = jnp.sum(jnp.where(i_k == k, ids, 0))
                for ref in (wg_ref, wu_ref):
                    prefetch_l2(ref, e * i * d, head_rows * d * ref.dtype.itemsize, evict_last=last)

    if pref:
        _issue_chunk(pref, p - 1, rows, last)


def route_pf(x, lay, *, gemv_pref=(), gemv_rows=8, topk_pref=(), topk_rows=24, last=True, head_rows=0,
             gemv_end=False, router_tuning=router_mod.DECODE_TUNING, skeleton=False, listed=False):
    router, bias = lay["router"], lay["bias"]
    e = router.shape[0]
    if interpret_mode():  # toy sizes (the prefetches are no-ops there): chunks that divide the toy's rows
        gemv_rows, topk_rows = (math.gcd(r, lay["sg"].shape[0]) for r in (gemv_rows, topk_rows))
    partial = gemv_partials_pf(x, router, list(gemv_pref), rows=gemv_rows, last=last, at_end=gemv_end,
                               tu=router_tuning)
    ks = partial.shape[0]
    n_group, top_k = pf.G, pf.SELECT_KW["top_k"]
    whole = pl.no_block_spec
    w, ids = pl.pallas_call(
        functools.partial(topk_pf_kernel, n_pref=len(topk_pref), rows=topk_rows, last=last, head_rows=head_rows,
                          skeleton=skeleton, listed=listed, select_kw=pf.SELECT_KW),
        grid=(1 + sum(r.shape[0] for r in topk_pref) // topk_rows,),
        in_specs=[whole] * (4 + len(topk_pref)),
        out_specs=[whole] * 2,
        out_shape=[jax.ShapeDtypeStruct((1, top_k), jnp.float32), jax.ShapeDtypeStruct((1, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=router_tuning.topk_warps, num_stages=1),
        interpret=interpret_mode(), name="router_fwd_kernel_topk_pf",
    )(partial.reshape(ks, n_group, e // n_group), bias.reshape(n_group, e // n_group), lay["wg"], lay["wu"],
      *topk_pref)
    return w, ids


def gate_up_pf_kernel(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, wd_ref, sd_ref, h_ref, *, j_max, where,
                      last, gu_self, n_routed, **kw):
    s, j = pl.program_id(0), pl.program_id(1)
    bi = h_ref.shape[1]
    i, d = sd_ref.shape
    if gu_self:  # the program's own gate and up rows, handed to the memory system at once
        e, owner = ex._ownership(ids_ref[...], s, n_routed)
        nb = bi * d * wg_ref.dtype.itemsize

        @pl.when(owner)
        def _():
            for ref in (wg_ref, wu_ref):
                prefetch_l2(ref, (e * i + j * bi) * d, nb, evict_last=False)

        @pl.when(s == n_routed)
        def _():
            for ref in (sg_ref, su_ref):
                prefetch_l2(ref, j * bi * d, nb, evict_last=False)

    def issue():
        e, owner = ex._ownership(ids_ref[...], s, n_routed)
        nb = bi * d * wd_ref.dtype.itemsize

        @pl.when(owner & (j < j_max))
        def _():
            prefetch_l2(wd_ref, (e * i + j * bi) * d, nb, evict_last=last)

        @pl.when((s == n_routed) & (j < j_max))
        def _():
            prefetch_l2(sd_ref, j * bi * d, nb, evict_last=last)

    if where == "start":
        issue()
    ex.experts_fwd_kernel_gate_up(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, n_routed=n_routed, **kw)
    if where == "end":
        issue()


def gate_up_pf(x, ids, lay, *, down_frac, where, last, gu_self=False):
    """experts.moe_experts_fused's gate/up launch at T = 1 (DECODE_TUNING), its programs also prefetching the first
    down_frac of their experts' down rows."""
    _, d = x.shape
    i = lay["wg"].shape[1]
    bi, bk = min(TU.block_i, i & -i), min(TU.block_k, d & -d)
    k = ids.shape[1]
    return pl.pallas_call(
        functools.partial(gate_up_pf_kernel, j_max=int(round(down_frac * (i // bi))), where=where, last=last,
                          gu_self=gu_self,
                          BK=bk, n_chunks=d // bk, n_routed=k, limit=pt.LIMITS["limit"],
                          shared_limit=pt.LIMITS["shared_limit"], has_shared=True, mode=TU.t1_gate_up,
                          eviction=TU.routed_eviction),
        grid=(k + 1, i // bi),
        in_specs=[pl.no_block_spec] * 8,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=TU.warps_gate_up, num_stages=TU.stages_gate_up),
        interpret=interpret_mode(), name="experts_fwd_kernel_gate_up_pf",
    )(x, ids.reshape(-1), lay["wg"], lay["wu"], lay["sg"], lay["su"], lay["wd"], lay["sd"])


def down_self_kernel(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, o_ref, *, rows, last, n_routed, **kw):
    g, c = pl.program_id(0), pl.program_id(1)
    i, d = sd_ref.shape
    n_pf = i // rows
    nb = rows * d * wd_ref.dtype.itemsize

    @pl.when((g < n_routed) & (c < n_pf))
    def _():
        e, _ = ex._ownership(ids_ref[...], g, n_routed)  # T = 1: slot g is group g, and owns its (distinct) expert
        prefetch_l2(wd_ref, (e * i + c * rows) * d, nb, evict_last=last)

    @pl.when((g == n_routed) & (c < n_pf))
    def _():
        prefetch_l2(sd_ref, c * rows * d, nb, evict_last=last)

    ex.experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, o_ref, n_routed=n_routed, **kw)


def down_self(h, ids, weights, lay, *, rows, last):
    """experts.down_and_combine at T = 1 (DECODE_TUNING), each of the first I / rows column programs of a slot
    prefetching `rows` whole down rows of its expert at its start."""
    k = ids.shape[1]
    i, d = lay["sd"].shape
    bd, bki = min(TU.block_d, d & -d), min(TU.block_ki, i & -i)
    assert d // bd >= i // rows, "every row chunk needs a program"
    partials = pl.pallas_call(
        functools.partial(down_self_kernel, rows=rows, last=last, BKI=bki, n_chunks=i // bki, n_routed=k, group=1,
                          n_groups=k, early_launch=TU.early_launch_down, eviction=TU.routed_eviction),
        grid=(k + 1, d // bd),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=TU.warps_down, num_stages=TU.stages_down),
        interpret=interpret_mode(), name="experts_fwd_kernel_down_self",
    )(h, ids.reshape(-1), ids, weights, lay["wd"], lay["sd"])
    y = jnp.sum(partials[:k], axis=0).astype(h.dtype)
    return y + partials[k].astype(h.dtype)


def down_split_kernel(h_ref, ids_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed, rows_per, eviction):
    # grid (S = K + 1 slots, RS row splits, D / BD); h_ref [S, 1, I] after SwiGLU; o_ref [1, BD] fp32: slot s's
    # product over rows [r·rows_per, (r+1)·rows_per), not rounded (the combine sums the splits, then rounds)
    launch_dependents()  # as DECODE_TUNING's down kernel: admit the combine fusion early
    s, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bd = o_ref.shape[-1]
    cols = pl.ds(pl.multiple_of(c * bd, bd), bd)
    e, _ = ex._ownership(ids_ref[...], s, n_routed)  # T = 1: distinct experts, every routed slot owns its own

    def run(load_d):
        def body(k, acc):
            ks = pl.ds(pl.multiple_of(r * rows_per + k * BKI, BKI), BKI)
            return acc + ex._dot(jnp.broadcast_to(h_ref[s, :, ks], (16, BKI)), load_d(ks))

        o_ref[...] = ex._token_rows(lax.fori_loop(0, n_chunks, body, jnp.zeros((16, bd), jnp.float32)), 1)

    @pl.when(s < n_routed)
    def _():
        run(lambda ks: ex._load(wd_ref, (e, ks, cols), TU.routed_eviction))

    @pl.when(s == n_routed)
    def _():
        run(lambda ks: sd_ref[ks, cols])


def down_split(h, ids, weights, lay, *, splits, bki, warps=4, stages=3, bd=64):
    """The T = 1 down kernel with each slot's I rows split over `splits` programs per column block (fp32 partials
    summed by the combine, which then rounds each expert's output and weights it, as the reference)."""
    k = ids.shape[1]
    i, d = lay["sd"].shape
    if interpret_mode():  # toy sizes: splits and chunks that fit the toy's rows
        splits = math.gcd(splits, i)
        bki = min(bki, i // splits)
    rows_per = i // splits
    assert rows_per % bki == 0
    partials = pl.pallas_call(
        functools.partial(down_split_kernel, BKI=bki, n_chunks=rows_per // bki, n_routed=k, rows_per=rows_per,
                          eviction=TU.routed_eviction),
        grid=(k + 1, splits, d // bd),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((None, None, 1, bd), lambda s, r, c: (s, r, 0, c)),
        out_shape=jax.ShapeDtypeStruct((k + 1, splits, 1, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret_mode(), name="experts_fwd_kernel_down_split",
    )(h, ids.reshape(-1), lay["wd"], lay["sd"])
    out = jnp.sum(partials[:, :, 0], axis=1).astype(h.dtype).astype(jnp.float32)  # [S, D], each expert rounded
    y = jnp.sum(weights[0][:, None] * out[:k], axis=0).astype(h.dtype)
    return (y + out[k].astype(h.dtype))[None]


def split_layer(splits, bki, **kw):
    """Production routing (with the shared-expert prefetch) and gate/up, then down_split."""
    def f(x, lay):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW,
                                  prefetch=(lay["sg"], lay["su"], lay["sd"]))
        h = gate_up_pf(x, ids, lay, down_frac=0.0, where="end", last=False)
        return down_split(h, ids, w, lay, splits=splits, bki=bki, **kw)
    return f


def prod_layer(x, lay):
    """The production T = 1 layer: route (shared expert prefetched by the top-k launch) + moe_experts_fused."""
    w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW, prefetch=(lay["sg"], lay["su"], lay["sd"]))
    return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                **pt.LIMITS)


def layer(gemv="", topk="", gemv_rows=8, topk_rows=24, down_frac=0.0, down_where="end", down_rows=0, last=True,
          head_rows=0, gu_self=False, tuning=TU, gemv_end=False, router_tuning=router_mod.DECODE_TUNING,
          skeleton=False, listed=False):
    """gemv / topk: the shared matrices ("g", "u", "d") prefetched from that launch; head_rows: the top-k program
    prefetches that many first rows of each selected expert's gate and up; down_frac > 0: the gate/up programs
    prefetch down rows; gu_self: each gate/up program prefetches its own rows first; down_rows > 0: the down
    programs prefetch whole rows of their expert; tuning: the experts' (plain launches only)."""
    def f(x, lay):
        pick = {"g": lay["sg"], "u": lay["su"], "d": lay["sd"]}
        w, ids = route_pf(x, lay, gemv_pref=[pick[c] for c in gemv], gemv_rows=gemv_rows,
                          topk_pref=[pick[c] for c in topk], topk_rows=topk_rows, last=last, head_rows=head_rows,
                          gemv_end=gemv_end, router_tuning=router_tuning, skeleton=skeleton,
                          listed=listed)
        if not (down_frac or down_rows or gu_self):
            return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                        **pt.LIMITS, tuning=tuning)
        h = gate_up_pf(x, ids, lay, down_frac=down_frac, where=down_where, last=last, gu_self=gu_self)
        if down_rows:
            return down_self(h, ids, w, lay, rows=down_rows, last=last)
        return ex.down_and_combine(h, ids, w, lay["wd"], lay["sd"], n=1, tuning=TU)
    return f


def down_only(x, layers, hot):
    """(fn, layers) timing the down kernel + combine alone over the layers' routings; hot: every call reads layer
    0's down weights (35 MB, which the L2 can hold), each with its own h so XLA keeps the calls apart."""
    rows = []
    for l, lay in enumerate(layers):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)
        h = jax.random.normal(jax.random.key(500 + l), (ids.shape[1] + 1, 1, lay["sd"].shape[0]), x.dtype)
        src = layers[0] if hot else lay
        ids_src = router_mod.route(x, src["router"], src["bias"], **pt.ROUTE_KW)[1] if hot else ids
        rows.append(dict(h=h, w=w, ids=ids_src, wd=src["wd"], sd=src["sd"]))
    fn = lambda x, r: ex.down_and_combine(r["h"], r["ids"], r["w"], r["wd"], r["sd"], n=1, tuning=TU)  # noqa: E731
    return fn, rows


R = dataclasses.replace


def RW(warps):
    return R(router_mod.DECODE_TUNING, topk_warps=warps)

VARIANTS = {
    "s8c1": lambda: [
        ("five launches (defaults)", pt.separate()),
        ("no prefetch through the probe's launches (control)", layer()),
        ("gemv: shared gud, 8 rows", layer(gemv="gud")),
        ("gemv: shared gud, 2 rows", layer(gemv="gud", gemv_rows=2)),
        ("topk: shared gud, 24 rows", layer(topk="gud")),
        ("topk: shared gud, 96 rows", layer(topk="gud", topk_rows=96)),
        ("gemv gu 8 + topk d 24", layer(gemv="gu", topk="d")),
        ("gemv gud 8 + gate/up down end 0.5", layer(gemv="gud", down_frac=0.5)),
        ("gemv gud 8 + gate/up down end 1.0", layer(gemv="gud", down_frac=1.0)),
        ("gemv gud 8 + gate/up down end 1.0 normal", layer(gemv="gud", down_frac=1.0, last=False)),
        ("gemv gud 8 + gate/up down start 0.5", layer(gemv="gud", down_frac=0.5, down_where="start")),
        ("gemv gud 8 + down self 32 rows", layer(gemv="gud", down_rows=32)),
        ("down self 32 rows", layer(down_rows=32)),
        ("gate/up down end 0.5", layer(down_frac=0.5)),
        ("gemv gud 8 + gate/up down end 0.25", layer(gemv="gud", down_frac=0.25)),
        ("gemv gud 8 + gate/up down end 0.5 + down self 32", layer(gemv="gud", down_frac=0.5, down_rows=32)),
        ("five launches (defaults) again", pt.separate()),
    ],
    "s8c2": lambda: [
        ("five launches (defaults)", pt.separate()),
        ("topk: shared gud, 24 rows", layer(topk="gud")),
        ("topk: shared gud, 8 rows", layer(topk="gud", topk_rows=8)),
        ("topk: shared gud, 12 rows", layer(topk="gud", topk_rows=12)),
        ("topk: shared gud, 48 rows", layer(topk="gud", topk_rows=48)),
        ("topk: shared gud, 24 rows, evict_normal", layer(topk="gud", last=False)),
        ("topk gud 24 + head 24 rows", layer(topk="gud", head_rows=24)),
        ("topk gud 24 + head 96 rows", layer(topk="gud", head_rows=96)),
        ("topk gud 24 + gate/up self", layer(topk="gud", gu_self=True)),
        ("topk gud 24 + gate/up down end 0.1", layer(topk="gud", down_frac=0.1)),
        ("topk gud 24 + gate/up down end 0.25", layer(topk="gud", down_frac=0.25)),
        ("topk gud 24 + gate/up down end 0.1 normal", layer(topk="gud", down_frac=0.1, last=False)),
        ("five launches (defaults) again", pt.separate()),
        ("topk: shared gud, 24 rows again", layer(topk="gud")),
    ],
    "s8c4": lambda: [
        ("five launches (defaults)", pt.separate()),
        ("topk: shared gud, 24 rows", layer(topk="gud")),
        ("gemv end: shared gud 2 rows", layer(gemv="gud", gemv_rows=2, gemv_end=True)),
        ("gemv end: shared d 2 rows + topk gu 24", layer(gemv="d", gemv_rows=2, gemv_end=True, topk="gu")),
        ("gemv end: shared gu 2 rows + topk d 24", layer(gemv="gu", gemv_rows=2, gemv_end=True, topk="d")),
        ("topk gud 24 + router KS 10", layer(topk="gud", router_tuning=R(router_mod.DECODE_TUNING, k_splits=10))),
        ("topk gud 24 + router KS 4", layer(topk="gud", router_tuning=R(router_mod.DECODE_TUNING, k_splits=4))),
        ("topk gud 24 + router block_k 256", layer(topk="gud", router_tuning=R(router_mod.DECODE_TUNING,
                                                                                   block_k=256))),
        ("topk gud 24 + top-k skeleton (control: wrong routing)", layer(topk="gud", skeleton=True)),
        ("top-k skeleton alone (control: wrong routing)", layer(skeleton=True)),
        ("topk: shared gud, 24 rows again", layer(topk="gud")),
    ],
    "s8c5": lambda: [  # as run, rows 1 and 15 were the five launches with the listed top-k in router.route
        ("five launches (defaults, listed top-k)", layer(listed=True)),
        ("flat top-k (session 7's), no prefetch", layer()),
        ("listed top-k, no prefetch", layer(listed=True)),
        ("listed top-k 1 warp", layer(listed=True, router_tuning=RW(1))),
        ("listed top-k 2 warps", layer(listed=True, router_tuning=RW(2))),
        ("listed top-k 8 warps", layer(listed=True, router_tuning=RW(8))),
        ("flat top-k + topk gud 24", layer(topk="gud")),
        ("listed top-k + topk gud 24", layer(listed=True, topk="gud")),
        ("listed top-k + topk gu 24", layer(listed=True, topk="gu")),
        ("listed top-k + topk gu 8", layer(listed=True, topk="gu", topk_rows=8)),
        ("listed top-k + gemv end d 2 + topk gu 24", layer(listed=True, gemv="d", gemv_rows=2, gemv_end=True,
                                                           topk="gu")),
        ("listed top-k + gemv end gd 2 + topk u 24", layer(listed=True, gemv="gd", gemv_rows=2, gemv_end=True,
                                                           topk="u")),
        ("listed top-k 2 warps + topk gud 24", layer(listed=True, topk="gud", router_tuning=RW(2))),
        ("top-k skeleton alone (control: wrong routing)", layer(skeleton=True)),
        ("five launches (defaults, listed top-k) again", layer(listed=True)),
    ],
    "s8c7": lambda: [
        ("production layer (shared prefetch)", prod_layer),
        ("down split 1 x BKI 256 (control: the production split)", split_layer(1, 256)),
        ("down split 3 x BKI 256", split_layer(3, 256)),
        ("down split 3 x BKI 128", split_layer(3, 128)),
        ("down split 2 x BKI 128", split_layer(2, 128)),
        ("down split 6 x BKI 128", split_layer(6, 128)),
        ("down split 3 x BKI 256, 2 warps", split_layer(3, 256, warps=2)),
        ("down split 3 x BKI 256, 8 warps", split_layer(3, 256, warps=8)),
        ("down split 3 x BKI 256, block_d 128", split_layer(3, 256, bd=128)),
        ("down split 6 x BKI 128, block_d 128", split_layer(6, 128, bd=128)),
        ("production layer (shared prefetch) again", prod_layer),
    ],
    "s8c3": lambda: [
        ("five launches (defaults)", pt.separate()),
        ("topk: shared gud, 24 rows", layer(topk="gud")),
        ("topk gud 24 + down block_d 32", layer(topk="gud", tuning=R(TU, block_d=32))),
        ("topk gud 24 + down block_d 128", layer(topk="gud", tuning=R(TU, block_d=128))),
        ("topk gud 24 + down block_ki 128", layer(topk="gud", tuning=R(TU, block_ki=128))),
        ("topk gud 24 + down stages 2", layer(topk="gud", tuning=R(TU, stages_down=2))),
        ("topk gud 24 + down warps 8", layer(topk="gud", tuning=R(TU, warps_down=8))),
        ("topk gud 24 + down warps 2", layer(topk="gud", tuning=R(TU, warps_down=2))),
        ("topk gud 24 + gate/up block_i 4", layer(topk="gud", tuning=R(TU, block_i=4))),
        ("topk gud 24 + gate/up block_k 256", layer(topk="gud", tuning=R(TU, block_k=256))),
        ("topk gud 24 + gate/up stages 2", layer(topk="gud", tuning=R(TU, stages_gate_up=2))),
        ("topk gud 24 + gate/up stages 4", layer(topk="gud", tuning=R(TU, stages_gate_up=4))),
        ("topk gud 24 + down no eviction policy", layer(topk="gud", tuning=R(TU, routed_eviction=None))),
        ("topk: shared gud, 24 rows again", layer(topk="gud")),
        ("DOWN_ONLY cold", "cold"),
        ("DOWN_ONLY hot", "hot"),
    ],
}


def main():
    args, out, x, layers, only = pf.chain_probe_setup("probe_moe_bulk_prefetch", VARIANTS, "s8c7", only_sep=";")
    results = {**run_header(), "layers": len(layers), "rows": []}
    for label, fn in VARIANTS[args.set]():
        if only and label not in only:
            continue
        if label.startswith("DOWN_ONLY"):  # no reference: the h rows are random
            dfn, rows = down_only(x, layers, hot=fn == "hot")
            pt.record_row(results, out, label, dfn, x, rows)
        else:  # the skeleton controls route wrongly on purpose: timed, not checked
            pt.record_row(results, out, label, fn, x, layers, None if "skeleton" in label else pt.reference_layer)
    write_results(out, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
