"""Probe: Pallas Mosaic GPU ("plgpu": TMA copies, multi-stage pipelines, wgmma) for the T = 1 MoE expert products.

Q1: how fast does a Mosaic GPU kernel stream expert rows? The gate (or gate + up) GEMV y[s, i] = Σ_d W[e_s, i, d] x[d]
over 9 slots, W [E, I, D] bf16, fp32 accumulation; Pallas-Triton's best read-only kernels stream 70.8 MB in 17.1 µs
and 35.4 MB in 11.7 µs (RESULTS.md "MoE, session 4").
Q2: does PDL prefetch-before-wait pay? A chain per layer of A (the gate GEMV, writing h) then B (the down product
y[s] = h[s] @ Wd[e_s], Wd [E, I, D]); B waits for A (`griddepcontrol.wait`) before any load, or issues its first
pipeline stages of weight loads before the wait and reads h only after it. Reported: the timeline span A start to
B end per layer (PDL overlaps the two kernels, so their durations' sum overstates).

Design (both kernels, one warpgroup per CTA, every loop unrolled in Python so all smem slots and slices are static):
the activation is the wgmma A operand, a [64, BK] tile whose rows are all x (or h) -- the tensor core needs M = 64,
compute is free at T = 1, and row 0 of the [64, BN] accumulator is the answer -- and the weight tile is operand B:
[BN, BK] transposed for gate/up (rows of D contiguous), [BK, BN] as is for down. With XR = 8 only 8 activation rows
are loaded (the other 56 smem rows are never written: their garbage only reaches accumulator rows 8..63, not read).
Each stage: one TMA for the weight tile and one for the activation tile, each on its own barrier. The "emit_pipeline"
rows run the same gate product through jax's own plgpu.emit_pipeline instead, to cross-check the hand pipeline.
PDL: a Mosaic GPU kernel that calls plgpu.griddepcontrol_wait() is launched by XLA with programmatic stream
serialization (the `mosaic_gpu.uses_pdl` attribute, present in the lowered B kernels of the "wait"/"prefetch" rows and
absent in "no PDL"); "+A ld": A calls griddepcontrol.launch_dependents at its start, so B may launch while A still
runs (otherwise B launches as A's CTAs exit).

Each variant is checked on layer 0 against the jnp reference (relative error, every written accumulator row), then
profiled over NL = 8 cold layers in one jit (per-kernel device µs as probe_moe_t1.per_kernel_us; plus span per
layer; for chains the A-start-to-B-end span and B start - A end, negative where PDL overlaps them).

Run on the GPU (<= 150 s): `PYTHONPATH=.:experiments timeout 150 python3 experiments/probe_mgpu.py`.
CPU smoke (Mosaic GPU interpret mode, toy sizes, against the jnp reference; then CUDA lowering of every variant at
full size): `PYTHONPATH=.:experiments JAX_PLATFORMS=cpu python3 experiments/probe_mgpu.py --toy`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_t1 import rel_err  # noqa: E402
from profile_ops import call_span_us, durations_by_name, split_calls, trace_kernels  # noqa: E402

FULL = (512, 768, 2560, 8)  # E, I, D (Ling-3.0-flash experts), NL layers (8 x 6 GB: cold, > 60 MB L2)
NS, M = 9, 64  # slots (8 routed + 1 shared at T = 1), wgmma rows
SMEM_LIMIT = 227 * 1024  # H100/H200 max dynamic smem per block
WG = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


@dataclasses.dataclass(frozen=True)
class Cfg:
    bn: int  # output columns per CTA (gate: rows of W, I; down: columns of W, D)
    bk: int  # contraction tile
    stages: int
    ks: int = 1  # split-K programs (partial outputs, summed outside)
    xr: int = M  # activation rows loaded per tile (M or 8)
    out_rows: int = 8  # accumulator rows written (all equal row 0; 64 to feed the next kernel's A operand)
    out_dtype: object = jnp.float32
    pdl: str = "none"  # B only: "none" (no griddepcontrol), "wait" (wait first), "prefetch" (weights, wait, h)
    launch_dependents: bool = False  # griddepcontrol.launch_dependents at the start (lets a PDL successor launch)
    ep: bool = False  # gate only: jax's plgpu.emit_pipeline (as in its ragged_dot_mgpu) instead of _pipelined


def smem_bytes(c: Cfg) -> int:
    return c.stages * (c.bn * c.bk + M * c.bk) * 2 + M * c.bn * jnp.dtype(c.out_dtype).itemsize + 1024


def _tiled(bk):  # bf16 tiles: 128-byte swizzle over 64-element rows, as jax's Hopper matmul examples do
    sw = plgpu.find_swizzle(min(bk, 64) * 16)
    return (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))


def _slot_id(ids_g, s):
    """ids_g[s] for a dynamic s via static scalar loads (9 of them) and selects."""
    e = ids_g[0]
    for j in range(1, ids_g.shape[0]):
        e = jnp.where(s == j, ids_g[j], e)
    return e


def _pipelined(c: Cfg, nk, w_src, x_src, w_s, x_s, wbar, xbar, *, trans_b, before_x=None):
    """acc [M, bn] = Σ_j X_j @ W_j over nk static steps, c.stages TMA loads in flight. w_src(j) / x_src(j): the GMEM
    tiles of step j. before_x: called after the first stages' weight loads are issued, before any activation load
    (the PDL wait of the prefetch variant)."""
    def x_dst(slot):
        return x_s.at[slot] if c.xr == M else x_s.at[slot, pl.ds(0, c.xr)]

    def issue_w(j):
        plgpu.copy_gmem_to_smem(w_src(j), w_s.at[j % c.stages], wbar.at[j % c.stages])

    def issue_x(j):
        plgpu.copy_gmem_to_smem(x_src(j), x_dst(j % c.stages), xbar.at[j % c.stages])

    first = range(min(c.stages, nk))
    for j in first:
        issue_w(j)
    if before_x is not None:
        before_x()
    for j in first:
        issue_x(j)

    def scope(acc):
        for j in range(nk):
            slot = j % c.stages
            plgpu.barrier_wait(wbar.at[slot])
            plgpu.barrier_wait(xbar.at[slot])
            w = w_s.at[slot]
            plgpu.wgmma(acc, x_s.at[slot], w.transpose((1, 0)) if trans_b else w)
            plgpu.wgmma_wait(0)  # the slot is free again: compute is trivial, the loads in flight are what matter
            if j + c.stages < nk:
                issue_w(j + c.stages)
                issue_x(j + c.stages)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC((M, c.bn), jnp.float32))


def _store(c: Cfg, acc, o_s, dst):
    o_s[...] = acc.astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s if c.out_rows == M else o_s.at[pl.ds(0, c.out_rows)], dst)
    plgpu.wait_smem_to_gmem(0)


def _scratch(c: Cfg, trans_b):
    assert smem_bytes(c) <= SMEM_LIMIT, (c, smem_bytes(c))
    return [plgpu.SMEM((M, c.bn), c.out_dtype),
            plgpu.SMEM((c.stages, c.bn, c.bk) if trans_b else (c.stages, c.bk, c.bn), jnp.bfloat16,
                       transforms=_tiled(c.bk if trans_b else c.bn)),
            plgpu.SMEM((c.stages, M, c.bk), jnp.bfloat16, transforms=_tiled(c.bk)),
            plgpu.Barrier(num_barriers=c.stages), plgpu.Barrier(num_barriers=c.stages)]


def gate_gemv(xs, ws, ids, c: Cfg, interpret=None):
    """xs [xr, D] bf16 (every row x); ws: G weights [E, I, D] bf16; ids [NS] int32.
    Returns [G * KS * NS, out_rows, I] (index (g·KS + kc)·NS + s; every row y; sum over kc outside)."""
    G, (E, I, D), ns = len(ws), ws[0].shape, ids.shape[0]
    assert xs.shape == (c.xr, D) and all(w.shape == (E, I, D) for w in ws) and I % c.bn == 0
    assert D % (c.ks * c.bk) == 0 and c.bk % 64 == 0 and c.bn % 8 == 0 and c.out_rows <= c.xr
    assert not c.ep or c.xr == M
    dk = D // c.ks
    nk = dk // c.bk
    c = dataclasses.replace(c, pdl="none")

    def body(ids_g, x_g, *refs):
        w_gs = refs[:G]
        o_g, o_s, w_s, x_s, wbar, xbar = refs[G:] if not c.ep else (*refs[G:], None, None, None, None)
        gs, b, kc = lax.axis_index("gs"), lax.axis_index("b"), lax.axis_index("kc")
        g, s = gs // ns, gs % ns
        if c.launch_dependents and interpret is None:
            plgpu.griddepcontrol_launch_dependents()
        e = _slot_id(ids_g, s)
        rows = pl.ds(b * c.bn, c.bn)
        cols = lambda j: pl.ds(kc * dk + j * c.bk, c.bk)  # noqa: E731

        def run(w_g):
            if c.ep:
                return run_ep(w_g)
            acc = _pipelined(c, nk, lambda j: w_g.at[e, rows, cols(j)], lambda j: x_g.at[:, cols(j)],
                             w_s, x_s, wbar, xbar, trans_b=True)
            _store(c, acc, o_s, o_g.at[(g * c.ks + kc) * ns + s, :, rows])

        def run_ep(w_g):  # jax's own pipeline, as ragged_dot_mgpu.py uses it (its BlockSpecs, delay_release 1)
            def scope(acc_ref):
                plgpu.emit_pipeline(
                    lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0))),
                    grid=(nk,),
                    in_specs=[plgpu.BlockSpec((M, c.bk), lambda k: (0, k), delay_release=1),
                              plgpu.BlockSpec((c.bn, c.bk), lambda k: (b, k), delay_release=1)],
                    max_concurrent_steps=c.stages,
                )(x_g if c.ks == 1 else x_g.at[:, pl.ds(kc * dk, dk)],
                  w_g.at[e] if c.ks == 1 else w_g.at[e, :, pl.ds(kc * dk, dk)])
                return acc_ref[...]

            acc = pl.run_scoped(scope, plgpu.ACC((M, c.bn), jnp.float32))
            _store(c, acc, o_s, o_g.at[(g * c.ks + kc) * ns + s, :, rows])

        if G == 1:
            run(w_gs[0])
        for gi in range(G if G > 1 else 0):
            pl.when(g == gi)(lambda gi=gi: run(w_gs[gi]))

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((G * c.ks * ns, c.out_rows, I), c.out_dtype),
        scratch_types=_scratch(c, True)[:1] if c.ep else _scratch(c, True), grid=(G * ns, I // c.bn, c.ks),
        grid_names=("gs", "b", "kc"),
        compiler_params=WG, interpret=interpret, kernel_name="mgpu_gate_gemv")(ids, xs, *ws)


def down(h, wd, ids, c: Cfg, interpret=None):
    """h [NS, xr, I] bf16 (every row h[s]); wd [E, I, D] bf16. Returns [NS, out_rows, D] (every row y[s])."""
    (_, I, D), ns = wd.shape, ids.shape[0]
    assert h.shape == (ns, c.xr, I) and D % c.bn == 0 and I % c.bk == 0 and c.ks == 1
    assert c.bn % 64 == 0 and c.bk % 64 == 0 and c.out_rows <= c.xr
    nk = I // c.bk
    pdl = c.pdl if interpret is None else "none"  # interpret mode has no griddepcontrol

    def body(ids_g, h_g, w_g, o_g, o_s, w_s, x_s, wbar, xbar):
        s, n = lax.axis_index("s"), lax.axis_index("n")
        if c.launch_dependents and interpret is None:
            plgpu.griddepcontrol_launch_dependents()
        if pdl == "wait":
            plgpu.griddepcontrol_wait()
        e = _slot_id(ids_g, s)  # ids do not come from A: safe to read before the wait
        cols = pl.ds(n * c.bn, c.bn)
        ks = lambda j: pl.ds(j * c.bk, c.bk)  # noqa: E731
        acc = _pipelined(c, nk, lambda j: w_g.at[e, ks(j), cols], lambda j: h_g.at[s, :, ks(j)],
                         w_s, x_s, wbar, xbar, trans_b=False,
                         before_x=plgpu.griddepcontrol_wait if pdl == "prefetch" else None)
        _store(c, acc, o_s, o_g.at[s, :, cols])

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ns, c.out_rows, D), c.out_dtype), scratch_types=_scratch(c, False),
        grid=(ns, D // c.bn), grid_names=("s", "n"), compiler_params=WG, interpret=interpret,
        kernel_name=f"mgpu_down_{pdl}")(ids, h, wd)


# ---- references (fp32 accumulation of the bf16 products; HIGHEST: no TF32 on the GPU) ----
HI = lax.Precision.HIGHEST

def gate_ref(x, w, ids):
    return jnp.einsum("sid,d->si", w[ids].astype(jnp.float32), x.astype(jnp.float32), precision=HI)


def down_ref(h, wd, ids):
    return jnp.einsum("si,sid->sd", h.astype(jnp.float32), wd[ids].astype(jnp.float32), precision=HI)


# ---- variants ----

def _c(bn, bk, stages, **kw):
    return Cfg(bn, bk, stages, **kw)


# Q1: (label, G, cfg). Grids: 9·G·(768/BN)·KS CTAs; one CTA per SM above ~114 KB of smem.
Q1 = [
    ("gate BN64 BK128 S4", 1, _c(64, 128, 4)),
    ("gate BN64 BK128 S4 XR8", 1, _c(64, 128, 4, xr=8)),
    ("gate BN64 BK256 S3", 1, _c(64, 256, 3)),
    ("gate BN64 BK64 S5 KS2", 1, _c(64, 64, 5, ks=2)),
    ("gate BN128 BK128 S3 KS2", 1, _c(128, 128, 3, ks=2)),
    ("gate BN128 BK64 S6 KS2", 1, _c(128, 64, 6, ks=2)),
    ("gate BN64 BK256 S3 XR8", 1, _c(64, 256, 3, xr=8)),
    ("gate BN256 BK64 S3 KS4", 1, _c(256, 64, 3, ks=4)),
    ("gate BN32 BK128 S4 XR8", 1, _c(32, 128, 4, xr=8)),  # 105 KiB: 2 CTAs per SM, 216 CTAs in one wave
    ("gate+up BN64 BK128 S4", 2, _c(64, 128, 4)),
    ("gate+up BN64 BK128 S4 XR8", 2, _c(64, 128, 4, xr=8)),
    ("gate+up BN128 BK64 S6", 2, _c(128, 64, 6)),
    ("gate+up BN64 BK64 S5", 2, _c(64, 64, 5)),  # 97 KiB: 2 CTAs per SM, 216 CTAs in one wave
    ("gate+up BN64 BK64 S5 XR8", 2, _c(64, 64, 5, xr=8)),
    ("gate emit_pipeline BN64 BK128 S4", 1, _c(64, 128, 4, ep=True)),
    ("gate emit_pipeline BN128 BK64 S6 KS2", 1, _c(128, 64, 6, ks=2, ep=True)),
    ("gate+up emit_pipeline BN64 BK128 S4", 2, _c(64, 128, 4, ep=True)),
]
Q1_FIRST = ("gate BN64 BK128 S4", "gate BN64 BK128 S4 XR8", "gate emit_pipeline BN64 BK128 S4",
            "gate BN128 BK64 S6 KS2", "gate+up BN64 BK128 S4")
# Q2: A (gate GEMV writing h as bf16 rows for B's A operand) then B (down). (label, A cfg, B cfg)
A_CHAIN = _c(64, 128, 4, out_rows=M, out_dtype=jnp.bfloat16)
A_CHAIN8 = _c(64, 128, 4, xr=8, out_rows=8, out_dtype=jnp.bfloat16)
B1, B2 = _c(128, 64, 4), _c(64, 128, 4)  # B grids: 9·20 = 180 and 9·40 = 360 CTAs; smem 129 and 145 KiB
LD = dataclasses.replace(A_CHAIN, launch_dependents=True)
Q2 = [
    ("chain B BN128 BK64 S4 no PDL", A_CHAIN, B1),
    ("chain B BN128 BK64 S4 wait", A_CHAIN, dataclasses.replace(B1, pdl="wait")),
    ("chain B BN128 BK64 S4 prefetch", A_CHAIN, dataclasses.replace(B1, pdl="prefetch")),
    ("chain B BN128 BK64 S4 wait +A ld", LD, dataclasses.replace(B1, pdl="wait")),
    ("chain B BN128 BK64 S4 prefetch +A ld", LD, dataclasses.replace(B1, pdl="prefetch")),
    ("chain B BN64 BK128 S4 no PDL", A_CHAIN, B2),
    ("chain B BN64 BK128 S4 wait +A ld", LD, dataclasses.replace(B2, pdl="wait")),
    ("chain B BN64 BK128 S4 prefetch +A ld", LD, dataclasses.replace(B2, pdl="prefetch")),
    ("chain XR8 B BN128 BK64 S4 wait +A ld", dataclasses.replace(A_CHAIN8, launch_dependents=True),
     _c(128, 64, 4, xr=8, pdl="wait")),
    ("chain XR8 B BN128 BK64 S4 prefetch +A ld", dataclasses.replace(A_CHAIN8, launch_dependents=True),
     _c(128, 64, 4, xr=8, pdl="prefetch")),
]
# "+A ld": A calls griddepcontrol.launch_dependents at its start, so B (launched with PDL whenever it uses
# griddepcontrol.wait) may start as soon as every A CTA is resident; without it, B launches as A's CTAs exit.


def q1_fn(G, c, interpret=None):
    def f(xs, lay):
        return gate_gemv(xs, [lay["wg"], lay["wu"]][:G], lay["ids"], c, interpret)
    return f


def q1_check(G, c, x, lay, interpret=None):
    out = np.asarray(q1_fn(G, c, interpret)(jnp.broadcast_to(x, (c.xr, x.shape[0])), lay), np.float64)
    out = out.reshape(G, c.ks, NS, c.out_rows, -1).sum(1)
    ref = np.stack([np.asarray(gate_ref(x, w, lay["ids"])) for w in [lay["wg"], lay["wu"]][:G]])
    return max(rel_err(out[:, :, r], ref) for r in range(c.out_rows))  # every written row must be y


def q2_fn(a, b, interpret=None):
    def f(xs, lay):
        h = gate_gemv(xs, [lay["wg"]], lay["ids"], a, interpret)  # [NS, rows, I] bf16
        return down(h, lay["wd"], lay["ids"], b, interpret)
    return f


def q2_check(a, b, x, lay, interpret=None):
    out = np.asarray(q2_fn(a, b, interpret)(jnp.broadcast_to(x, (a.xr, x.shape[0])), lay), np.float64)
    h = gate_ref(x, lay["wg"], lay["ids"]).astype(jnp.bfloat16)  # A's bf16 output, as B reads it
    ref = np.asarray(down_ref(h, lay["wd"], lay["ids"]))
    return max(rel_err(out[:, r], ref) for r in range(b.out_rows))


# ---- timing ----

def profile_row(label, fn, xs, lays, n=10, pair=False):
    """Per-kernel median device µs over n traced runs of all layers in one jit (cold: each layer its own weights),
    as probe_moe_t1.per_kernel_us; the timeline span per call / layers; for a chain (pair) the median span from A's
    start to B's end per layer and B's start minus A's end (negative: PDL overlap)."""
    run = jax.jit(lambda xs, lays: [fn(xs, lay) for lay in lays])
    events = trace_kernels(lambda: run(xs, lays), n)
    if not events:
        raise RuntimeError("no GPU events in the trace")
    by_name = durations_by_name(events)
    ks = {k: (round(statistics.median(v), 2), len(v) / (n * len(lays))) for k, v in by_name.items()}
    calls = [c for c in split_calls(events) if len(c) == (2 if pair else 1) * len(lays)]
    row = dict(label=label, kernels=ks, total_us=round(sum(u * p for u, p in ks.values()), 2), calls=len(calls),
               kernels_per_call=sorted({len(c) for c in split_calls(events)}))
    if calls:
        row["span_per_layer_us"] = round(call_span_us(calls) / len(lays), 2)
    if pair and calls:  # events per call: A0 B0 A1 B1 ... (b_names shows whether the pairing held)
        ab = [(c[i], c[i + 1]) for c in calls for i in range(0, len(c), 2)]
        row["b_names"] = sorted({b[0][:40] for _, b in ab})
        row["span_ab_us"] = round(statistics.median(max(a[1] + a[2], b[1] + b[2]) - a[1] for a, b in ab), 2)
        row["b_start_minus_a_end_us"] = round(statistics.median(b[1] - (a[1] + a[2]) for a, b in ab), 2)
    return row


