"""Probe: the T = 1 down kernel with its W_down loads issued slots ahead of their math (more bytes in flight).

`experts.experts_fwd_kernel_down_t1` (2560 one-warp programs, one output feature each) reads 31.5 MB of routed
W_down rows in 10.4-10.6 µs (~3.0 TB/s), where gate/up's programs stream at ~3.6. Its SASS (sm_90, compiled on the
CPU with `--sass`) issues each 256-column chunk's weight load next to the chunk's h load and consumes both before
the next pair: ~1.4 KB in flight per program on average (5 KB at most), ~3.7 MB over the 2560 programs. The
question: would more bytes in flight cover HBM's loaded latency better? Here the weight loads of slot s + `ahead`
are issued before slot s's math (slot order: the shared expert, then the 8 routed slots), written into the Triton
IR in that order;
`h_early` also issues each slot's h loads with its weights (else just before its math: 19 programs per SM share h,
so most of those loads hit L1). Numerics are the production kernel's (same products, order and roundings).
Also here: gate/up with its chunks written out and one or two chunks' loads ahead (`gate_up_ahead`), and PDL
trigger placements late in the top-k, gate/up and down programs (set s11c2, `trigger_layer`).

`--sass`: no GPU; lowers each variant for sm_90 on this machine, compiles it with the venv's Triton + ptxas and
prints registers, resident programs per SM and the bytes of loads in flight per program (from the SASS: each LDG
counts until the first instruction that reads its destination registers).

Result (RESULTS.md, "Session 11"): no. ptxas sinks the loads next to their uses whatever the source order (or
volatile loads) unless a CTA barrier (`fence`) follows each slot's loads; with it, 3.2-9.2 KB in flight per program,
and both kernels ran slower (down 10.5 -> 11.0-14.5 µs, gate/up 17.2 -> 17.8-21.5; a per-lane L2 prefetch of the
rows, 14 µs). The later trigger placements all lost to the production one (down's trigger at its programs'
start): 34.2-35.6 against 34.1. `--sass` output as run: experiments/results/probe_moe_down_inflight_sass.txt.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_down_inflight.py --set s11c1` (s11c2);
`--toy`: a CPU smoke run in interpret mode.
"""

from __future__ import annotations

import functools
import re
import sys

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.pallas.triton import lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_down_rows_fused as pr
import probe_moe_fused_router as pf
import probe_moe_splitk as ps
import probe_moe_t1 as pt
import triton_resources as tr
from pallas_kernels.common import interpret_mode
from pallas_kernels.common import prefetch as prefetch_mod
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

TU = ex.DECODE_TUNING
F32 = jnp.float32


# Per-thread L2 prefetch of whole 128-byte lines (`prefetch.global.L2`): lane t of the warp prefetches line t of a
# range, so one instruction covers up to 32 lines (4 KB) and holds no register (unlike a load) and no TMA unit
# (unlike pallas_kernels/common/prefetch.py's bulk prefetch, which lost here in S10 4).
line_prefetch_p = jax_core.Primitive("l2_line_prefetch")
line_prefetch_p.multiple_results = True


@line_prefetch_p.def_effectful_abstract_eval
def _line_prefetch_abstract_eval(ref_aval, start_aval, *, n_bytes):
    return (), {prefetch_mod.prefetch_effect}


