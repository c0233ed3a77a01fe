"""Probe: the T = 1 down projection over whole W_down rows, the combine done in the same launch.

The production down kernel (`experts.experts_fwd_kernel_down`, W_down stored [E, I, D]) has 360 four-warp programs
(slot, 64 output columns) that read a 128-byte stripe of each of the expert's 768 rows, then an XLA fusion sums the
9 fp32 partials (~0.9 µs of its own). Its bytes stream at ~3.0 TB/s (10.6 µs for 31.5 MB), where gate/up's one-warp
programs over whole rows reach ~3.7 (RESULTS.md, "Session 9"); the same stripes read from L2 still took 7.8 µs
(S8 3). Here W_down is read as torch stores it, [E, D, I]: a program owns BD output rows d and, for each of the 8
routed slots and the shared expert, reads their BD whole rows (BD·1.5 KB, contiguous), reduces them against h of
that slot by FMAs (gate/up's one-warp shape), rounds each expert's output to the compute dtype, weights it in fp32
and writes the layer's output: one launch, no partials, no combine fusion.

Triton does not pipeline these FMA loops (RESULTS.md, session 6), so the bytes a program has in flight are the
loads it issues together: `slots_per_step` slots' rows (all three 256-column chunks of each). `slots_per_step` 8
issues the program's whole input at once (registers permitting).

Variants:
- "rows fused BD b, w warps, s slots/step": the above (W_down memory read as [E, D, I]).
- "rows per slot BD b + XLA combine": grid (9 slots, D / BD), each program one expert's BD rows, fp32 partials, the
  production combine fusion: the row layout without the fused combine.
- "stripe panels": the production down kernel with W_down stored as column panels [E, D / 64, I, 64], so each
  program's stripe is one contiguous 96 KB block.

Timing without extra copies: each layer's W_down memory is read in the variant's layout (the values differ per
interpretation, the access pattern is each layout's own); each variant is checked against the reference on the
weights as it reads them (layer 0, re-laid-out for the check only).

As run (S10 1-5, sets s10c1-s10c5, commits 9a9bb80-880a5c7): the layers stored W_down [E, I, D], "production
layer" was the stripe kernel + XLA combine, and the row variants read that memory as [E, D, I]. The row-fused
kernel is production since c4742a1, which stores W_down [E, D, I] (probe_moe_t1.make_layers too): now the row
variants read the layers as stored, "production layer" is the row-fused kernel itself, and the stripe variants
read the memory as [E, I, D].

Result (RESULTS.md, "Session 10"): one output feature per one-warp program, slots written out, the shared expert
first and a PDL trigger: layer span 33.8-34.3 µs against 35.2-35.6 for the stripes + combine in the same calls.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_down_rows_fused.py --set s10c1`; `--toy`:
a CPU smoke run in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_panels as pp
import probe_moe_splitk as ps
import probe_moe_t1 as pt
from pallas_kernels.common import interpret_mode
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.common.prefetch import prefetch_l2
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

TU = ex.DECODE_TUNING
F32 = jnp.float32


def gate_up_h(x, ids, lay, early_launch=False, bi=TU.block_i, bk=TU.block_k):
    """The production T = 1 gate/up launch (routed + shared) -> h [K + 1, 1, I]; early_launch: its programs first
    admit the down launch (PDL); bi, bk: its ExpertsTuning block_i, block_k."""
    d, (i, k) = x.shape[1], (lay["sg"].shape[0], ids.shape[1])
    bk = min(bk, d)
    if d % bk:  # as run in S10 5, BK 1024 read 2048 of D = 2560 columns (its rows' errors 0.59): refused since
        raise ValueError(f"gate_up_h: BK={bk} must divide D={d}")
    return pl.pallas_call(
        functools.partial(ex.experts_fwd_kernel_gate_up, BK=bk, n_chunks=d // bk, n_routed=k,
                          limit=pt.LIMITS["limit"], shared_limit=pt.LIMITS["shared_limit"], has_shared=True,
                          mode=TU.t1_gate_up, eviction=TU.routed_eviction, early_launch=early_launch),
        grid=(k + 1, i // bi), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=TU.warps_gate_up, num_stages=TU.stages_gate_up),
        interpret=interpret_mode(), name="experts_fwd_kernel_gate_up",
    )(x, ids.reshape(-1), lay["wg"], lay["wu"], lay["sg"], lay["su"])


def _rows_out(h_ref, s, load, *, BKI, n_chunks, dt, reduce_once=False):
    """One expert's output for the program's BD rows: [BD] fp32 holding values rounded to dt (as the reference).
    reduce_once: the chunks' products summed elementwise, one cross-lane reduction per expert instead of one per
    chunk (else: experts._down_fma, the production kernel's form)."""
    if not reduce_once:
        return ex._down_fma(lambda ks: h_ref[s, :, ks], load, BKI=BKI, n_chunks=n_chunks, dt=dt)
    acc = None
    for c in range(n_chunks):  # written out: the expert's whole rows are loaded together
        ks = pl.ds(c * BKI, BKI)
        part = load(ks).astype(F32) * h_ref[s, :, ks].astype(F32)
        acc = part if acc is None else acc + part
    return jnp.sum(acc, axis=1).astype(dt).astype(F32)


def down_rows_fused_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, y_ref, *, BKI, n_chunks, n_routed, sps,
                           shared_first, eviction, reduce_once, early_launch, prefetch_from):
    # h_ref [K + 1, 1, I]; ids_ref [K] int32; w_ref [K] fp32; wd_ref [E, D, I]; sd_ref [D, I]; y_ref [1, BD]
    # prefetch_from: slots >= this have their rows handed to L2 first (cp.async.bulk.prefetch.L2; n_routed: none)
    if early_launch:
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    row0 = pl.multiple_of(pl.program_id(0) * bd, bd)
    rows = pl.ds(row0, bd)
    ids, wts = ids_ref[...], w_ref[...]
    i_k = lax.iota(jnp.int32, n_routed)
    _, d, i = wd_ref.shape
    for s in range(prefetch_from, n_routed):
        e = jnp.sum(jnp.where(i_k == s, ids, 0))
        prefetch_l2(wd_ref, (e * d + row0) * i, bd * i * wd_ref.dtype.itemsize, evict_last=False)
    out = functools.partial(_rows_out, h_ref, BKI=BKI, n_chunks=n_chunks, dt=dt, reduce_once=reduce_once)

    def routed(s):
        e = jnp.sum(jnp.where(i_k == s, ids, 0))
        w_s = jnp.sum(jnp.where(i_k == s, wts, 0.0))
        return w_s * out(s, lambda ks: ex._load(wd_ref, (e, rows, ks), eviction))

    def step(q, tot):
        for u in range(sps):
            tot = tot + routed(q * sps + u)
        return tot

    shared = out(n_routed, lambda ks: sd_ref[rows, ks]) if shared_first else None
    if sps == n_routed:
        tot = step(jnp.int32(0), jnp.zeros((bd,), F32))
    else:
        tot = lax.fori_loop(0, n_routed // sps, step, jnp.zeros((bd,), F32))
    if shared is None:
        shared = out(n_routed, lambda ks: sd_ref[rows, ks])
    y_ref[...] = (tot.astype(dt) + shared.astype(dt))[None, :]


def down_rows_fused(h, w, ids, wd_rows, sd_rows, *, bd, warps, sps=8, shared_first=False, eviction=TU.routed_eviction,
                    reduce_once=False, gather=False, early_launch=False, bki=256, prefetch_from=None):
    k, _, i = h.shape
    k -= 1
    d = sd_rows.shape[0]
    bki = min(bki, i & -i)
    return pl.pallas_call(
        functools.partial(down_rows_gather_kernel, BKI=bki, n_chunks=i // bki, n_routed=k, eviction=eviction,
                          early_launch=early_launch)
        if gather else
        functools.partial(down_rows_fused_kernel, BKI=bki, n_chunks=i // bki, n_routed=k, sps=sps,
                          shared_first=shared_first, eviction=eviction, reduce_once=reduce_once,
                          early_launch=early_launch, prefetch_from=k if prefetch_from is None else prefetch_from),
        grid=(d // bd,), in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)), out_shape=jax.ShapeDtypeStruct((1, d), h.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret_mode(), name="experts_fwd_kernel_down_rows_fused",
    )(h, ids.reshape(-1), w.reshape(-1), wd_rows, sd_rows)


def down_rows_gather_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, y_ref, *, BKI, n_chunks, n_routed, eviction,
                            early_launch):
    # As down_rows_fused_kernel, each chunk's loads for all K routed experts in one gather: wd_ref[ids, rows, ks]
    # -> [K, BD, BKI] (one load op, its K·BD·BKI·2 bytes issued together).
    if early_launch:
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
    ids, wts = ids_ref[...], w_ref[...]
    acc = None
    for c in range(n_chunks):
        ks = pl.ds(c * BKI, BKI)
        w_t = ex._load(wd_ref, (ids, rows, ks), eviction).astype(F32)  # [K, BD, BKI]
        part = jnp.sum(w_t * h_ref[pl.ds(0, n_routed), :, ks].astype(F32), axis=2)  # [K, BD]
        acc = part if acc is None else acc + part
    routed = jnp.sum(wts[:, None] * acc.astype(dt).astype(F32), axis=0)
    shared = _rows_out(h_ref, n_routed, lambda ks: sd_ref[rows, ks], BKI=BKI, n_chunks=n_chunks, dt=dt)
    y_ref[...] = (routed.astype(dt) + shared.astype(dt))[None, :]


def down_rows_slot_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed, eviction):
    # grid (K + 1, D / BD); o_ref [1, BD] fp32 partial of slot s (s = K: the shared expert, unweighted)
    s = pl.program_id(0)
    bd = o_ref.shape[1]
    rows = pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)
    out = functools.partial(_rows_out, h_ref, BKI=BKI, n_chunks=n_chunks, dt=wd_ref.dtype)
    i_k = lax.iota(jnp.int32, n_routed)

    @pl.when(s < n_routed)
    def _():
        e = jnp.sum(jnp.where(i_k == s, ids_ref[...], 0))
        w_s = jnp.sum(jnp.where(i_k == s, w_ref[...], 0.0))
        o_ref[...] = (w_s * out(s, lambda ks: ex._load(wd_ref, (e, rows, ks), eviction)))[None, :]

    @pl.when(s == n_routed)
    def _():
        o_ref[...] = out(s, lambda ks: sd_ref[rows, ks])[None, :]


