"""Probe: the T = 1 experts in ONE launch by splitting the down product over the intermediate rows (split-K).

The production T = 1 experts are two streaming launches and a combine: gate/up (1-warp programs of 2 I-rows each,
row-contiguous reads), down (4-warp programs of 64 output columns reading a 128-byte stripe of every I-row) and an
XLA fusion summing the 9 fp32 partials. Each streaming launch pays ~1.7 µs of ramp and tail beyond its bytes, the
down kernel's stripes read at ~3.0 TB/s (its read ceiling, RESULTS.md "MoE, session 5"), and the combine ~0.9 µs.
Sessions 5 and 7 merged the phases with waits (down programs waiting for h rows): slower. Here nothing waits: a
program that owns R intermediate rows of one expert computes their h (as the gate/up kernel), then multiplies them
straight into that expert's R down rows, which are stored [I, D] so they are R contiguous 5 KB rows like the
gate/up rows, and adds the [D] fp32 product, scaled by its routing weight, into the output with atomic adds. So
the whole expert stream is one launch of row-contiguous reads, and no combine is left beyond a convert.

Numerics differ from the reference in two roundings: the reference rounds each expert's down output to the
compute dtype before weighting and adds the shared expert in the compute dtype; here every product is summed in
fp32 and rounded once (closer to exact). The fp32 atomics sum in arrival order, so the last bits vary between runs.
The deterministic variant (`partials`) writes each program's [D] product instead and XLA sums them.

The output accumulator must start at zero: `zero="xla"` makes a zero buffer per call (XLA's memset), `zero="topk"`
has the router's top-k launch write it as one more output (no extra launch). `sem`: the atomics' memory order,
"acq_rel" (Pallas' default, a fence per atomic) or "relaxed" (nothing else reads the output until the launch
ends). `replicas`: program p adds into accumulator row p % replicas (fewer updates per address), summed by the
final reduction. Also here: the router GEMV as an XLA fusion (s9c3, s9c4), the down kernel doing the combine by
last arrival (s9c3), and a dependent chain (labels "dep:", each layer on the previous layer's output).

Result (RESULTS.md, "Session 9"): dropped. The atomics dominate: 2-row programs took 85 µs (relaxed) and 156 µs
(acq_rel); spread over 16-128 accumulator replicas the best split-K launch took 30.7 µs (8 rows, 2 warps, 16
replicas) plus a 1.3 µs reduction, against ~28.9 µs for gate/up + down + combine; without atomics (partials) 34.8.
XLA's GEMV merged the 8 layers' GEMVs into one fusion in the probes' chain (span 33.7) and took 3.0-3.2 µs, as the
Pallas GEMV, in a dependent chain; the down kernel with the combine took 0.3 µs more than down + XLA combine.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_splitk.py --set s9c1` (session 9's call 1;
s9c2-s9c4: calls 2-4); `--toy`: CPU smoke run in interpret mode.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as tlow
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_fused_router as pf
import probe_moe_t1 as pt
from bench_common import run_header, write_results
from pallas_kernels.common import interpret_mode
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

TU = ex.DECODE_TUNING
@contextlib.contextmanager
def relaxed_atomics(on):
    """Pallas-Triton atomics lowered with relaxed order while inside (Pallas' lowering asks acq_rel); jax's lowering
    helper is patched only for the duration."""
    orig = tlow._atomic_rmw

    def relaxed(op, ptr, val, mask=None, semantic=None, sync_scope=tt_dialect.MemSyncScope.GPU):
        return orig(op, ptr, val, mask=mask, semantic=tt_dialect.MemSemantic.RELAXED, sync_scope=sync_scope)

    if on:
        tlow._atomic_rmw = relaxed
    try:
        yield
    finally:
        tlow._atomic_rmw = orig


def topk_zero_kernel(p_ref, b_ref, *refs, d, **kw):
    *rest, z_ref = refs
    router_mod.router_fwd_kernel_topk(p_ref, b_ref, *rest, **kw)

    @pl.when(pl.program_id(0) == 0)
    def _():
        step = d & -d  # Pallas-Triton arrays are powers of two
        for c in range(d // step):
            z_ref[pl.ds(c * step, step)] = jnp.zeros((step,), jnp.float32)


def topk_call(partial, lay, d=None):
    """The production top-k launch at T = 1 (DECODE_TUNING, the shared expert prefetched) on partial logits
    [KS, 1, E] fp32; d: it also writes a zero [d] fp32 accumulator."""
    tu = router_mod.DECODE_TUNING
    e = lay["router"].shape[0]
    n_group, top_k = pf.G, pf.SELECT_KW["top_k"]
    ks = partial.shape[0]
    gsz = e // n_group
    pref = [lay[k].reshape(-1) for k in ("sg", "su", "sd")]
    chunks = router_mod._prefetch_chunks(pref, tu.prefetch_chunk_bytes)
    whole = pl.no_block_spec
    out_specs = [pl.BlockSpec((1, top_k), lambda i: (0, 0)), pl.BlockSpec((1, top_k), lambda i: (0, 0))]
    out_shape = [jax.ShapeDtypeStruct((1, top_k), jnp.float32), jax.ShapeDtypeStruct((1, top_k), jnp.int32)]
    kern = router_mod.router_fwd_kernel_topk
    if d is not None:
        out_specs.append(whole)
        out_shape.append(jax.ShapeDtypeStruct((d,), jnp.float32))
        kern = functools.partial(topk_zero_kernel, d=d)
    return pl.pallas_call(
        functools.partial(kern, n_tokens=1, chunks=chunks, evict_last=tu.prefetch_evict_last, **pf.SELECT_KW),
        grid=(1 + sum(c for _, c, _ in chunks),),
        in_specs=[pl.BlockSpec((ks, None, n_group, gsz), lambda i: (0, 0, 0, 0)),
                  pl.BlockSpec((n_group, gsz), lambda i: (0, 0))] + [whole] * len(pref),
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tu.topk_warps, num_stages=1),
        interpret=interpret_mode(), name="router_fwd_kernel_topk_probe",
    )(partial.reshape(ks, 1, n_group, gsz), lay["bias"].reshape(n_group, gsz), *pref)


def route_zero(x, lay, d):
    """router.route at T = 1 whose top-k launch also writes a zero [D] fp32 accumulator."""
    return topk_call(router_mod.gemv_partials(x, lay["router"], router_mod.DECODE_TUNING), lay, d)


def route_xla_gemv(x, lay, how):
    """The router GEMV by XLA (fp32), then the production top-k launch. how: "dot" (jnp.dot, HIGHEST) or "sum"
    (elementwise product + row sum: XLA's row-reduction emitter)."""
    xf = x.astype(jnp.float32)
    if how == "dot":
        logits = jnp.dot(xf, lay["router"].T, precision=lax.Precision.HIGHEST)
    else:
        logits = jnp.sum(xf * lay["router"], axis=1)[None]
    return topk_call(logits[None], lay)


def xla_gemv_layer(how):
    def f(x, lay):
        w, ids = route_xla_gemv(x, lay, how)
        return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                    **pt.LIMITS)
    return f


def down_combine_layer(xla_gemv=""):
    """Production routing and gate/up, then session 4's down kernel whose last program per column block sums the
    partials (no XLA combine; its counter buffer zeroed by XLA and aliased)."""
    import probe_moe_bulk_prefetch as pb

    def f(x, lay):
        if xla_gemv:
            w, ids = route_xla_gemv(x, lay, xla_gemv)
        else:
            w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW,
                                      prefetch=(lay["sg"], lay["su"], lay["sd"]))
        h = pb.gate_up_pf(x, ids, lay, down_frac=0.0, where="end", last=False)
        return pf.down_combine(h, w, ids, lay, pf._counter(False, pf.D // 64), False)
    return f


def _h_rows(x_ref, load_g, load_u, *, BK, n_chunks, limit, dt):
    """SwiGLU over R rows as [R, 1] in dt (products rounded to dt first, as the reference)."""
    def body(c, carry):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        xs = x_ref[:, ks].astype(jnp.float32)  # [1, BK]
        g = carry[0] + jnp.sum(load_g(ks).astype(jnp.float32) * xs, axis=1, keepdims=True)
        u = carry[1] + jnp.sum(load_u(ks).astype(jnp.float32) * xs, axis=1, keepdims=True)
        return g, u

    r = load_g(pl.ds(0, BK)).shape[0]
    init = jnp.zeros((r, 1), jnp.float32)
    g, u = lax.fori_loop(0, n_chunks, body, (init, init))
    return ex._swiglu(g.astype(dt), u.astype(dt), limit)


def splitk_kernel(x_ref, ids_ref, wts_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, *refs, R, BK, n_k, BD,
                  n_d, n_routed, limit, shared_limit, eviction, partials, replicas):
    # grid (S = K + 1 slots, I / R row blocks); T = 1: every routed slot owns its (distinct) expert.
    o_ref = refs[-1]  # partials: [BD·n_d] of this program; else the aliased [replicas, D] fp32 accumulators
    s, j = pl.program_id(0), pl.program_id(1)
    ids = ids_ref[...]
    e, owner = ex._ownership(ids, s, n_routed)
    rows = pl.ds(pl.multiple_of(j * R, R), R)
    i_k = lax.iota(jnp.int32, n_routed)
    wt = jnp.sum(jnp.where(i_k == s, wts_ref[...], 0.0))

    def compute(load_g, load_u, load_d, lim, scale):
        h = _h_rows(x_ref, load_g, load_u, BK=BK, n_chunks=n_k, limit=lim, dt=x_ref.dtype).astype(jnp.float32)

        def body(c, carry):
            cols = pl.ds(pl.multiple_of(c * BD, BD), BD)
            p = jnp.sum(h * load_d(cols).astype(jnp.float32), axis=0) * scale  # [BD]
            if partials:
                o_ref[cols] = p
            else:
                rep = (s * pl.num_programs(1) + j) % replicas
                pltriton.atomic_add(o_ref, (rep, cols), p)
            return carry

        lax.fori_loop(0, n_d, body, 0)

    @pl.when(owner)
    def _():
        compute(lambda ks: ex._load(wg_ref, (e, rows, ks), eviction), lambda ks: ex._load(wu_ref, (e, rows, ks), eviction),
                lambda cs: ex._load(wd_ref, (e, rows, cs), eviction), limit, wt)

    @pl.when(s == n_routed)
    def _():
        compute(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], lambda cs: sd_ref[rows, cs], shared_limit,
                1.0)


def experts_splitk(x, w, ids, lay, z, *, R, BD=512, BK=512, warps=1, stages=3, partials=False, replicas=1):
    _, d = x.shape
    i = lay["sg"].shape[0]
    k = ids.shape[1]
    R, BD, BK = min(R, i), min(BD, d), min(BK, d)
    kern = functools.partial(splitk_kernel, R=R, BK=BK, n_k=d // BK, BD=BD, n_d=d // BD, n_routed=k,
                             eviction=TU.routed_eviction, partials=partials, replicas=replicas, **pt.LIMITS)
    args = [x, ids.reshape(-1), w.reshape(-1), lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"]]
    common = dict(grid=(k + 1, i // R),
                  compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
                  interpret=interpret_mode(), name="experts_fwd_kernel_splitk")
    if partials:
        out = pl.pallas_call(kern, in_specs=[pl.no_block_spec] * 9,
                             out_specs=pl.BlockSpec((None, None, d), lambda s, j: (s, j, 0)),
                             out_shape=jax.ShapeDtypeStruct((k + 1, i // R, d), jnp.float32), **common)(*args)
        return jnp.sum(out, axis=(0, 1))[None].astype(x.dtype)
    y = pl.pallas_call(kern, in_specs=[pl.no_block_spec] * 10, out_specs=pl.no_block_spec,
                       out_shape=jax.ShapeDtypeStruct((replicas, d), jnp.float32), input_output_aliases={9: 0},
                       **common)(*args, z.reshape(replicas, d))
    return jnp.sum(y, axis=0)[None].astype(x.dtype)


def splitk_layer(R, zero="xla", **kw):
    def f(x, lay):
        d = x.shape[1]
        if zero == "topk":
            assert kw.get("replicas", 1) == 1
            w, ids, z = route_zero(x, lay, d)
        else:
            w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW,
                                      prefetch=(lay["sg"], lay["su"], lay["sd"]))
            z = jnp.zeros((kw.get("replicas", 1), d), jnp.float32)
        return experts_splitk(x, w, ids, lay, z, R=R, **kw)
    return f


def prod_layer(x, lay):
    w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW, prefetch=(lay["sg"], lay["su"], lay["sd"]))
    return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                **pt.LIMITS)


def dependent_chain(fn):
    """Layers run in sequence, each on the previous one's output (as in a model), instead of all on the same x."""
    def chain(x, layers):
        ys = []
        for lay in layers:
            x = fn(x, lay)
            ys.append(x)
        return ys
    return chain


def record_variants(results, out, x, layers, only, rows):
    """Check and time each (label, layer fn, reference fn, relaxed atomics) row not excluded by --only (labels
    starting "dep:" over the dependent chain), recording into `results` / `out` (probe_moe_t1.record_row)."""
    for label, fn, check, relaxed in rows:
        if only and label not in only:
            continue
        chain = dependent_chain(fn) if label.startswith("dep:") else None
        with relaxed_atomics(relaxed):
            pt.record_row(results, out, label, fn, x, layers, check, chain=chain)


def run_sets(prefix, sets, default):
    """main() of a probe whose sets are lists of (label, layer fn, reference fn) rows: parse the command line
    (probe_moe_fused_router.chain_probe_setup), check and time the chosen set, write `<prefix>_<set>.json`."""
    args, out, x, layers, only = pf.chain_probe_setup(prefix, sets, default, only_sep=";")
    results = {**run_header(), "layers": len(layers), "rows": []}
    record_variants(results, out, x, layers, only,
                    [(label, fn, check, False) for label, fn, check in sets[args.set]()])
    write_results(out, results, to_repo=not args.toy)


# (label, layer fn, relaxed atomics); labels starting "dep:" time the dependent chain
VARIANTS = {
    # As run in S9 1: rows 4-13 failed there (the top-k's zero store of a [2560] array, not a power of two; fixed
    # since), so they time split-K with the top-k-zeroed accumulator only when run again.
    "s9c1": lambda: [
        ("production layer", prod_layer, False),
        ("splitk R2 acq_rel, zero xla", splitk_layer(2, zero="xla"), False),
        ("splitk R2 relaxed, zero xla", splitk_layer(2, zero="xla"), True),
        ("splitk R2 relaxed, zero topk", splitk_layer(2, zero="topk"), True),
        ("splitk R4 relaxed", splitk_layer(4, zero="topk"), True),
        ("splitk R8 relaxed 2 warps", splitk_layer(8, zero="topk", warps=2), True),
        ("splitk R8 BK256 BD256 relaxed", splitk_layer(8, zero="topk", BK=256, BD=256), True),
        ("splitk R16 BK256 BD256 relaxed 2 warps", splitk_layer(16, zero="topk", BK=256, BD=256, warps=2), True),
        ("splitk R16 relaxed 4 warps", splitk_layer(16, zero="topk", warps=4), True),
        ("splitk R32 relaxed 4 warps", splitk_layer(32, zero="topk", warps=4), True),
        ("splitk R2 BK1024 BD1024 relaxed", splitk_layer(2, zero="topk", BK=1024, BD=1024), True),
        ("partials R16 2 warps (deterministic)", splitk_layer(16, zero="topk", partials=True, warps=2), False),
        ("partials R32 4 warps (deterministic)", splitk_layer(32, zero="topk", partials=True, warps=4), False),
        ("production layer again", prod_layer, False),
    ],
    "s9c2": lambda: [
        ("production layer", prod_layer, False),
        ("splitk R2 relaxed, zero topk", splitk_layer(2, zero="topk"), True),
        ("splitk R2 relaxed, 32 replicas", splitk_layer(2, replicas=32), True),
        ("splitk R2 relaxed, 128 replicas", splitk_layer(2, replicas=128), True),
        ("splitk R4 relaxed", splitk_layer(4), True),
        ("splitk R4 relaxed, 32 replicas", splitk_layer(4, replicas=32), True),
        ("splitk R8 relaxed 2 warps", splitk_layer(8, warps=2), True),
        ("splitk R8 relaxed 2 warps, 16 replicas", splitk_layer(8, warps=2, replicas=16), True),
        ("splitk R16 BK256 BD256 relaxed 2 warps", splitk_layer(16, BK=256, BD=256, warps=2), True),
        ("splitk R16 relaxed 4 warps", splitk_layer(16, warps=4), True),
        ("splitk R32 relaxed 4 warps", splitk_layer(32, warps=4), True),
        ("partials R16 2 warps (deterministic)", splitk_layer(16, partials=True, warps=2), False),
        ("partials R32 4 warps (deterministic)", splitk_layer(32, partials=True, warps=4), False),
        ("production layer again", prod_layer, False),
    ],
    # The XLA-GEMV rows here run the probe's usual chain (every layer on the same x): XLA then merged the 8 layers'
    # GEMV fusions into one reduction, which a model's layers (each on the previous output) cannot; s9c4 re-times
    # them in a dependent chain.
    "s9c3": lambda: [
        ("production layer", prod_layer, False),
        ("router GEMV by XLA dot", xla_gemv_layer("dot"), False),
        ("router GEMV by XLA row sum", xla_gemv_layer("sum"), False),
        ("down + combine by last arrival", down_combine_layer(), False),
        ("XLA row-sum GEMV + down/combine by last arrival", down_combine_layer("sum"), False),
        ("splitk R8 relaxed 2 warps, 64 replicas", splitk_layer(8, warps=2, replicas=64), True),
        ("splitk R4 relaxed, 128 replicas", splitk_layer(4, replicas=128), True),
        ("production layer again", prod_layer, False),
    ],
    # dependent chain: layer l + 1 takes layer l's output (independent layers share x, and XLA then merges the 8
    # layers' router GEMV fusions into one reduction over all their rows)
    "s9c4": lambda: [
        ("dep: production layer", prod_layer, False),
        ("dep: router GEMV by XLA dot", xla_gemv_layer("dot"), False),
        ("dep: router GEMV by XLA row sum", xla_gemv_layer("sum"), False),
        ("indep: router GEMV by XLA row sum", xla_gemv_layer("sum"), False),
        ("indep: production layer", prod_layer, False),
        ("dep: production layer again", prod_layer, False),
        ("dep: router GEMV by XLA row sum again", xla_gemv_layer("sum"), False),
    ],
}


def main():
    args, out, x, layers, only = pf.chain_probe_setup("probe_moe_splitk", VARIANTS, "s9c4", only_sep=";")
    results = {**run_header(), "layers": len(layers), "rows": []}
    record_variants(results, out, x, layers, only,
                    [(label, fn, pt.reference_layer, relaxed) for label, fn, relaxed in VARIANTS[args.set]()])
    write_results(out, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