def _line_asm(n_bytes):
    n_lines = -(-n_bytes // 128)
    op = "prefetch.global.L2"
    lines = ["{", ".reg .pred p;", ".reg .b32 t;", ".reg .b64 a, o;", "mov.u32 t, %laneid;",
             "mul.wide.u32 o, t, 128;", "add.s64 a, $1, o;"]
    for base in range(0, n_lines, 32):
        lines += [f"setp.lt.u32 p, t, {min(32, n_lines - base)};", f"@p {op} [a+{base * 128}];"]
    lines += ["mov.u32 $0, 0;", "}"]
    return "\n\t".join(lines)


@lowering.register_lowering(line_prefetch_p)
def _line_prefetch_lowering(ctx, ptr, start, *, n_bytes):
    prefetch_mod.emit_asm_at(ctx, ptr, start, _line_asm(n_bytes))
    return []


def prefetch_lines(ref, start, n_bytes):
    """Lines of ref's flat elements [start, start + n_bytes / itemsize) into L2, one per lane (start 128-byte
    aligned); a no-op interpreted."""
    if interpret_mode():
        return
    line_prefetch_p.bind(ref, jnp.asarray(start, jnp.int32), n_bytes=int(n_bytes))


def down_ahead_kernel(h_ref, ids_ref, w_ref, wd_ref, sd_ref, y_ref, *, BKI, n_chunks, n_routed, ahead, h_early,
                      eviction, early_launch, volatile, line_pf, fence, trigger="start"):
    # h_ref [K + 1, 1, I]; ids_ref [K] int32; w_ref [K] fp32; wd_ref [E, D, I]; sd_ref [D, I]; y_ref [1, BD]
    # volatile: the routed weight loads are volatile (ptxas keeps their order: the source's issue order holds);
    # line_pf: None, or P: slot s + P's routed rows are line-prefetched into L2 before slot s's loads (P = 8 or
    # more: every routed row at the program's start); fence: a CTA barrier (`bar.sync`, one warp: a few cycles)
    # after each slot's loads, which ptxas does not schedule across, so the loads stay issued ahead of the math
    # (without it ptxas sinks each load next to its use whatever the source order)
    # trigger (with early_launch): where the PDL trigger sits: "start" (production) or "end" (after the store; a
    # trigger before the last slot's loads was compiled too: it split the code where ptxas then took 116 registers
    # instead of 74-76, too few programs resident to compare, so it was not run)
    if early_launch and trigger == "start":
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    row0 = pl.multiple_of(pl.program_id(0) * bd, bd)
    feats = pl.ds(row0, bd)
    ids, wts = ids_ref[...], w_ref[...]
    chunks = [pl.ds(c * BKI, BKI) for c in range(n_chunks)]
    _, d, i = wd_ref.shape

    def prefetch(s):
        if line_pf is not None and 0 <= s < n_routed:
            e, _ = ex._ownership(ids, s, n_routed)
            prefetch_lines(wd_ref, (e * d + row0) * i, bd * i * wd_ref.dtype.itemsize)

    if line_pf is not None:
        for s in range(min(line_pf, n_routed)):
            prefetch(s)

    def load_w(e, ks):
        if volatile:
            return pltriton.load(wd_ref.at[e, feats, ks], volatile=True)
        return ex._load(wd_ref, (e, feats, ks), eviction)

    def issue(s):
        if s == n_routed:
            ws = [sd_ref[feats, ks] for ks in chunks]
        else:
            if line_pf is not None:
                prefetch(s + line_pf)
            e, _ = ex._ownership(ids, s, n_routed)
            ws = [load_w(e, ks) for ks in chunks]
        hs = [h_ref[s, :, ks] for ks in chunks] if h_early else None
        if fence and not interpret_mode():  # no barrier primitive interpreted (one program at a time there)
            pltriton.debug_barrier()
        return s, ws, hs

    def expert_out(s, ws, hs):
        hs = hs or [h_ref[s, :, ks] for ks in chunks]
        acc = None
        for w, h in zip(ws, hs):
            part = jnp.sum(w.astype(F32) * h.astype(F32), axis=1)
            acc = part if acc is None else acc + part
        return acc.astype(dt).astype(F32)

    shared, routed = None, jnp.zeros((bd,), F32)
    pending = []
    for s in [n_routed] + list(range(n_routed)):  # the shared expert first (its rows in L2), then the routed slots
        pending.append(issue(s))
        while len(pending) > ahead or (s == n_routed - 1 and pending):
            q, ws, hs = pending.pop(0)
            out = expert_out(q, ws, hs)
            if q == n_routed:
                shared = out
            else:
                e, owner = ex._ownership(ids, q, n_routed)
                w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))
                routed = routed + jnp.where(owner, w_e * out, 0.0)
    y_ref[...] = (routed.astype(dt) + shared.astype(dt))[None, :]
    if early_launch and trigger == "end":
        launch_dependents()