def down_rows_slots(h, w, ids, wd_rows, sd_rows, *, bd, warps):
    k, _, i = h.shape
    k -= 1
    d = sd_rows.shape[0]
    bki = min(256, i & -i)
    parts = pl.pallas_call(
        functools.partial(down_rows_slot_kernel, BKI=bki, n_chunks=i // bki, n_routed=k, eviction=TU.routed_eviction),
        grid=(k + 1, d // bd), in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.BlockSpec((None, 1, bd), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, d), F32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret_mode(), name="experts_fwd_kernel_down_rows",
    )(h, ids.reshape(-1), w.reshape(-1), wd_rows, sd_rows)
    return jnp.sum(parts[:k], axis=0).astype(h.dtype) + parts[k].astype(h.dtype)


def _stripes_dot(load_h, load_d, *, BKI, n_chunks, bd, dt):
    """The session-9 down kernel's product: h [1, BKI] (broadcast to 16 rows) · W_down stripe tiles [BKI, BD] on the
    tensor cores -> [1, BD] fp32 holding values rounded to dt."""
    def body(c, acc):
        ks = pl.ds(pl.multiple_of(c * BKI, BKI), BKI)
        w = load_d(ks)
        prec = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        return acc + jnp.dot(jnp.broadcast_to(load_h(ks), (16, BKI)), w, precision=prec,
                             preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((16, bd), F32))
    return ex._token_rows(acc, 1).astype(dt).astype(F32)


def down_panels_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed, eviction):
    # wd_ref [E, D / BD, I, BD]; sd_ref [D / BD, I, BD]; grid (K + 1, D / BD); o_ref [1, BD] fp32 partial
    s, j = pl.program_id(0), pl.program_id(1)
    bd = o_ref.shape[1]
    whole = pl.ds(0, bd)
    i_k = lax.iota(jnp.int32, n_routed)

    def out(load):
        return _stripes_dot(lambda ks: h_ref[s, :, ks], load, BKI=BKI, n_chunks=n_chunks, bd=bd,
                            dt=wd_ref.dtype)

    @pl.when(s < n_routed)
    def _():
        e = jnp.sum(jnp.where(i_k == s, ids_ref[...], 0))
        w_s = jnp.sum(jnp.where(i_k == s, w_ref[...], 0.0))
        o_ref[...] = w_s * out(lambda ks: ex._load(wd_ref, (e, j, ks, whole), eviction))

    @pl.when(s == n_routed)
    def _():
        o_ref[...] = out(lambda ks: sd_ref[j, ks, whole])


def down_panels(h, w, ids, wd_p, sd_p):
    k, _, i = h.shape
    k -= 1
    n_p, _, bd = sd_p.shape
    bki = min(256, i & -i)
    parts = pl.pallas_call(
        functools.partial(down_panels_kernel, BKI=bki, n_chunks=i // bki, n_routed=k, eviction=TU.routed_eviction),
        grid=(k + 1, n_p), in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.BlockSpec((None, 1, bd), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, n_p * bd), F32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),  # the session-9 down kernel's
        interpret=interpret_mode(), name="experts_fwd_kernel_down_panels",
    )(h, ids.reshape(-1), w.reshape(-1), wd_p, sd_p)
    return jnp.sum(parts[:k], axis=0).astype(h.dtype) + parts[k].astype(h.dtype)


def as_stripes(w):
    """The memory of w [.., D, I] read as [.., I, D] (a reshape: no data moves), for the stripe variants."""
    *lead, d, i = w.shape
    return w.reshape(*lead, i, d)


def _route(x, lay):
    return router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW, prefetch=(lay["sg"], lay["su"], lay["sd"]))


