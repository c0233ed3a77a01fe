"""The small-T MoE down kernels (experts.py runs gate/up, then `down_and_combine`): h·W_downᵀ per selected expert,
weighted by the routing and combined in fp32 as the reference does, plus the shared expert and the residual.

Kernel 2 at T = 1 (`experts_fwd_kernel_down_t1`), grid (D / BD): a program owns BD output features and, for the
shared expert and then each routed slot, reduces their BD W_down rows against the slot's h by FMAs (the slots
written out, so the compiler overlaps one slot's loads with another's math), rounds each expert's output to the
compute dtype as the reference does, sums the routed ones weighted in fp32, rounds once and adds the shared output
(and the optional residual): the layer's output, no combine launch. Non-owner slots (a repeated id; the router never
repeats one within a token) are masked, their owner taking every weight of the id. This is `down_t1="fused"`
(experts.DECODE_TUNING). The slot-parallel forms (experts.DECODE_TUNING_FP8) give every (slot, BD features) pair
a program over all of I instead, which loads all its weight tiles before its first product (a CTA barrier keeps
ptxas from sinking the loads to their products) and writes its weighted fp32 partial: "slots"
(`experts_fwd_kernel_down_slots`) leaves the sum to the T > 1 combine fusion below; "slots_last"
(`experts_fwd_kernel_down_slots_last`) counts arrivals per feature block with an acq_rel atomic (counters zeroed by
the gate/up launch, experts.py), and the last program to arrive sums the routed partials in slot order, rounds once
and adds the shared expert's and the residual, as the fused kernel does.
Kernel 2 at T > 1 (`experts_fwd_kernel_down`), grid (K + 1, D / BD): group g < K walks its T slots, takes
tensor-core dots h·W_down[BD rows]ᵀ over the TP token rows (fp32, rounded to the compute dtype as the reference
rounds each expert's output), scales by each token's routing weight in fp32 and writes a fp32 partial; program row
K writes the shared expert's output. XLA sums the K partials (fp32), rounds once and adds the shared output in the
compute dtype: one small fusion.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import fp8, interpret_mode
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.common.sizes import next_pow2
from pallas_kernels.moe.tiles import (chunk_loop, check_fp8_rows, dot_nt, lane_sums, load_w, operand, ownership,
                                      round_to, rows_load, scaled, split_fp8, sub_width, with_optional)


def _down_dot(load_h, load_d, *, BKI, BW, n_chunks, bd, to, dt):
    """T > 1: h·W_downᵀ for BD output features: load_h(ks) -> [TO, BW] activations (TO >= 16 padded token rows),
    load_d(ks) -> ([BD, BW] weight tile, its scale or None) (W_down rows; BW = BKI, or an FP8 weight's 128-wide
    sub-blocks of a BKI chunk); -> [TO, BD] fp32 holding values rounded to dt (the reference rounds each expert's
    output)."""
    def step(ks, acc):
        hs = load_h(ks)
        w, scale = load_d(ks)
        return acc + scaled(dot_nt(hs, operand(w, hs.dtype)), scale)

    acc = chunk_loop(n_chunks, BKI, BW, step, jnp.zeros((to, bd), jnp.float32))
    return acc.astype(dt).astype(jnp.float32)


def _down_fma(load_h, load_d, *, BKI, n_chunks, dt, lanes, accumulate=False):
    """T = 1: h·W_downᵀ for BD output features by FMAs, the chunks written out (their loads issued together):
    load_h(ks) -> [1, BKI], load_d(ks) -> ([BD, BKI] weight tile, its scale or None); -> [BD] fp32 holding values
    rounded to dt. Each chunk's products are reduced to [BD], or with `accumulate` summed elementwise over the
    chunks (FP8: per-lane sums over the program's `lanes`, `lane_sums`) and reduced once; an FP8 chunk's fp32
    sums take its scale."""
    acc = None
    for c in range(n_chunks):
        ks = pl.ds(c * BKI, BKI)
        hs = load_h(ks)
        w, scale = load_d(ks)
        prod = w.astype(jnp.float32) * hs.astype(jnp.float32)
        if accumulate:
            part = prod if scale is None else lane_sums(prod, lanes) * scale
        else:
            part = scaled(jnp.sum(prod, axis=1), scale)
        acc = part if acc is None else acc + part
    if accumulate:
        acc = jnp.sum(acc, axis=1)
    return acc.astype(dt).astype(jnp.float32)


def experts_fwd_kernel_down_t1(h_ref, ids_ref, w_ref, wd_ref, sd_ref, r_ref, wd_scale_ref, sd_scale_ref, y_ref, *,
                               BKI, n_routed, early_launch=False, eviction=None, accumulate=False, lanes=32):
    # T = 1. h_ref [S, 1, I] (after SwiGLU; float32 with an FP8 W_down, `h_dtype`); ids_ref [K] int32; w_ref [K]
    # fp32; wd_ref [E, D, I]; sd_ref [D, I] or None; r_ref [1, D] compute dtype (the residual stream, added last)
    # or None; wd_scale_ref / sd_scale_ref the FP8 weights' block scales [E, ceil(D/128), ceil(I/128)] /
    # [ceil(D/128), ceil(I/128)] or None (plain); y_ref [1, BD] compute dtype: the layer's output for BD features
    if early_launch:
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    i = h_ref.shape[-1]
    feats = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
    ids, wts = ids_ref[...], w_ref[...]

    def expert_out(s, load_d, scale_ref):
        bw = sub_width(BKI, scale_ref)  # FP8: more, 128-wide chunks, still written out
        load_h = ((lambda ks: h_ref[s, :, ks]) if scale_ref is None else
                  (lambda ks: rows_load(h_ref, (s,), bd, ks)))
        return _down_fma(load_h, load_d, BKI=bw, n_chunks=i // bw, dt=dt, lanes=lanes, accumulate=accumulate)

    # The shared expert first: the router prefetched its rows into L2 (0.0-0.3 µs faster than last).
    shared = None if sd_ref is None else expert_out(
        n_routed, lambda ks: load_w(sd_ref, sd_scale_ref, (), feats, ks, None), sd_scale_ref)
    routed = jnp.zeros((bd,), jnp.float32)
    for s in range(n_routed):  # written out: one slot's loads overlap another's math (a loop would serialise them)
        e, owner = ownership(ids, s, n_routed)
        w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))  # a repeated id: its owner takes every weight
        out = expert_out(s, lambda ks: load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction), wd_scale_ref)
        # A non-owner's h rows were never written: masked, not multiplied by 0 (inf · 0 = NaN).
        routed = routed + jnp.where(owner, w_e * out, 0.0)
    y = routed.astype(dt)
    if shared is not None:
        y = y + shared.astype(dt)
    y = y[None, :]
    if r_ref is not None:  # the caller's h + MoE(x), as the model adds it (in dt): no separate add launch
        y = r_ref[:, feats] + y
    y_ref[...] = y


def _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, *, bd, BKI, n_routed,
                  dtype, eviction, accumulate, lanes):
    """The "slots" T = 1 down: program (s, j)'s [1, BD] fp32 partial, passed to store(): slot s's expert output for
    the BD features of block j, rounded to `dtype` and weighted (s = K: the shared expert's, unweighted; 0 for a
    non-owner slot). h_ref [S, TO, I] (TO = 16 after the "dot" gate/up, row 0 the token; `h_dtype`: float32 holding
    `dtype` values with an FP8 W_down); ids_ref / w_ref [K·TO] (the padded rows' ids -1)."""
    s = pl.program_id(0)
    feats = pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)
    i = h_ref.shape[-1]

    def expert_out(slot, load_d, scale_ref):
        bw = sub_width(BKI, scale_ref)
        load_h = ((lambda ks: h_ref[slot, pl.ds(0, 1), ks]) if scale_ref is None else  # the token's row
                  (lambda ks: rows_load(h_ref, (slot,), bd, ks)))
        # Every weight tile of the program is loaded before the first product, and a CTA barrier keeps ptxas from
        # sinking the loads to their products (it would issue one tile, wait, compute, issue the next).
        tiles = [load_d(pl.ds(c * bw, bw)) for c in range(i // bw)]
        if not interpret_mode():
            pltriton.debug_barrier()
        return _down_fma(load_h, lambda ks: tiles[ks.start // bw], BKI=bw, n_chunks=i // bw, dt=dtype, lanes=lanes,
                         accumulate=accumulate)

    @pl.when(s < n_routed)
    def _():
        ids, wts = ids_ref[...], w_ref[...]
        e, owner = ownership(ids, s, n_routed)
        w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))  # a repeated id: its owner takes every weight

        @pl.when(owner)
        def _():
            out = expert_out(s, lambda ks: load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction), wd_scale_ref)
            store((w_e * out)[None, :])

        @pl.when(jnp.logical_not(owner))
        def _():
            store(jnp.zeros((1, bd), jnp.float32))

    if sd_ref is not None:
        @pl.when(s == n_routed)
        def _():
            out = expert_out(n_routed, lambda ks: load_w(sd_ref, sd_scale_ref, (), feats, ks, None), sd_scale_ref)
            store(out[None, :])


def experts_fwd_kernel_down_slots(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, o_ref, *,
                                  early_launch=False, **kw):
    # T = 1, down_t1="slots": o_ref [1, BD] fp32, program (s, j)'s partial (`_slot_partial`), summed by `combine`
    if early_launch:
        launch_dependents()

    def store(v):
        o_ref[...] = v

    _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, bd=o_ref.shape[1], **kw)


