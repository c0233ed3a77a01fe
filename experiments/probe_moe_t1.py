"""Probe: the MoE layer at T = 1 (route + experts) over router and experts tunings, by device time per kernel
(JAX profiler), NL = 8 layers of cold Flash-size weights (512 experts, 6 GB per layer, each a different HBM
region); plus two read ceilings: a Pallas kernel that only sums the 18 gate/up slabs a layer reads (70.8 MB, the
gate/up kernel's grid), and XLA's sum over 128 MiB. Every variant is checked compiled against the reference.

This sweep chose the T = 1 defaults (experiments/RESULTS.md, "MoE, session 3"). The fused three-launch layer it
also measured (router GEMV + shared gate/up, then top-k in every gate/up program's prologue + shared down, then
routed down; 48.4 µs against 44.2 µs for route + experts) is in commit 7955b3f (pallas_kernels/moe/layer.py).

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_moe_t1.py --sweep call4` (call3: the previous sweep).

Layout: since session 10 `make_layers` stores W_down as the model does, [E, D, I] (torch's [out, in]). The probes
of sessions 3-9 that build on these layers were written and run with W_down [E, I, D]; their down variants read it
so, and they ran at the commits RESULTS.md names: run them there, not against today's layers.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
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
from profile_ops import call_period_us, call_span_us, durations_by_name, split_calls, trace_kernels  # noqa: E402

from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402
from pallas_kernels.moe.experts import ExpertsTuning, moe_experts_fused  # noqa: E402

D, I, K, NL, E = 2560, 768, 8, 8, 512
TO_REPO = True  # record_row writes its JSON into experiments/results/ (the probes' --toy runs set False)
ROUTE_KW = dict(n_group=8, topk_group=4, top_k=K, routed_scaling_factor=2.5)
LIMITS = dict(limit=4.0, shared_limit=5.0)


def make_layers():
    layers = []
    for l in range(NL):
        k = jax.random.split(jax.random.key(l), 8)
        bf, s = jnp.bfloat16, D ** -0.5
        layers.append(dict(
            wg=jax.random.normal(k[0], (E, I, D), bf) * s, wu=jax.random.normal(k[1], (E, I, D), bf) * s,
            wd=jax.random.normal(k[2], (E, D, I), bf) * I ** -0.5, sg=jax.random.normal(k[3], (I, D), bf) * s,
            su=jax.random.normal(k[4], (I, D), bf) * s, sd=jax.random.normal(k[5], (D, I), bf) * I ** -0.5,
            router=jax.random.normal(k[6], (E, D), jnp.float32) * s,  # [E, D]
            bias=0.01 * jax.random.normal(k[7], (E,), jnp.float32)))
    return jax.random.normal(jax.random.key(99), (1, D), jnp.bfloat16), layers


def profile_layers(fn, x, layers, n=10, chain=None):
    """({kernel: (median device µs, launches per layer)}, timeline span per layer, steady-state period per layer or
    None) of fn(x, lay) over every layer, n traced runs (`chain(x, layers)`, if given, runs them instead: e.g.
    threading a buffer through the layers). With a PDL trigger (experts.DECODE_TUNING's early_launch_down) the
    successor's duration includes its wait, so the span, not the kernel sum, is the layers' device time (the
    probes' chains start with the first layer's first kernel: no input copy before it); the period
    (profile_ops.call_period_us, between the ends of successive layers' experts down launches) leaves out the first
    layer (None for layers without one such launch each)."""
    run = jax.jit(chain or (lambda x, layers: [fn(x, lay) for lay in layers]))
    events = trace_kernels(lambda: run(x, layers), n)
    by_name = durations_by_name(events)
    launches = n * len(layers)
    kernels = {k: (round(statistics.median(v), 2), len(v) / launches) for k, v in by_name.items()}
    calls = split_calls(events)
    period = call_period_us(calls, "experts_fwd_kernel_down", len(layers))
    return (kernels, round(call_span_us(calls) / len(layers), 2),
            None if math.isnan(period) else round(period, 2))


def per_kernel_us(fn, x, layers, n=10):
    """{kernel: (median device µs, launches per layer)} of fn(x, lay) over every layer, n traced runs."""
    return profile_layers(fn, x, layers, n)[0]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def record_row(results, out_name, label, fn, x, layers, check=None, chain=None):
    """Check fn against `check` on layer 0 (relative error; for a (weights, ids) router pair, the fraction of ids
    that differ), profile it over all layers (timeline span and kernel sum per layer; `chain`: as profile_layers),
    print and append the row, save `results` as out_name."""
    try:
        err = None
        if check is not None:
            out, ref = jax.jit(fn)(x, layers[0]), jax.jit(check)(x, layers[0])
            if isinstance(out, (list, tuple)):
                err = float(np.mean(np.asarray(out[1]) != np.asarray(ref[1])))
            else:
                err = rel_err(out, ref)
        ks, span, period = profile_layers(fn, x, layers, chain=chain)
    except Exception as exc:  # one variant's failure must not lose the others
        print(f"{label}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        return
    total = sum(us * per for us, per in ks.values())
    results["rows"].append(dict(label=label, err=err, total_us=round(total, 2), span_us=span, period_us=period,
                                kernels=ks))
    print(f"{label:48s} err {err}  span {span:6.2f} µs  period {period} µs  kernel sum {total:6.2f} µs  " +
          "  ".join(f"{k[:30]} {v[0]}" + (f"x{v[1]:.2g}" if v[1] != 1 else "") for k, v in ks.items()), flush=True)
    write_results(out_name, results, to_repo=TO_REPO)


def reference_layer(x, lay):
    w, ids = reference.route(x, lay["router"], lay["bias"], **ROUTE_KW)
    local = jnp.arange(K, dtype=jnp.int32)[None]  # the K selected experts, gathered, renumbered 0..K-1
    y = reference._routed_gather(x, w, local, lay["wg"][ids[0]], lay["wu"][ids[0]], lay["wd"][ids[0]], 4.0)
    return (y.astype(x.dtype) + reference.expert_mlp(x, lay["sg"], lay["su"], lay["sd"], 5.0)).astype(x.dtype)


def separate(experts_tuning=None, router_tuning=None):  # None: the defaults by T
    def f(x, lay):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=router_tuning)
        return moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                 **LIMITS, tuning=experts_tuning)
    return f


def read_kernel(w_ref, o_ref, *, BK, n_chunks, unroll):
    rows = pl.ds(pl.multiple_of(pl.program_id(1) * o_ref.shape[0], o_ref.shape[0]), o_ref.shape[0])

    def body(c, acc):
        for u in range(unroll):
            ks = pl.ds(pl.multiple_of((c * unroll + u) * BK, BK), BK)
            acc = acc + w_ref[pl.program_id(0), rows, ks].astype(jnp.float32)
        return acc

    acc = lax.fori_loop(0, n_chunks // unroll, body, jnp.zeros((o_ref.shape[0], BK), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=1)


def read_ceiling(bi, bk, unroll=1, warps=4, n_exp=9):
    def f(x, lay):  # the first n_exp experts' gate and up slabs: 2·n_exp × [I, D] bf16
        out = []
        for w in (lay["wg"], lay["wu"]):
            out.append(pl.pallas_call(
                functools.partial(read_kernel, BK=bk, n_chunks=D // bk, unroll=unroll), grid=(n_exp, I // bi),
                in_specs=[pl.no_block_spec], out_specs=pl.BlockSpec((None, bi), lambda s, j: (s, j)),
                out_shape=jax.ShapeDtypeStruct((n_exp, I), jnp.float32),
                compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3), name="read_ceiling")(w))
        return out
    return f


E_ = ExpertsTuning
FMA_R = "fma_reduce"
# (label, experts tuning, router tuning); None = default. "call3"/"call4": session 3's device calls 3 and 4 (call 3
# also swept loop unrolling and FMA down products, all slower, removed since: commit 7955b3f has them). Their
# router rows swept the split-K router over [D, E], gone since the router went [E, D] (commit cf5cb96 has them).
SWEEPS = {
    "call3": [
        ("gate/up fma_reduce BK512", E_(t1_gate_up=FMA_R, block_k=512), None),
        ("gate/up fma_reduce BK1024 w8", E_(t1_gate_up=FMA_R, block_k=1024, warps_gate_up=8), None),
    ],
    "call4": [
        ("gate/up dot_w BI16 BK256", E_(t1_gate_up="dot_w"), None),
        ("gate/up dot_w BI16 BK256 s4", E_(t1_gate_up="dot_w", stages_gate_up=4), None),
        ("gate/up dot_w BI16 BK512", E_(t1_gate_up="dot_w", block_k=512), None),
        ("gate/up dot_w BI16 BK128 s5", E_(t1_gate_up="dot_w", block_k=128, stages_gate_up=5), None),
        ("gate/up dot_w BI32 BK128 s4", E_(t1_gate_up="dot_w", block_i=32, block_k=128, stages_gate_up=4), None),
        ("gate/up dot_w BI32 BK256 w8", E_(t1_gate_up="dot_w", block_i=32, warps_gate_up=8), None),
        ("gate/up dot_w BI64 BK128 w4", E_(t1_gate_up="dot_w", block_i=64, block_k=128), None),
        ("gate/up dot_x BI16 BK256 s4", E_(t1_gate_up="dot_x", stages_gate_up=4), None),
    ],
}
CEILINGS = {"call3": [(8, 512, 1, 4, 9), (16, 256, 2, 4, 9), (8, 512, 5, 4, 9), (16, 128, 4, 4, 9),
                      (8, 256, 2, 2, 9), (32, 256, 2, 8, 9)],
            "call4": [(8, 512, 1, 4, 9), (8, 512, 1, 4, 18), (8, 512, 1, 4, 36)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="call4")
    args = ap.parse_args()
    results = {**run_header(), "sweep": args.sweep, "rows": []}
    x, layers = make_layers()

    def record(label, fn, check=True):
        record_row(results, "probe_moe_t1.json", label, fn, x, layers, reference_layer if check else None)

    record("separate route + experts (defaults)", separate())
    for label, et, rt in SWEEPS[args.sweep]:
        record(label, separate(et, rt))
    for bi, bk, un, w, n_exp in CEILINGS[args.sweep]:  # un: loop unroll of the read kernel
        record(f"read ceiling {n_exp * 7.87:.1f} MB BI{bi} BK{bk} unroll {un} w{w}", read_ceiling(bi, bk, un, w, n_exp),
               check=False)
    if args.sweep == "call4":
        x6, l6 = jax.random.normal(jax.random.key(98), (6, D), jnp.bfloat16), layers
        for label, tu in (("T=6 dot_x", E_()), ("T=6 dot_w", E_(dot_gate_up="dot_w")),
                          ("T=6 dot_w s4", E_(dot_gate_up="dot_w", stages_gate_up=4))):
            rows = per_kernel_us(separate(tu), x6, l6)
            print(label, rows, flush=True)
            results["rows"].append(dict(label=label, kernels=rows))
        slabs = [jnp.concatenate([lay["wg"][:9], lay["wu"][:9]]) for lay in layers]  # 8 × 70.8 MB
        rows = per_kernel_us(lambda x, w: jnp.sum(w.astype(jnp.float32), axis=(1, 2)), x, slabs)
        print("XLA sum over 70.8 MB (cold, 8 buffers):", rows, flush=True)
        results["xla_sum_70MB"] = rows
    big = jax.random.normal(jax.random.key(5), (8, 64, 1 << 20), jnp.bfloat16)  # 8 × 128 MiB
    rows = per_kernel_us(lambda x, lay: jnp.sum(lay.astype(jnp.float32)), x, list(big))
    print("XLA sum over 128 MiB (cold, 8 buffers):", rows, flush=True)
    results["xla_sum_128MiB"] = rows
    write_results("probe_moe_t1.json", results)


if __name__ == "__main__":
    main()