def rows_layer(fused=True, early_gate_up=False, gate_up_bi=TU.block_i, gate_up_bk=TU.block_k, **kw):
    def f(x, lay):
        w, ids = _route(x, lay)
        h = gate_up_h(x, ids, lay, early_launch=early_gate_up, bi=gate_up_bi, bk=gate_up_bk)
        down = down_rows_fused if fused else down_rows_slots
        # The layers store W_down [.., D, I] since session 10 (as run: their [.., I, D] memory read as [.., D, I])
        return down(h, w, ids, lay["wd"], lay["sd"], **kw)
    return f


def rows_reference(x, lay):
    """The reference layer on W_down as the row variants read it (as stored)."""
    return pt.reference_layer(x, lay)


PANEL = 64  # the stripe width of the session-9 down kernel (its block_d)


def panels_layer(x, lay):
    bd = min(PANEL, x.shape[1])
    w, ids = _route(x, lay)
    h = gate_up_h(x, ids, lay)
    return down_panels(h, w, ids, *(pp.as_panels(as_stripes(lay[n]), bd) for n in ("wd", "sd")))


def panels_reference(x, lay):
    bd = min(PANEL, x.shape[1])
    logical = {n: jnp.swapaxes(pp.panels_to_rows(pp.as_panels(as_stripes(lay[n]), bd)), -1, -2)
               for n in ("wd", "sd")}
    return pt.reference_layer(x, {**lay, **logical})