def experts_fwd_kernel_down_slots_last(h_ref, ids_ref, w_ref, wd_ref, sd_ref, r_ref, wd_scale_ref, sd_scale_ref,
                                       count_in_ref, p_ref, y_ref, count_ref, *, bd, n_slots, early_launch=False,
                                       **kw):
    # T = 1, down_t1="slots_last": p_ref [S, 1, D] fp32 (whole; program (s, j) writes its partial, `_slot_partial`);
    # count_ref [C] int32, zeroed by the gate/up launch (count_in_ref, the same buffer); y_ref [1, BD] compute dtype:
    # the layer's output for block j, written by the block's last program to finish, which sums the partials in slot
    # order, as the "fused" kernel does, and adds the shared expert's and the residual (r_ref [1, D] or None)
    del count_in_ref
    if early_launch:
        launch_dependents()
    s, j = pl.program_id(0), pl.program_id(1)
    feats = pl.ds(pl.multiple_of(j * bd, bd), bd)
    n_routed = kw["n_routed"]

    def store(v):
        p_ref[s, :, feats] = v

    _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, bd=bd, **kw)
    # Every thread's partial is stored before one thread's release (the atomic, acq_rel at GPU scope) publishes it.
    if not interpret_mode():
        pltriton.debug_barrier()
    arrived = pltriton.atomic_add(count_ref, (j,), jnp.int32(1))

    @pl.when(arrived == n_slots - 1)
    def _():
        # Volatile: from L2, where the other programs' partials are (the atomic's acquire orders these loads after
        # it; its result reaches every thread through a barrier).
        part = lambda slot: pltriton.load(p_ref.at[jnp.int32(slot), :, feats], volatile=True)  # noqa: E731
        routed = part(0)
        for slot in range(1, n_routed):
            routed = routed + part(slot)
        y = routed.astype(y_ref.dtype)
        if sd_ref is not None:
            y = y + part(n_routed).astype(y_ref.dtype)
        if r_ref is not None:
            y = r_ref[:, feats] + y
        y_ref[...] = y


def experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, o_ref, *,
                            BKI, n_chunks, n_routed, group, n_groups, early_launch=False, eviction=None):
    # T > 1. h_ref [S, TO, I] (after SwiGLU); ids_ref [P]; ids2_ref [TO, K]; w_ref [TO, K] fp32; wd_ref [E, D, I];
    # sd_ref [D, I] or None; wd_scale_ref / sd_scale_ref the FP8 block scales or None (plain); o_ref [TO, BD]
    # fp32: partial of group g (g = NG: the shared expert)
    if early_launch:
        launch_dependents()
    g, i_d = pl.program_id(0), pl.program_id(1)
    to, bd = o_ref.shape
    dt = h_ref.dtype
    feats = pl.ds(pl.multiple_of(i_d * bd, bd), bd)

    def expert_out(s, load_d, scale_ref):
        return _down_dot(lambda ks: h_ref[s, :, ks], load_d, BKI=BKI, BW=sub_width(BKI, scale_ref),
                         n_chunks=n_chunks, bd=bd, to=to, dt=dt)

    @pl.when(g < n_groups)
    def _():
        ids_flat, ids2, wts = ids_ref[...], ids2_ref[...], w_ref[...]

        def slot(s, acc):
            e, owner = ownership(ids_flat, s, n_routed)

            def add(acc):
                hit = ids2 == e  # [TO, K]; a token that lists e twice gets both weights
                w_tok = jnp.sum(jnp.where(hit, wts, 0.0), axis=1)  # [TO]
                used = jnp.sum(jnp.where(hit, 1, 0), axis=1) > 0
                out = expert_out(s, lambda ks: load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction),
                                 wd_scale_ref)
                # Rows of tokens that did not choose e are masked, not multiplied by 0 (inf · 0 = NaN).
                return acc + jnp.where(used[:, None], w_tok[:, None] * out, 0.0)

            return lax.cond(owner, add, lambda a: a, acc)

        lo = g * group
        hi = jnp.minimum(lo + group, n_routed)
        o_ref[...] = lax.fori_loop(lo, hi, slot, jnp.zeros((to, bd), jnp.float32))

    if sd_ref is not None:
        @pl.when(g == n_groups)
        def _():
            o_ref[...] = expert_out(n_routed, lambda ks: load_w(sd_ref, sd_scale_ref, (), feats, ks, None),
                                    sd_scale_ref)