def make_layers(nl, E, I, D):
    lays = []
    for l in range(nl):
        k = jax.random.split(jax.random.key(l), 4)
        bf = jnp.bfloat16
        ids = jax.random.choice(k[3], E, (NS,), replace=False).astype(jnp.int32)
        lays.append(dict(wg=jax.random.normal(k[0], (E, I, D), bf) * D ** -0.5,
                         wu=jax.random.normal(k[1], (E, I, D), bf) * D ** -0.5,
                         wd=jax.random.normal(k[2], (E, I, D), bf) * I ** -0.5, ids=ids))
    return jax.random.normal(jax.random.key(99), (D,), jnp.bfloat16), lays


def toy(results):
    """CPU: interpret mode at toy sizes against the references, then CUDA lowering of every variant at full size."""
    E, I, D = 16, 128, 256
    x, lays = make_layers(1, E, I, D)
    lay = lays[0]

    def toy_row(label, check):  # one variant's interpreted check; a failure is printed, the others still run
        try:
            err = check(interpret=plgpu.InterpretGPUParams())
            print(f"toy {label:40s}: rel err {err:.2e}", flush=True)
            results["toy"].append(dict(label=label, err=err))
        except Exception as exc:
            print(f"toy {label}: {type(exc).__name__}: {str(exc)[:800]}", flush=True)

    for label, G, c in Q1:
        c = dataclasses.replace(c, bn=min(c.bn, 64), ks=min(c.ks, 2), bk=min(c.bk, 128))
        toy_row(f"{label} -> {c}", functools.partial(q1_check, G, c, x, lay))
    for label, a, b in Q2:
        a, b = dataclasses.replace(a, bn=64), dataclasses.replace(b, bn=64, bk=64)
        toy_row(label, functools.partial(q2_check, a, b, x, lay))
    E, I, D, _ = FULL
    sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    lay = dict(wg=sd((E, I, D)), wu=sd((E, I, D)), wd=sd((E, I, D)), ids=sd((NS,), jnp.int32))
    for label, G, c in Q1:
        _lower(label, q1_fn(G, c), sd((c.xr, D)), lay)
    for label, a, b in Q2:
        _lower(label, q2_fn(a, b), sd((a.xr, D)), lay)