def _fused(bd, warps, sps=8, **kw):
    return (f"dep: rows fused BD {bd}, {warps} warps, {sps} slots/step" + "".join(f", {k} {v}" for k, v in kw.items()),
            rows_layer(bd=bd, warps=warps, sps=sps, **kw), rows_reference)


VARIANTS = {
    "s10c1": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _fused(2, 1, 1),
        _fused(4, 1, 1),
        _fused(4, 1, 2),
        _fused(2, 1, 8),
        _fused(8, 2, 1),
        _fused(8, 2, 2),
        _fused(16, 4, 2),
        _fused(4, 1, 2, shared_first=True),
        ("dep: rows per slot BD 4 + XLA combine", rows_layer(fused=False, bd=4, warps=1), rows_reference),
        ("dep: rows per slot BD 8, 2 warps + XLA combine", rows_layer(fused=False, bd=8, warps=2), rows_reference),
        ("dep: stripe panels", panels_layer, panels_reference),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
    "s10c2": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _fused(2, 1),
        _fused(2, 1, reduce_once=True),
        _fused(1, 1),
        _fused(1, 1, reduce_once=True),
        _fused(4, 1, reduce_once=True),
        _fused(2, 1, eviction=None),
        _fused(2, 1, 4),
        _fused(1, 1, gather=True),
        _fused(2, 1, gather=True),
        _fused(4, 2, gather=True),
        _fused(2, 1, gather=True, eviction=None),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
    "s10c3": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _fused(1, 1),
        _fused(1, 1, early_launch=True),
        _fused(1, 1, early_launch=True, early_gate_up=True),
        _fused(1, 1, early_gate_up=True),
        _fused(1, 1, bki=128),
        _fused(1, 2),
        _fused(1, 2, gather=True),
        _fused(1, 4, gather=True),
        _fused(1, 1, reduce_once=True, early_launch=True),
        _fused(1, 1),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
    "s10c4": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _fused(1, 1, early_launch=True),
        _fused(1, 1, early_launch=True, prefetch_from=0),
        _fused(1, 1, early_launch=True, prefetch_from=4),
        _fused(1, 1, early_launch=True, prefetch_from=6),
        _fused(2, 1, early_launch=True, prefetch_from=0),
        _fused(1, 1, early_launch=True, shared_first=True),
        _fused(1, 1, early_launch=True, eviction=None),
        _fused(1, 1, early_launch=True),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
    "s10c5": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _fused(1, 1, early_launch=True),
        _fused(1, 1, early_launch=True, shared_first=True),
        _fused(1, 1, early_launch=True, gate_up_bi=1),
        _fused(1, 1, early_launch=True, gate_up_bi=1, gate_up_bk=256),
        # as run, two rows with gate/up BK 1024 here read 2048 of D = 2560 columns (void; gate_up_h refuses it now)
        _fused(1, 1, early_launch=True, gate_up_bi=1, shared_first=True),
        _fused(1, 1, early_launch=True, shared_first=True),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
}


if __name__ == "__main__":
    ps.run_sets("probe_moe_down_rows_fused", VARIANTS, "s10c5")