def h_dtype(n, dt, *downs):
    """The dtype of the gate/up launch's output h (experts.py): the compute dtype dt, or at T = 1 with an FP8 down
    matrix float32 holding the same dt values, so that the T = 1 down kernel's FMAs take them as loaded: each lane's
    E4M3 row segment meets its own h values, and a bf16 h widened in registers took 5.0 SASS instructions per down
    weight against 3.6."""
    fp8_down = any(isinstance(w, fp8.Fp8Weight) for w in downs)
    return jnp.float32 if n == 1 and fp8_down and jnp.dtype(dt) == jnp.bfloat16 else dt


def down_and_combine(h, ids, weights, we_down, ws_down, *, n, tuning, residual=None, dtype=None, count=None):
    """Kernel 2 and the combine: h [S, TO, I] after SwiGLU (slots as in gate/up; `h_dtype`), ids/weights [TO, K]
    (padded rows -1 / 0), we_down [E, D, I], ws_down [D, I] or None (each a plain array or an Fp8Weight), tuning
    an experts.ExpertsTuning, residual [n, D] or None, count: the zeroed arrival counters where `counters_needed` ->
    y [TO, D] in `dtype` (the compute dtype; None: h's) plus the residual (at T = 1 inside the down kernel, at T > 1
    in the combine fusion)."""
    dtype = h.dtype if dtype is None else dtype
    to, k = ids.shape
    _, d, i = we_down.shape
    has_shared = ws_down is not None
    if h.shape[0] != n * k + int(has_shared):
        raise ValueError(f"h has {h.shape[0]} slots; T·K = {n * k} routed slots" +
                         (" + 1 shared (ws_down given)" if has_shared else " (no ws_down: no shared slot)"))
    (wd, wd_s), (sd, sd_s) = split_fp8(we_down), split_fp8(ws_down)
    bd = min(tuning.block_d, d & -d)
    bki = min(tuning.block_ki, i & -i)
    check_fp8_rows(tuning, "block_d", bd, wd_s, sd_s)
    if n == 1 and tuning.down_t1 == "fused":
        return _down_t1(h, ids, weights, (wd, wd_s), (sd, sd_s), residual, bd=bd, bki=bki, tuning=tuning,
                        dtype=dtype)
    if n == 1 and tuning.down_t1 == "slots_last":
        _check_counters(count, d, tuning)
        return _down_slots_last(h, ids, weights, (wd, wd_s), (sd, sd_s), residual, count, bd=bd, bki=bki,
                                tuning=tuning, dtype=dtype)
    if n == 1:
        partials = _down_slots(h, ids, weights, (wd, wd_s), (sd, sd_s), bd=bd, bki=bki, tuning=tuning, dtype=dtype)
        return combine(partials, k, has_shared, dtype, residual)
    if bd < 16:
        raise ValueError(f"ExpertsTuning.block_d={tuning.block_d} at T={n}: the T > 1 down kernel's tensor-core dots "
                         "need >= 16 output features per program (block_d >= 16; VERIFY_TUNING has 64)")
    if residual is not None:
        residual = jnp.pad(residual, ((0, to - n), (0, 0)))
    partials = _down_groups(h, ids, weights, (wd, wd_s), (sd, sd_s), n=n, bd=bd, bki=bki, tuning=tuning)
    return combine(partials, k, has_shared, dtype, residual)


def counters_needed(n, tuning):
    """Whether the down kernel at T = n counts arrivals per feature block (the counters gate/up zeroes)."""
    return n == 1 and tuning.down_t1 == "slots_last"