def down_ahead(h, w, ids, wd, sd, *, ahead, h_early=False, bki=TU.block_ki, warps=1, early_launch=True,
               volatile=False, line_pf=None, fence=False, trigger="start"):
    k, _, i = h.shape
    k -= 1
    d = sd.shape[0]
    bki = min(bki, i & -i)
    return pl.pallas_call(
        functools.partial(down_ahead_kernel, BKI=bki, n_chunks=i // bki, n_routed=k, ahead=ahead, h_early=h_early,
                          eviction=TU.routed_eviction, early_launch=early_launch, volatile=volatile,
                          line_pf=line_pf, fence=fence, trigger=trigger),
        grid=(d,), in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.BlockSpec((1, 1), lambda j: (0, j)), out_shape=jax.ShapeDtypeStruct((1, d), h.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret_mode(), name="experts_fwd_kernel_down_ahead",
    )(h, ids.reshape(-1), w.reshape(-1), wd, sd)


def ahead_layer(**kw):
    def f(x, lay):
        w, ids = pr._route(x, lay)
        h = pr.gate_up_h(x, ids, lay)
        return down_ahead(h, w, ids, lay["wd"], lay["sd"], **kw)
    return f


def _ahead(ahead, **kw):
    return (f"dep: down ahead {ahead}" + "".join(f", {k} {v}" for k, v in kw.items()), ahead_layer(ahead=ahead, **kw),
            pt.reference_layer)


def gate_up_ahead_kernel(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, *, BK, n_chunks, n_routed, limit,
                         shared_limit, eviction, ahead, fence):
    # The T = 1 gate/up kernel (experts.experts_fwd_kernel_gate_up, fma_reduce) with its chunks written out and the
    # weight tiles of chunk c + `ahead` issued before chunk c's math, a CTA barrier after each chunk's loads (fence).
    s, j = pl.program_id(0), pl.program_id(1)
    bi = h_ref.shape[1]
    e, owner = ex._ownership(ids_ref[...], s, n_routed)
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)
    chunks = [pl.ds(c * BK, BK) for c in range(n_chunks)]

    def compute(load_g, load_u, lim):
        def issue(c):
            tiles = load_g(chunks[c]), load_u(chunks[c])
            if fence and not interpret_mode():
                pltriton.debug_barrier()
            return c, tiles

        acc_g = acc_u = jnp.zeros((1, bi), F32)
        pending = [issue(c) for c in range(min(ahead, n_chunks))]
        for c in range(n_chunks):
            if c + ahead < n_chunks:
                pending.append(issue(c + ahead))
            q, (wg, wu) = pending.pop(0)
            xs = x_ref[:, chunks[q]].astype(F32)
            acc_g = acc_g + jnp.sum(wg.astype(F32) * xs, axis=1)[None, :]
            acc_u = acc_u + jnp.sum(wu.astype(F32) * xs, axis=1)[None, :]
        h_ref[...] = ex._swiglu(acc_g.astype(h_ref.dtype), acc_u.astype(h_ref.dtype), lim)

    @pl.when(owner)
    def _():
        compute(lambda ks: ex._load(wg_ref, (e, rows, ks), eviction),
                lambda ks: ex._load(wu_ref, (e, rows, ks), eviction), limit)

    @pl.when(s == n_routed)
    def _():
        compute(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], shared_limit)