def _lower(label, fn, *avals):
    try:
        t0 = time.perf_counter()
        txt = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lower cuda {label:44s} ok ({txt.count('mosaic_gpu')} mosaic_gpu mentions, "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception as exc:
        print(f"lower cuda {label}: {type(exc).__name__}: {str(exc)[:800]}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--toy", action="store_true", help="CPU: interpret at toy sizes + CUDA lowering")
    p.add_argument("--n", type=int, default=6, help="traced runs per variant")
    p.add_argument("--only", default="", help="comma list of label substrings to run")
    p.add_argument("--budget", type=float, default=135.0, help="start no variant after this many seconds")
    args = p.parse_args(argv)
    results = {**run_header(), "rows": [], "toy": []}
    if args.toy:
        toy(results)
        write_results("probe_mgpu_toy.json", results, to_repo=False)
        return
    t_start = time.perf_counter()
    E, I, D, NL = FULL
    x, lays = make_layers(NL, E, I, D)
    jax.block_until_ready(lays)
    print(f"weights ready ({time.perf_counter() - t_start:.1f} s)", flush=True)
    keep = lambda label: not args.only or any(s in label for s in args.only.split(","))  # noqa: E731
    first = [v for v in Q1 if v[0] in Q1_FIRST]  # the most telling variants first (the budget may cut the tail)
    tasks = ([("q1", *v) for v in first] + [("q2", *v) for v in Q2] +
             [("q1", *v) for v in Q1 if v[0] not in Q1_FIRST])
    for kind, label, p1, p2 in tasks:
        if not keep(label):
            continue
        if time.perf_counter() - t_start > args.budget:
            print(f"{label}: skipped (budget {args.budget} s spent)", flush=True)
            continue
        try:  # one variant's failure must not lose the others
            if kind == "q1":
                G, c = p1, p2
                err = q1_check(G, c, x, lays[0])
                row = profile_row(label, q1_fn(G, c), jnp.broadcast_to(x, (c.xr, D)), lays, args.n)
                mb = G * NS * I * D * 2 / 1e6
                us = sum(v[0] for k, v in row["kernels"].items() if "gate_gemv" in k) or row["total_us"]
                # MB / µs = TB/s
                row.update(err=err, mb=mb, kernel_us=us, tb_s=round(mb / us, 2), smem_est=smem_bytes(c),
                           ctas=G * NS * I // c.bn * c.ks, cfg=dataclasses.asdict(c))
                print(f"{label:40s} err {err:.1e}  {us:6.2f} µs  {row['tb_s']:.2f} TB/s ({mb:.1f} MB, "
                      f"{row['ctas']} CTAs, smem ~{row['smem_est'] // 1024} KiB)  span/layer "
                      f"{row.get('span_per_layer_us')}  {row['kernels']}", flush=True)
            else:
                a, b = p1, p2
                err = q2_check(a, b, x, lays[0])
                row = profile_row(label, q2_fn(a, b), jnp.broadcast_to(x, (a.xr, D)), lays, args.n, pair=True)
                row.update(err=err, cfg_a=dataclasses.asdict(a), cfg_b=dataclasses.asdict(b))
                print(f"{label:40s} err {err:.1e}  span A+B {row.get('span_ab_us')} µs  B start - A end "
                      f"{row.get('b_start_minus_a_end_us')} µs  span/layer {row.get('span_per_layer_us')}  "
                      f"{row['kernels']}", flush=True)
            results["rows"].append(row)
        except Exception as exc:
            print(f"{label}: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
        write_results("probe_mgpu.json", results)
        print(f"  [{time.perf_counter() - t_start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