def counter_shape(d, tuning):
    """The arrival counters' shape: one per BD-feature block, padded to a power of two."""
    return (next_pow2(d // min(tuning.block_d, d & -d)),)


def _check_counters(count, d, tuning):
    want = counter_shape(d, tuning)
    if count is None or count.shape != want:
        raise ValueError(f"down_t1='slots_last' needs the zeroed int32 counters {list(want)} the gate/up launch "
                         "writes (count)")


def _down_groups(h, ids, weights, routed, shared, *, n, bd, bki, tuning):
    """T > 1: fp32 partials [K (+ 1 shared), TO, D] for `combine`, group g summing its T slots."""
    to, k = ids.shape
    (wd, wd_s), (sd, sd_s) = routed, shared
    d, i = wd.shape[1:]
    n_programs = k + int(sd is not None)  # the K slot groups and the shared expert's row
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_routed=n * k, group=n, n_groups=k,
                          early_launch=tuning.early_launch_down, eviction=tuning.routed_eviction),
        [h, ids.reshape(-1), ids, weights, wd, sd, wd_s, sd_s])
    return pl.pallas_call(
        kernel,
        grid=(n_programs, d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((None, to, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_programs, to, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down",
    )(*inputs)


def combine(partials, n_groups, has_shared, dtype, residual=None):
    """One XLA fusion: the fp32 sum of the routed experts' weighted partials [n_groups, TO, D] rounded once, plus the
    shared expert's output (partials[n_groups]) and the residual [TO, D] in the compute dtype."""
    # A reduce_precision, which XLA keeps where it may drop a bare cast feeding the next add (excess precision, its
    # default), moving bf16 outputs by 2.6e-3 at D 256, I 192.
    y = round_to(jnp.sum(partials[:n_groups], axis=0), dtype)
    if has_shared:
        y = y + partials[n_groups].astype(dtype)  # compute-dtype add of the shared expert
    if residual is not None:
        y = residual + y
    return y


def _down_t1(h, ids, weights, routed, shared, residual, *, bd, bki, tuning, dtype):
    """T = 1: down, weighted combine, the shared expert and the residual add in one launch -> y [1, D] in `dtype`.
    routed / shared: (values, scales or None) of W_down, shared (None, None) without the shared expert."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    kernel, inputs = with_optional(  # absent optional inputs reach the kernel as None (static)
        functools.partial(experts_fwd_kernel_down_t1, BKI=bki, n_routed=k, early_launch=tuning.early_launch_down,
                          eviction=tuning.routed_eviction, accumulate=tuning.t1_products == "accumulate",
                          lanes=32 * tuning.warps_down),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, residual, wd_s, sd_s])
    return pl.pallas_call(
        kernel,
        grid=(d // bd,),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, d), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_t1",
    )(*inputs)


def _down_slots(h, ids, weights, routed, shared, *, bd, bki, tuning, dtype):
    """T = 1, down_t1="slots": one program per (slot, BD features), each over all of I -> fp32 partials
    [K (+ 1 shared), 1, D] for `combine`."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    n_slots = k + int(sd is not None)
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down_slots, **_slots_kw(k, bki, tuning, dtype)),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, wd_s, sd_s])
    return pl.pallas_call(
        kernel,
        grid=(n_slots, d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((None, 1, bd), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_slots, 1, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_slots",
    )(*inputs)


def _slots_kw(k, bki, tuning, dtype):
    return dict(BKI=bki, n_routed=k, dtype=jnp.dtype(dtype), early_launch=tuning.early_launch_down,
                eviction=tuning.routed_eviction, accumulate=tuning.t1_products == "accumulate",
                lanes=32 * tuning.warps_down)


def _down_slots_last(h, ids, weights, routed, shared, residual, count, *, bd, bki, tuning, dtype):
    """T = 1, down_t1="slots_last": the "slots" programs, each feature block's last one combining -> y [1, D]."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    n_slots = k + int(sd is not None)
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down_slots_last, bd=bd, n_slots=n_slots,
                          **_slots_kw(k, bki, tuning, dtype)),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, residual, wd_s, sd_s, count])
    _, y, _ = pl.pallas_call(
        kernel,
        grid=(n_slots, d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=[pl.no_block_spec, pl.BlockSpec((1, bd), lambda s, j: (0, j)), pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((n_slots, 1, d), jnp.float32), jax.ShapeDtypeStruct((1, d), dtype),
                   jax.ShapeDtypeStruct(count.shape, jnp.int32)],
        input_output_aliases={len(inputs) - 1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_slots_last",
    )(*inputs)
    return y