def gate_up_ahead(x, ids, lay, *, ahead, fence=True, bi=TU.block_i, bk=TU.block_k):
    d, (i, k) = x.shape[1], (lay["sg"].shape[0], ids.shape[1])
    bk = min(bk, d)
    return pl.pallas_call(
        functools.partial(gate_up_ahead_kernel, BK=bk, n_chunks=d // bk, n_routed=k, eviction=TU.routed_eviction,
                          ahead=ahead, fence=fence, **pt.LIMITS),
        grid=(k + 1, i // bi), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret_mode(), name="experts_fwd_kernel_gate_up_ahead",
    )(x, ids.reshape(-1), lay["wg"], lay["wu"], lay["sg"], lay["su"])


def both_layer(gate_up_kw, down_kw=None):
    """gate/up by gate_up_ahead, then the production down kernel (down_kw None) or down_ahead."""
    def f(x, lay):
        w, ids = pr._route(x, lay)
        h = gate_up_ahead(x, ids, lay, **gate_up_kw)
        if down_kw is None:
            return ex.down_and_combine(h, ids, w, lay["wd"], lay["sd"], n=1, tuning=TU)
        return down_ahead(h, w, ids, lay["wd"], lay["sd"], **down_kw)
    return f


def _both(gate_up_kw, down_kw=None):
    label = "dep: gate/up " + ", ".join(f"{k} {v}" for k, v in gate_up_kw.items())
    if down_kw is not None:
        label += "; down " + ", ".join(f"{k} {v}" for k, v in down_kw.items())
    return label, both_layer(gate_up_kw, down_kw), pt.reference_layer


# PDL trigger placements (s11c2). Session 5 put `launch_dependents` at the start of a program (S5 4-6): it helped
# only in the down kernel (its successor then: the combine; now the next layer's GEMV) and cost 1.2 µs in the
# top-k; session 10 measured it at the start of gate/up at +1.0-1.2 µs (S10 3: 35.19 / 35.43 against 34.0-34.3).
# Those successors' blocks were admitted for the whole launch. Here the trigger sits late
# in each program, so the successor is admitted near the launch's end: its launch latency hidden, no long wait.

def gate_up_trigger(x, ids, lay, where):
    """The production T = 1 gate/up launch with a PDL trigger in its last chunk ("last") or after it ("end")."""
    d, (i, k) = x.shape[1], (lay["sg"].shape[0], ids.shape[1])
    bi, bk = TU.block_i, min(TU.block_k, d)
    last = (d // bk - 1) * bk

    def kernel(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref):
        s, j = pl.program_id(0), pl.program_id(1)
        e, owner = ex._ownership(ids_ref[...], s, k)
        rows = pl.ds(pl.multiple_of(j * bi, bi), bi)

        def trig(load):
            def f(ks):
                if where == "last":
                    @pl.when(ks.start == last)
                    def _():
                        launch_dependents()
                return load(ks)
            return f

        def compute(load_g, load_u, lim):
            h_ref[...] = ex._gate_up_rows(x_ref, trig(load_g), load_u, BK=bk, n_chunks=d // bk, bi=bi, to=1,
                                          mode=TU.t1_gate_up, limit=lim, dt=h_ref.dtype)

        @pl.when(owner)
        def _():
            compute(lambda ks: ex._load(wg_ref, (e, rows, ks), TU.routed_eviction),
                    lambda ks: ex._load(wu_ref, (e, rows, ks), TU.routed_eviction), pt.LIMITS["limit"])

        @pl.when(s == k)
        def _():
            compute(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], pt.LIMITS["shared_limit"])

        if where == "end":
            launch_dependents()

    return pl.pallas_call(
        kernel, grid=(k + 1, i // bi), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((k + 1, 1, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=TU.warps_gate_up, num_stages=TU.stages_gate_up),
        interpret=interpret_mode(), name="experts_fwd_kernel_gate_up_trig",
    )(x, ids.reshape(-1), lay["wg"], lay["wu"], lay["sg"], lay["su"])


def topk_trigger(x, lay):
    """The production T = 1 routing (GEMV, then the top-k launch with the shared-expert prefetch) with a PDL trigger
    at the end of every top-k program (after its stores or its prefetch)."""
    tu = router_mod.DECODE_TUNING
    part = router_mod.gemv_partials(x, lay["router"], tu)
    ks, _, e = part.shape
    gsz = e // pf.G
    pref = [lay[n].reshape(-1) for n in ("sg", "su", "sd")]
    chunks = router_mod._prefetch_chunks(pref, tu.prefetch_chunk_bytes)

    def kernel(*refs):
        router_mod.router_fwd_kernel_topk(*refs, n_tokens=1, chunks=chunks, evict_last=tu.prefetch_evict_last,
                                          **pf.SELECT_KW)
        launch_dependents()

    top_k = pf.SELECT_KW["top_k"]
    return pl.pallas_call(
        kernel, grid=(1 + sum(c for _, c, _ in chunks),),
        in_specs=[pl.BlockSpec((ks, None, pf.G, gsz), lambda i: (0, 0, 0, 0)),
                  pl.BlockSpec((pf.G, gsz), lambda i: (0, 0))] + [pl.no_block_spec] * len(pref),
        out_specs=[pl.BlockSpec((1, top_k), lambda i: (0, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((1, top_k), F32), jax.ShapeDtypeStruct((1, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=tu.topk_warps, num_stages=1),
        interpret=interpret_mode(), name="router_fwd_kernel_topk_trig",
    )(part.reshape(ks, 1, pf.G, gsz), lay["bias"].reshape(pf.G, gsz), *pref)


def trigger_layer(topk=False, gate_up=None, down="start"):
    """Production layer with PDL triggers placed: topk (at the end of its programs), gate_up (None | "last" |
    "end"), down ("start": production | "end" | None: no trigger)."""
    def f(x, lay):
        w, ids = topk_trigger(x, lay) if topk else pr._route(x, lay)
        h = pr.gate_up_h(x, ids, lay) if gate_up is None else gate_up_trigger(x, ids, lay, gate_up)
        return down_ahead(h, w, ids, lay["wd"], lay["sd"], ahead=0, early_launch=down is not None,
                          trigger=down or "start")
    return f


def _trig(**kw):
    return ("dep: triggers " + ", ".join(f"{k} {v}" for k, v in kw.items()), trigger_layer(**kw), pt.reference_layer)


SASS_VARIANTS = ([dict(ahead=a) for a in (0, 2, 8)] + [dict(ahead=a, volatile=True) for a in (1, 8)]
                 + [dict(ahead=0, line_pf=p) for p in (2, 8)] + [dict(ahead=a, fence=True) for a in (1, 2, 3, 8)]
                 + [dict(ahead=a, fence=True, h_early=True) for a in (1, 2)]
                 + [dict(ahead=1, fence=True, line_pf=p) for p in (2, 8)])

GATE_UP_SASS_VARIANTS = [dict(ahead=a, fence=f) for a in (0, 1, 2) for f in (False, True)] + [
    dict(ahead=1, bk=256), dict(ahead=2, bk=256), dict(ahead=1, bi=1)]

VARIANTS = {
    "s11c1": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _ahead(0),
        _ahead(1, fence=True),
        _ahead(2, fence=True),
        _ahead(3, fence=True),
        _ahead(8, fence=True),
        _ahead(1, fence=True, line_pf=8),
        _ahead(0, line_pf=8),
        _both(dict(ahead=0, fence=True)),
        _both(dict(ahead=1, bk=256)),
        _both(dict(ahead=1)),
        _both(dict(ahead=2, bk=256)),
        _both(dict(ahead=1, bk=256), dict(ahead=1, fence=True)),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
    "s11c2": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        _trig(down="start"),
        _trig(down="end"),
        _trig(down=None),
        _trig(gate_up="last"),
        _trig(gate_up="end"),
        _trig(topk=True),
        _trig(topk=True, gate_up="last"),
        _trig(topk=True, gate_up="end"),
        _trig(down="start"),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
    ],
}


# --sass: static analysis on the CPU ---------------------------------------------------------------------------------

def loads_in_flight(sass, lanes=32):
    """Bytes of global loads outstanding right after each LDG, per warp: an LDG counts from its issue until the
    first later instruction that reads one of its destination registers (program order: a static proxy)."""
    outstanding, after_each = [], []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if not m:
            continue
        body = re.sub(r"^@!?U?P\w+\s+", "", m.group(1))
        op, _, args = body.strip().partition(" ")
        if op.startswith("LDG"):
            dst = re.match(r"R(\d+)", args)
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            read = set(re.findall(r"\bR(\d+)\b", args[dst.end():]))
            outstanding = [o for o in outstanding if not (o[0] & read)]
            outstanding.append(({str(int(dst.group(1)) + r) for r in range(width)}, width * 4 * lanes))
            after_each.append(sum(b for _, b in outstanding))
        else:
            read = set(re.findall(r"\bR(\d+)\b", args))
            outstanding = [o for o in outstanding if not (o[0] & read)]
    return after_each


def sass_report():
    from jax._src.pallas.triton import gpu_info

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    sys.modules[__name__].interpret_mode = lambda: False
    ex.interpret_mode = lambda: False
    sds = jax.ShapeDtypeStruct
    d, i, k, e = pt.D, pt.I, pt.K, pt.E
    shapes = (sds((k + 1, 1, i), jnp.bfloat16), sds((1, k), F32), sds((1, k), jnp.int32),
              sds((e, d, i), jnp.bfloat16), sds((d, i), jnp.bfloat16))
    gu_shapes = (sds((1, d), jnp.bfloat16), sds((1, k), jnp.int32), sds((e, i, d), jnp.bfloat16),
                 sds((e, i, d), jnp.bfloat16), sds((i, d), jnp.bfloat16), sds((i, d), jnp.bfloat16))
    pr.interpret_mode = lambda: False

    def gu(v):
        return lambda x, ids, wg, wu, sg, su: (pr.gate_up_h(x, ids, dict(wg=wg, wu=wu, sg=sg, su=su)) if v is None
                                               else gate_up_ahead(x, ids, dict(wg=wg, wu=wu, sg=sg, su=su), **v))

    for v in [None] + GATE_UP_SASS_VARIANTS:
        (name, ir_bytes, nw, ns), = tr.lowered_kernels(gu(v), *gu_shapes)
        report(f"gate/up {v or 'production'}", ir_bytes, nw, ns, (k + 1) * i // (v or {}).get("bi", TU.block_i))
    rows = [("production", lambda h, w, ids, wd, sd: ex.down_and_combine(h, ids, w, wd, sd, n=1, tuning=TU))]
    rows += [(", ".join(f"{k} {x}" for k, x in v.items()),
              functools.partial(lambda h, w, ids, wd, sd, v: down_ahead(h, w, ids, wd, sd, **v), v=v))
             for v in SASS_VARIANTS]
    for label, fn in rows:
        (name, ir_bytes, nw, ns), = tr.lowered_kernels(fn, *shapes)
        report("down " + label, ir_bytes, nw, ns, d)


def report(label, ir_bytes, nw, ns, n_programs, n_sm=132):
    r = tr.compile_sm90(ir_bytes, nw, ns, sass=True)
    sass, regs = r["sass"], r["regs"]
    fl = loads_in_flight(sass)
    per_sm = min(32, 65536 // (-(-regs // 8) * 8 * 32 * nw))
    print(f"{label:40s} regs {regs:3d} ({per_sm} programs/SM, {min(per_sm * n_sm, n_programs)} of {n_programs} "
          f"resident) LDGs {len(fl)} in flight per program: mean {sum(fl) / len(fl) / 1024:.2f} KB, max "
          f"{max(fl) / 1024:.1f} KB", flush=True)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass_report()
    else:
        ps.run_sets("probe_moe_down_inflight", VARIANTS, "s11c1")
