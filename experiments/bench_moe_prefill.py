"""How fast is Ling-3.0-flash's MoE layer at prefill sizes with the grouped-GEMM Pallas experts
(pallas_kernels/moe/grouped.py), against XLA's ways to compute the same routed experts, on one GPU?

Run on the GPU: `PYTHONPATH=. python3 experiments/bench_moe_prefill.py` (`--ns 2048,8192`, the default; `--sweep`:
a few GroupedTuning variants at the largest N, or at `--sweep-ns`; `--tuning FIELDS`: the grouped kernels' tuning
for every other row, e.g. block_i=128,stages_gate_up=3; `--smoke`: toy sizes on CPU in interpret mode, nothing
written under experiments/results).
Flash widths: D 2560, I 768, E 512 experts, top-8 of 8 groups keeping 4, a shared expert of Is 768, the clamps of
the last layer (routed 4, shared 5: the costlier epilogue); bf16 random weights ([out, in], as the checkpoint stores
them), an fp32 router of std D^-1/2 (as bench_moe.py) and a small expert bias: random routing, so the group sizes
are uneven (each N's min / mean / max, empty experts and the products the tile padding adds are recorded), though
less skewed than a trained router's.
Rows, per N:
  - grouped_routed: the routed experts alone (tile table, the two kernels, the weighted combine; routing given);
  - layer/router=pallas, layer/router=reference: the whole MoE layer, the router by dispatch.route (that backend),
    the grouped experts, the shared expert and the residual;
  - xla_ragged_dot: the routed experts by lax.ragged_dot with its standard rhs layout [G, in, out] (a one-off
    transposed copy of the stacked weights, 6 GB more, made before the timing and not timed);
  - xla_reference: the reference's routed experts (ragged_dot_general on the stored [E, out, in] weights) at the
    --reference-ns only (default 2048: at 8192 XLA expands it into a dense dot asking for 160 GiB).
The grouped kernels' routed output is checked against both XLA rows (L2 relative error <= REL_ERR_MAX); `--sweep`
checks every tuning against the --tuning run's output.
Timing: median of --iters (>= 5) calls of the jitted function after 2 warm-up calls, each blocked on (a call lasts
milliseconds, so host dispatch is noise). TFLOP/s counts the products: routed 6·P·D·I (P = N·K pairs), shared
6·N·D·Is; the router's 2·N·D·E are in the layer rows' time only.
`--fp8`: every expert matrix block-FP8 (pallas_kernels/common/fp8.py, layout OUT_IN: E4M3 q and float32 128x128
block scales, as the `-fp8` checkpoint stores them), quantised from the same bf16 weights; the layer rows' shared
expert runs on the grouped kernels too (grouped.shared_expert); xla_reference dequantises the stacks to float32 and
takes fp32 products (the reference's numerics, which the kernels follow); ragged_dot's [G, in, out] copy is of the
stacks dequantised to bf16 (XLA's bf16 path, made before the timing; within REL_ERR_MAX of the fp32-weight output).
Every row also gives the fraction of its HBM floor: the expert weights it reads once (routed, plus shared in the
layer rows; bf16, or with --fp8 E4M3 plus the float32 scales) at 4.3 TB/s, a bound far below the products' at these
N.
On a GPU the profiler's per-kernel device times of the layer (router=pallas) at the largest N follow (`--no-profile`
to skip). A row that fails (a tuning that does not compile, an OOM) is reported with its error, not a crash; the
results are saved after each section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from common import HBM_BYTES_PER_S, median_time, parse_tuning, print_table, rel_err, run_header, short, write_results
from pallas_kernels import moe
from pallas_kernels.common import fp8
from pallas_kernels.moe import grouped, reference
from pallas_kernels.moe.grouped import DEFAULT_TUNING

D, E, I, IS, K = 2560, 512, 768, 768, 8
ROUTE_KW = dict(n_group=8, topk_group=4, top_k=K, routed_scaling_factor=2.5)
LIMIT, SHARED_LIMIT = 4.0, 5.0
# Routed outputs against XLA's, L2 relative error: the bound bench_moe.py holds the decode kernels to (bf16).
REL_ERR_MAX = 2e-2

_T = DEFAULT_TUNING
# Around the defaults (BM 64, BN 64, BK 64, 4 warps, 4 stages | BD 128, BKI 64, 4 warps, 3 stages), each fitting
# sm_90 without spills by the venv Triton's compile (experiments/triton_resources.py's method).
SWEEP = [
    _T,
    dataclasses.replace(_T, block_i=128, stages_gate_up=3),  # half the x re-reads; 255 registers, one program per SM
    dataclasses.replace(_T, block_m=128, warps_gate_up=8, warps_down=8),  # two warpgroups: twice the weight reuse
    dataclasses.replace(_T, block_m=128, block_i=32, block_d=64),  # 128 rows on one warpgroup
    dataclasses.replace(_T, block_m=32),  # half the padding, but mma.sync instead of the warpgroup MMA
    dataclasses.replace(_T, weight_eviction="evict_first"),
    dataclasses.replace(_T, block_d=64, stages_down=4),  # down: 117 registers, 64 KiB: three programs per SM
    dataclasses.replace(_T, block_k=128, stages_gate_up=3, block_ki=128, stages_down=2),  # fewer, longer steps
]


def make_weights(key, n_tokens_max, fp8_weights=False):
    """One layer's weights (every matrix [out, in]; with fp8_weights each expert matrix an OUT_IN Fp8Weight), its
    router and bias, and x / residual for the largest N."""
    k = jax.random.split(key, 10)
    bf = jnp.bfloat16

    def normal(kk, shape, fan_in):
        return (jax.random.normal(kk, shape, bf) * (fan_in ** -0.5)).astype(bf)

    w = dict(we_gate=normal(k[0], (E, I, D), D), we_up=normal(k[1], (E, I, D), D), we_down=normal(k[2], (E, D, I), I),
             ws_gate=normal(k[3], (IS, D), D), ws_up=normal(k[4], (IS, D), D), ws_down=normal(k[5], (D, IS), IS),
             router=jax.random.normal(k[6], (E, D), jnp.float32) * (D ** -0.5),
             expert_bias=0.01 * jax.random.normal(k[7], (E,), jnp.float32),
             x=jax.random.normal(k[8], (n_tokens_max, D), bf), residual=jax.random.normal(k[9], (n_tokens_max, D), bf))
    if fp8_weights:
        for name in ("we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down"):
            w[name] = jax.block_until_ready(fp8.quantize(w[name], fp8.OUT_IN))
    return jax.block_until_ready(w)


def matrix_bytes(out, inp, fp8_weights):
    """HBM bytes of one [out, in] expert matrix: bf16, or E4M3 plus its float32 128x128 block scales."""
    if fp8_weights:
        return out * inp + -(-out // 128) * -(-inp // 128) * 4
    return out * inp * 2


def route(x, w, backend):
    return moe.route(x, w["router"], w["expert_bias"], **ROUTE_KW, backend=backend)


@jax.jit
def _route_reference(x, router, bias):
    return moe.route(x, router, bias, **ROUTE_KW)


@jax.jit
def xla_ragged_dot_routed(x, weights, ids, wg_t, wu_t, wd_t):
    """The routed experts by lax.ragged_dot on [G, in, out] weights (gate/up [E, D, I], down [E, I, D]): the
    reference's sorted path with XLA's standard ragged layout."""
    dt = x.dtype
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=wg_t.shape[0]).astype(jnp.int32)
    xs = x[order // k]
    dot = lambda a, b: lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32).astype(dt)  # noqa: E731
    h = reference.swiglu(dot(xs, wg_t), dot(xs, wu_t), LIMIT)
    contrib = dot(h, wd_t).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    per_pair = jnp.zeros((n * k, x.shape[1]), jnp.float32).at[order].set(contrib).reshape(n, k, -1)
    return per_pair.sum(1).astype(dt)


def dequantized(w):
    """An FP8 matrix dequantised to bf16 (XLA's bf16 ragged_dot row; the reference keeps float32); a plain one as it
    is."""
    return fp8.dequantize(w, jnp.bfloat16) if isinstance(w, fp8.Fp8Weight) else w


@jax.jit
def xla_reference_routed(x, weights, ids, we_gate, we_up, we_down):
    return reference.moe_experts(x, weights, ids, we_gate, we_up, we_down, limit=LIMIT, path="sorted")


@functools.partial(jax.jit, static_argnames=("tuning",))
def grouped_routed(x, weights, ids, we_gate, we_up, we_down, tuning=None):
    return grouped.moe_experts(x, weights, ids, we_gate, we_up, we_down, limit=LIMIT, tuning=tuning)


def make_layer(router_backend, tuning):
    @jax.jit
    def layer(x, residual, w):
        weights, ids = route(x, w, router_backend)
        return grouped.moe_experts(x, weights, ids, w["we_gate"], w["we_up"], w["we_down"], w["ws_gate"],
                                   w["ws_up"], w["ws_down"], limit=LIMIT, shared_limit=SHARED_LIMIT, tuning=tuning,
                                   residual=residual)
    return layer


def routing_stats(ids, block_m):
    """Group sizes of the routing and the share of products the tile padding adds (P padded to whole BM tiles)."""
    sizes = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    p = int(sizes.sum())
    padded = int((-(-sizes // block_m) * block_m).sum())
    return dict(pairs=p, min=int(sizes.min()), mean=round(float(sizes.mean()), 1), max=int(sizes.max()),
                std=round(float(sizes.std()), 1), empty_experts=int((sizes == 0).sum()),
                padding_pct_at_bm=round(100 * (padded - p) / p, 1), bm=block_m)


def profile_layer(layer, w, n, results):
    """Per-kernel device µs per call of the layer at N tokens (3 traced calls after 2 warm-ups) into results."""
    from ling_jax.profiling import durations_by_name, trace_kernels

    try:
        events = trace_kernels(lambda: layer(w["x"][:n], w["residual"][:n], w), 3)
    except Exception as exc:
        print(f"profile: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return
    kernels = sorted(((name, sum(durs) / 3, len(durs) // 3) for name, durs in durations_by_name(events).items()),
                     key=lambda k: -k[1])
    results["profile"][f"N{n}"] = [dict(kernel=name, us_per_call=round(us, 1), launches=c) for name, us, c in kernels]
    print(f"\nprofile N={n}, layer router=pallas (device µs per call; kernel sum "
          f"{sum(k[1] for k in kernels):.0f}):", flush=True)
    for name, us, c in kernels[:15]:
        print(f"  {us:9.1f} µs  ({c}×)  {name}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="2048,8192", help="token counts N")
    ap.add_argument("--reference-ns", default="2048", help="N at which the reference's routed path is timed")
    ap.add_argument("--iters", type=int, default=7, help="timed calls per row (median; >= 5)")
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP tunings' routed experts")
    ap.add_argument("--sweep-ns", default="", help="N values of the sweep (default: the largest of --ns)")
    ap.add_argument("--tuning", default="", help="GroupedTuning fields for the non-sweep rows, e.g. block_i=128")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA rows (the reference path, lax.ragged_dot)")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 expert matrices (E4M3 + 128x128 float32 scales)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpret mode): the script's paths")
    args = ap.parse_args(argv)
    global D, E, I, IS, K
    ns = [int(v) for v in args.ns.split(",")]
    ref_ns = {int(v) for v in filter(None, args.reference_ns.split(","))}
    sweep_ns = [int(v) for v in filter(None, args.sweep_ns.split(","))] or [max(ns)]
    if not set(sweep_ns) <= set(ns):
        ap.error(f"--sweep-ns {args.sweep_ns}: each must be one of --ns {args.ns}")
    sweep, iters = SWEEP, args.iters
    if args.smoke:  # interpret mode: tiny widths, few tokens, two tunings, one timed call
        D, E, I, IS, K = 128, 16, 64, 64, 4
        ROUTE_KW["top_k"] = K
        ns, ref_ns, sweep_ns, sweep, iters = [96], {96}, [96], SWEEP[:2], 1
    elif iters < 5:
        ap.error(f"--iters {iters}: the medians need >= 5 calls")
    tuning = parse_tuning(DEFAULT_TUNING, args.tuning)
    header = run_header()
    t_start = time.time()
    w = make_weights(jax.random.key(0), max(ns), fp8_weights=args.fp8)
    routed_bytes = E * (2 * matrix_bytes(I, D, args.fp8) + matrix_bytes(D, I, args.fp8))
    shared_bytes = 2 * matrix_bytes(IS, D, args.fp8) + matrix_bytes(D, IS, args.fp8)
    print(f"weights made in {time.time() - t_start:.1f}s (routed {routed_bytes / 1e9:.2f} GB"
          f"{', FP8' if args.fp8 else ''})", flush=True)
    results = {**header, "D": D, "E": E, "I": I, "Is": IS, "K": K, "limit": LIMIT, "shared_limit": SHARED_LIMIT,
               "tuning": str(tuning), "method": f"median of {iters} calls after 2 warm-ups, each blocked on",
               "rows": [], "routing": {}, "checks": {}, "sweep": [], "profile": {}, "fp8": args.fp8,
               "hbm_bytes_per_s": HBM_BYTES_PER_S}
    out_name = "bench_moe_prefill_fp8.json" if args.fp8 else "bench_moe_prefill.json"
    save = lambda: write_results(out_name, results, to_repo=not args.smoke)  # noqa: E731

    def flops(n, shared):
        return 6 * n * K * D * I + (6 * n * D * IS if shared else 0)

    def row(kind, n, fn, *fargs, shared=False, note=""):
        """Time fn(*fargs) as one row (an exception becomes the row's error); returns its output or None."""
        r = dict(kind=kind, N=n, note=note)
        try:
            t, out = median_time(fn, *fargs, n_rep=iters, n_warm=2)
        except Exception as exc:  # a tuning that does not compile, an OOM: reported, the bench goes on
            if args.smoke:  # (the smoke run is the script's test: nothing skipped)
                raise
            r.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(f"{kind:26s} N={n:5d} FAILED {r['error']}", flush=True)
            results["rows"].append(r)
            return None
        floor_s = (routed_bytes + (shared_bytes if shared else 0)) / HBM_BYTES_PER_S
        r.update(ms=round(t * 1e3, 3), tflops=round(flops(n, shared) / t / 1e12, 1),
                 weight_floor_ms=round(floor_s * 1e3, 3), pct_of_floor=round(100 * floor_s / t, 1))
        results["rows"].append(r)
        print(f"{kind:26s} N={n:5d} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s {r['pct_of_floor']:5.1f}% of the "
              f"weights' HBM floor {note}", flush=True)
        return out

    def check(name, got, want):
        if got is None or want is None:
            return
        err = rel_err(got, want)
        ok = err <= REL_ERR_MAX
        results["checks"][name] = dict(rel_err=err, ok=ok)
        print(f"check {name}: rel err {err:.2e} (bound {REL_ERR_MAX}){'' if ok else '  FAILED'}", flush=True)
        if args.smoke:
            assert ok, name

    routed_w = (w["we_gate"], w["we_up"], w["we_down"])
    routings, outs = {}, {}
    # 1) The grouped kernels: routed experts alone, then the whole layer with either router.
    for n in ns:
        x, res = w["x"][:n], w["residual"][:n]
        weights, ids = jax.block_until_ready(_route_reference(x, w["router"], w["expert_bias"]))
        routings[n] = (weights, ids)
        results["routing"][str(n)] = stats = routing_stats(ids, tuning.block_m)
        print(f"\nN={n}: routing {stats}", flush=True)
        outs[n] = row("grouped_routed", n, functools.partial(grouped_routed, tuning=tuning), x, weights, ids,
                      *routed_w, note=short(tuning))
        for backend in ("pallas", "reference"):
            row(f"layer/router={backend}", n, make_layer(backend, tuning), x, res, w, shared=True)
        save()

    # 2) Tunings of the routed experts at the largest N, each checked against the default run's output.
    for n in (sweep_ns if args.sweep else []):
        x, (weights, ids) = w["x"][:n], routings[n]
        print(f"\nsweep at N={n} (routed experts alone)", flush=True)
        for tu in sweep:
            t0 = time.time()
            out = row("sweep", n, functools.partial(grouped_routed, tuning=tu), x, weights, ids, *routed_w,
                      note=short(tu))
            results["rows"][-1]["wall_s_with_compile"] = round(time.time() - t0, 1)
            results["sweep"].append(results["rows"][-1])
            check(f"sweep N{n} {short(tu)} vs {short(tuning)}", out, outs[n])
        timed = [r for r in results["sweep"] if r["N"] == n and "ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            results.setdefault("best_tuning", {})[str(n)] = best["note"]
            print(f"best at N={n}: {best['note']} {best['ms']} ms {best['tflops']} TFLOP/s", flush=True)
        save()

    # 3) Where the layer's device time goes (before the XLA rows, which may exhaust the memory).
    if jax.default_backend() == "gpu" and not args.no_profile:
        profile_layer(make_layer("pallas", tuning), w, max(ns), results)
        save()

    # 4) XLA's routed experts: the reference's path, then lax.ragged_dot on a [G, in, out] copy (not timed).
    if args.no_xla:
        print_table(results["rows"], ["kind", "N", "ms", "tflops", "pct_of_floor", "note", "error"])
        save()
        return
    for n in sorted(ref_ns & set(ns)):
        want = row("xla_reference", n, xla_reference_routed, w["x"][:n], *routings[n], *routed_w)  # fp32 weights
        check(f"grouped_vs_reference_N{n}", outs[n], want)
    save()
    try:
        transposed = jax.block_until_ready(tuple(jnp.swapaxes(dequantized(a), 1, 2) for a in routed_w))
    except Exception as exc:
        if args.smoke:
            raise
        transposed = None
        results["rows"].append(dict(kind="xla_ragged_dot", error=f"transposed copy: {type(exc).__name__}: "
                                                                 f"{str(exc)[:300]}"))
    if transposed is not None:
        for n in ns:
            want = row("xla_ragged_dot", n, xla_ragged_dot_routed, w["x"][:n], *routings[n], *transposed,
                       note="[G, in, out] copy made before timing")
            check(f"grouped_vs_ragged_dot_N{n}", outs[n], want)
        del transposed
        gc.collect()
    save()

    print_table(results["rows"], ["kind", "N", "ms", "tflops", "pct_of_floor", "note", "error"])
    print(f"total bench time {time.time() - t_start:.0f}s")
    save()


if __name__ == "__main__":
    sys.exit(main())
