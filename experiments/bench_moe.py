"""How close do the Pallas MoE kernels (router + routed experts + shared expert) get to the HBM byte floor at
Ling-3.0-flash sizes, against the pure-XLA reference (gather + einsum)?

Run on the GPU: `PYTHONPATH=. python3 experiments/bench_moe.py` (add `--quick` for no tuning sweep; `--smoke`: toy
sizes, one layer and short sweeps, on CPU in interpret mode, nothing written under experiments/results).
Correctness is checked compiled first (router ids identical on 512 tokens with the N > 1 default and on 64 single
tokens with every swept router tuning, layer vs reference at T in {1, 2, 3, 16}, every swept tuning at T = 1), then:
  - the MoE layer at T = 1 over experts tunings (router default), then over router tunings (best experts tuning;
    `--router-only`: DECODE_TUNING, no experts sweep), ranked by device time on a GPU (the T = 1 chain's wall time
    is the host's); each row also notes the router GEMV's own device time,
  - the MoE layer (best tunings; T > 1 takes experts.default_tuning(T) and router.default_tuning(T), the T = 1 sweeps
    do not apply there) at T = 1..9 and 16, and the XLA reference at T = 1 and 8,
  - the profiler's per-kernel device times of the best config at T = 1 (after the sweep) and at `--profile-ts`
    (default T = 6; at the end), cold weights, inside the chain, with the device times per layer of profile_chain
    and the first call's timeline in the JSON.
`--verify-router FIELDS` / `--verify-experts FIELDS`: every T > 1 runs router.VERIFY_TUNING / experts.VERIFY_TUNING
with these fields replaced instead of the default by T (e.g. `prefetch_chunk_bytes=0`: the shared-expert prefetch
off; `verify_gate_up=fma_tokens,block_i=2,warps_gate_up=1,block_k=256,routed_eviction=evict_first`:
experts.FMA_TOKENS_TUNING, the T = 2 default, at every T).
Results are saved after each section (a timeout keeps what finished), to bench_moe.json (--fp8: bench_moe_fp8.json).
Weights are cold: NL = 8 layers of experts (6.0 GB each, 48 GB) and routers, used in rotation, so a layer's
weights were last touched >= 7 layers (>= 0.7 GB) earlier, far past the 60 MB L2.
Timing has no per-call host cost: one jitted executable runs a *chain* of R·NL layers, each waiting for the
previous one (its routing depends on it, nothing overlaps or hoists), all inputs passed once. µs/layer = slope
between the R = 1 and R = 3 executables / NL (removes the executable's fixed launch cost), median of `--iters` runs
of each. `--chain` (make_chain): "add" (the default): layer l's input is x_l + 1e-3·y_{l-1}, one bf16 [T, D] add
(at T > 1 it fuses into the combine fusion, at T = 1 it is its own small fusion); "residual": layer l's output is
x_{l+1} + MoE_l(input), the experts' `residual` input as the model passes it (at T = 1 in the down kernel's
epilogue) and the next layer's input; "direct": layer l's output MoE_l(input) is the next layer's input, no add (the
MoE layer alone); "norm": the next input is an RMSNorm of the output, an XLA fusion between layers as the model's
post-attention norm, so no layer's router GEMV is admitted early by the previous down kernel (the model's case).
`--router-dtype bfloat16`: the routers held in bf16, as a BF16 checkpoint stores `mlp.gate.weight` and the model
keeps it (LingConfig.router_weight_dtype; the kernels widen it exactly, same selection as its fp32 copy); default
float32 (transformers' save_pretrained).
`--fp8`: every expert matrix (routed and shared) block-FP8 (pallas_kernels/common/fp8.py, layout OUT_IN: E4M3 q
and float32 128x128 block scales, as the `-fp8` checkpoint stores them), quantised from the same bf16 weights; the
kernels' FP8 defaults by T (experts.default_tuning; T = 1: DECODE_TUNING_FP8, swept around it: EXPERTS_SWEEP_FP8,
the experts only, router.default_tuning(1) throughout, ranked by device time alone: `--fp8 --no-ts` is a short
sweep run), the router's prefetch hint given the shared expert's q arrays, and the reference with the float32
weights (fp8.dequantize(w, float32)).
Bytes: router D·E·(4 or 2) + (distinct experts + shared) · 3·D·I·(2, or 1 with --fp8 plus each matrix's
ceil(D/128)·ceil(I/128) float32 scales); % of 4.3 TB/s (measured H200 copy rate): the fraction of the HBM floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import (HBM_BYTES_PER_S, parse_tuning, parse_tunings, print_table, rel_err, run_header, short,
                    slope_per_call, write_results)
from pallas_kernels import moe
from pallas_kernels.common import fp8
from pallas_kernels.moe import router as router_mod
from pallas_kernels.moe.experts import (DECODE_TUNING, DECODE_TUNING_FP8, VERIFY_TUNING, VERIFY_TUNING_FP8,
                                        ExpertsTuning, moe_experts_fused)
from pallas_kernels.moe.router import DECODE_TUNING as ROUTER_DECODE

D, E, I, K = 2560, 512, 768, 8
ROUTE_KW = dict(n_group=8, topk_group=4, top_k=K, routed_scaling_factor=2.5)
HBM = HBM_BYTES_PER_S
VERIFY_ROUTER = VERIFY_EXPERTS = None  # --verify-router, --verify-experts
CHAIN = "add"  # --chain
LIMIT, SHARED_LIMIT = 4.0, 5.0  # layer 35's clamps (both clamps on: the costlier epilogue)
# The layer against the reference, L2 relative error: the bound tests/ops/test_moe.py holds the bf16 kernels to.
REL_ERR_MAX = 2e-2

# Gate/up are [.., I, D] and down [.., D, I]: a gate/up program streams BI whole rows of D (BK-wide tiles), a T = 1
# down program the BD rows of I of each selected expert. T = 1 sweep around the decode default: rows and warps per
# gate/up program, and the down program's rows, warps and chunk width.
_D = DECODE_TUNING
EXPERTS_SWEEP = [
    _D,
    dataclasses.replace(_D, block_i=4, warps_gate_up=2),
    dataclasses.replace(_D, block_i=8, warps_gate_up=4),
    ExpertsTuning(),  # 16 rows, 4 warps, BK 256; down 64 rows, 4 warps
    dataclasses.replace(_D, block_d=2),
    dataclasses.replace(_D, block_d=2, warps_down=2),
    dataclasses.replace(_D, block_ki=128),
]
# --fp8, T = 1: DECODE_TUNING_FP8 (the down kernel as one program per (slot, BD features) over all of I, each feature
# block's last program combining) beside the fused one-launch down it replaced, the slots' partials combined by XLA
# (down_t1="slots"), other BD and warps, no eviction hint, other gate/up rows and chunks, and gate/up through the
# dots. Each tuning: one compiled check and one profiled chain (device time, no wall slope): `--fp8 --no-ts` ends
# after this sweep and the T = 1 profile.
_F = DECODE_TUNING_FP8
_S = dataclasses.replace(_F, down_t1="slots")
EXPERTS_SWEEP_FP8 = [
    _F,
    # the fused one-launch down of 2 features per program (the default before the slot-parallel down)
    dataclasses.replace(_F, down_t1="fused", block_d=2, warps_down=1),
    dataclasses.replace(_F, block_d=32),
    dataclasses.replace(_F, block_d=64, warps_down=8),
    dataclasses.replace(_F, block_d=128, warps_down=8),
    dataclasses.replace(_F, block_d=16),
    dataclasses.replace(_S, block_d=64, warps_down=4),
    dataclasses.replace(_S, block_d=32, warps_down=4),
    dataclasses.replace(_F, routed_eviction=None),
    dataclasses.replace(_F, block_i=8, warps_gate_up=2),
    dataclasses.replace(_F, block_k=256),
    # gate/up as T > 1 does it (the token padded to 16 rows, tensor-core dots, loads pipelined through shared memory)
    dataclasses.replace(_F, t1_gate_up="dot", block_i=32, warps_gate_up=2, block_k=256, stages_gate_up=3,
                        routed_eviction=None),
]
# The router is [E, D]: a GEMV program streams BE expert rows' D-split (KS splits, BK-wide tiles). T = 1 sweep
# around router.DECODE_TUNING (BE 1, KS 5, BK 512, 1 warp): rows, splits, warps, stages, and the top-k program's
# warps. BK is capped at D/KS's largest power-of-two divisor.
_R = ROUTER_DECODE
ROUTER_SWEEP = [
    _R,
    dataclasses.replace(_R, block_e=2),
    dataclasses.replace(_R, k_splits=4),
    dataclasses.replace(_R, k_splits=10),
    dataclasses.replace(_R, num_warps=2, block_e=2),
    dataclasses.replace(_R, num_stages=1),
    dataclasses.replace(_R, topk_warps=8),
]


def _fp8_layer(base, c):
    """A layer of FP8 experts from the quantised base: its own copy of each q and the scales times c (cold buffers,
    the same statistics)."""
    return {n: fp8.Fp8Weight(jnp.array(w.q, copy=True), w.scale * c, fp8.OUT_IN) for n, w in base.items()}


def make_layers(nl, key, router_dtype=jnp.float32, fp8_weights=False):
    k = jax.random.split(key, 8)
    bf = jnp.bfloat16
    base = dict(  # every expert matrix [out, in] (ling_jax/params.py): gate/up [.., I, D], down [.., D, I]
        we_gate=(jax.random.normal(k[0], (E, I, D), bf) * (D ** -0.5)).astype(bf),
        we_up=(jax.random.normal(k[1], (E, I, D), bf) * (D ** -0.5)).astype(bf),
        we_down=(jax.random.normal(k[2], (E, D, I), bf) * (I ** -0.5)).astype(bf),
        ws_gate=(jax.random.normal(k[3], (I, D), bf) * (D ** -0.5)).astype(bf),
        ws_up=(jax.random.normal(k[4], (I, D), bf) * (D ** -0.5)).astype(bf),
        ws_down=(jax.random.normal(k[5], (D, I), bf) * (I ** -0.5)).astype(bf),
    )
    if fp8_weights:  # quantised once (a full-size float32 pass per matrix), then copied per layer
        base = {n: jax.block_until_ready(fp8.quantize(w, fp8.OUT_IN)) for n, w in base.items()}
    layers = []
    for l in range(nl):
        c = jnp.asarray(1.0 + 0.01 * l, bf)
        if fp8_weights:
            lay = _fp8_layer(base, 1.0 + 0.01 * l)
        else:
            lay = {n: (w * c) for n, w in base.items()}  # distinct buffers per layer (cold), same statistics
        lay["router"] = (jax.random.normal(jax.random.fold_in(k[6], l), (E, D), jnp.float32)
                         * (D ** -0.5)).astype(router_dtype)  # [E, D]
        lay["expert_bias"] = 0.01 * jax.random.normal(jax.random.fold_in(k[7], l), (E,), jnp.float32)
        layers.append(jax.block_until_ready(lay))
    del base
    return layers


def moe_layer(x, lay, backend, et=None, rt=None, residual=None):
    if backend == "reference":
        w, ids = moe.route(x, lay["router"], lay["expert_bias"], **ROUTE_KW)
        return moe.moe_experts(x, w, ids, lay["we_gate"], lay["we_up"], lay["we_down"], lay["ws_gate"],
                               lay["ws_up"], lay["ws_down"], limit=LIMIT, shared_limit=SHARED_LIMIT,
                               residual=residual)
    if x.shape[0] > 1:  # the T = 1 sweeps' tunings; T > 1 runs experts/router.default_tuning(T)
        et, rt = VERIFY_EXPERTS, VERIFY_ROUTER  # (--verify-*: the VERIFY_TUNINGs with some fields replaced)
    # The model's MoE block (ling_jax/layers/moe.py): the top-k launch prefetches the shared expert into L2.
    # (FP8: the shared expert's q arrays; its scales are 4 bytes per 16 KB, read from HBM.)
    shared = tuple(getattr(lay[n], "q", lay[n]) for n in ("ws_gate", "ws_up", "ws_down"))
    w, ids = router_mod.route(x, lay["router"], lay["expert_bias"], **ROUTE_KW, tuning=rt, prefetch=shared)
    return moe_experts_fused(x, w, ids, lay["we_gate"], lay["we_up"], lay["we_down"], lay["ws_gate"],
                             lay["ws_up"], lay["ws_down"], limit=LIMIT, shared_limit=SHARED_LIMIT,
                             tuning=et, residual=residual)


def rms_norm(y):
    """RMSNorm without weight, an XLA fusion between MoE layers in the "norm" chain (the model's post-attention
    norm stands there)."""
    y32 = y.astype(jnp.float32)
    return (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + 1e-6)).astype(y.dtype)


def make_chain(layer_fn, nl, reps):
    """One executable: reps·nl layers in a chain, layer_fn(x, layer, residual), linked as CHAIN says (module
    docstring)."""
    @jax.jit
    def run(layers, xs):
        if CHAIN == "norm":
            x = xs[0]
            for _ in range(reps):
                for l in range(nl):
                    x = rms_norm(layer_fn(x, layers[l], None))
            return x
        if CHAIN == "add":
            y = jnp.zeros_like(xs[0])
            for _ in range(reps):
                for l in range(nl):
                    y = layer_fn(xs[l] + (y * 1e-3).astype(y.dtype), layers[l], None)
            return y
        x = xs[0]
        for _ in range(reps):
            for l in range(nl):
                x = layer_fn(x, layers[l], None if CHAIN == "direct" else xs[(l + 1) % nl])
        return x
    return run


def time_chain(layer_fn, layers, xs, reps=(1, 3), iters=10):
    """µs per layer (slope over reps, common.slope_per_call) and the spread per layer of the larger run."""
    return slope_per_call(lambda r: functools.partial(make_chain(layer_fn, len(layers), r), layers, xs),
                          len(layers), reps, iters)


def profile_chain(layer_fn, layers, xs, n=5):
    """Per-kernel device µs per layer from the JAX profiler (cold weights, inside the R = 1 chain), the first
    traced call's timeline [(kernel, start µs from the call's first event, duration µs)] and three device times per
    layer, each a median over the traced calls:
      - span: the call's first event to its last kernel's end, / NL. It includes what happens once per call before
        the first layer (here a copy of the chain's input and a gap: 2.6-2.9 µs at T = 1), so it depends on NL;
      - layers: the same from the first layer's first kernel (the router GEMV), / NL: at T = 1 in the "direct" and
        "residual" chains every layer, the first one included, and nothing else (at T > 1 and in the "add" chain a
        fusion precedes each layer's GEMV, and the first layer's is left out);
      - period: between the ends of successive layers' down launches, / (NL - 1)
        (ling_jax.profiling.call_period_us): the steady state, which leaves out the first layer too (its GEMV is the
        only one not admitted early by a preceding down kernel's PDL trigger);
      - own: each layer's router GEMV start to its down launch's end, median over layers and calls
        (ling_jax.profiling.call_layer_span_us): the layer alone. In the "norm" chain an XLA fusion (as the model's
        norm) precedes each GEMV, which is then admitted when the fusion ends, not early by the previous down
        kernel: the model's MoE layer; in the "direct" chain it counts the early-admitted GEMV's wait too.
    With PDL the kernel sum overstates: a kernel admitted early (experts.ExpertsTuning.early_launch_down's
    successor) shows its wait for the predecessor in its own duration."""
    from ling_jax.profiling import (call_layer_span_us, call_period_us, call_span_us, durations_by_name, split_calls,
                                    trace_kernels)

    nl = len(layers)
    run = make_chain(layer_fn, nl, 1)
    events = trace_kernels(lambda: run(layers, xs), n)
    kernels = []
    for name, durs in durations_by_name(events).items():
        per_call = len(durs) / n  # launches per executable
        kernels.append(dict(kernel=name, per_layer=round(per_call / nl, 2),
                            median_us=round(statistics.median(durs), 2), us_per_layer=round(sum(durs) / n / nl, 2)))
    kernels.sort(key=lambda k: -k["us_per_layer"])
    calls = split_calls(events)
    t0 = calls[0][0][1] if calls else 0.0
    timeline = [(name[:48], round(ts - t0, 2), round(dur, 2)) for name, ts, dur in (calls[0] if calls else [])]
    per_layer = dict(span=call_span_us(calls) / nl, layers=call_span_us(calls, "router_fwd_kernel_gemv") / nl,
                     period=call_period_us(calls, "experts_fwd_kernel_down", nl),
                     own=call_layer_span_us(calls, "router_fwd_kernel_gemv", "experts_fwd_kernel_down", nl))
    return kernels, {k: round(v, 2) for k, v in per_layer.items()}, timeline


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="no sweep: the tunings of --experts / --router")
    ap.add_argument("--experts", default="",
                    help="--quick: DECODE_TUNING (--fp8: DECODE_TUNING_FP8) with these fields, e.g. "
                         "block_i=4,warps_gate_up=2")
    ap.add_argument("--router", default="",
                    help="--quick: router.default_tuning(1, --router-dtype) with these fields, e.g. block_e=2")
    ap.add_argument("--router-only", action="store_true", help="sweep the router only (experts DECODE_TUNING)")
    ap.add_argument("--experts-sweep", default="",
                    help="the T = 1 experts sweep instead of EXPERTS_SWEEP(_FP8): `;`-separated field lists over "
                         "DECODE_TUNING (--fp8: DECODE_TUNING_FP8), e.g. 'default;down_t1=slots,block_d=64'")
    ap.add_argument("--no-ts", action="store_true", help="stop after the sweep (and the T = 1 profile)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ts", default="1,2,3,4,5,6,7,8,9,16")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--chain", choices=("add", "residual", "direct", "norm"), default="add",
                    help="how layers chain (make_chain, module docstring): x_l + 1e-3·y, the experts' residual input, "
                         "none (each output is the next input), or an RMSNorm of the output (an XLA fusion between "
                         "layers, as in the model)")
    ap.add_argument("--profile-ts", default="6", help="T values > 1 profiled at the end (T = 1 is after the sweep)")
    ap.add_argument("--verify-router", default="",
                    help="T > 1: router.VERIFY_TUNING with these fields (e.g. prefetch_chunk_bytes=0)")
    ap.add_argument("--verify-experts", default="",
                    help="T > 1: experts.VERIFY_TUNING with these fields (e.g. verify_gate_up=fma_tokens,block_i=2,"
                         "warps_gate_up=1)")
    ap.add_argument("--router-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the routers' dtype: bfloat16 as a BF16 checkpoint stores them")
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 expert matrices (E4M3 + 128x128 float32 scales) and the kernels' FP8 tunings")
    ap.add_argument("--smoke", action="store_true",
                    help="toy sizes, 1 layer, short sweeps and checks: the script's paths on CPU (interpret mode)")
    args = ap.parse_args(argv)
    global D, E, I, VERIFY_ROUTER, VERIFY_EXPERTS, CHAIN
    CHAIN = args.chain
    VERIFY_ROUTER = parse_tuning(router_mod.VERIFY_TUNING, args.verify_router) if args.verify_router else None
    decode_base, verify_base = (DECODE_TUNING_FP8, VERIFY_TUNING_FP8) if args.fp8 else (DECODE_TUNING, VERIFY_TUNING)
    VERIFY_EXPERTS = parse_tuning(verify_base, args.verify_experts) if args.verify_experts else None
    profile_ts = [int(t) for t in filter(None, args.profile_ts.split(","))]
    if any(t < 2 for t in profile_ts):
        ap.error(f"--profile-ts {args.profile_ts}: T values > 1 (T = 1 is profiled after the sweep)")
    experts_sweep, router_sweep, reps, n_batch, n_single = (EXPERTS_SWEEP_FP8 if args.fp8 else EXPERTS_SWEEP,
                                                            ROUTER_SWEEP, (1, 3), 512, 64)
    if args.experts_sweep:
        experts_sweep = parse_tunings(decode_base, args.experts_sweep)
    ts, nl, iters, check_ts = args.ts, args.layers, args.iters, (1, 2, 3, 16)
    # --fp8 sweeps the experts only: the router GEMV is the same with FP8 experts (its sweep is the plain run's), so
    # the FP8 sweep stays short (EXPERTS_SWEEP_FP8)
    fp8_experts_only = args.fp8 and not args.router_only
    if fp8_experts_only:
        router_sweep = [router_mod.default_tuning(1, args.router_dtype)]
    if args.smoke:  # each distinct layer compiles for seconds in interpret mode: few of them, tiny ones
        D, E, I = 128, 32, 32
        ROUTE_KW["top_k"] = 2
        experts_sweep, router_sweep, reps, n_batch, n_single = experts_sweep[:2], router_sweep[:1], (1, 2), 32, 4
        ts, nl, iters, check_ts = "1,3", 1, 1, (1, 2, 16)
    header = run_header()
    t_start = time.time()
    layers = make_layers(nl, jax.random.key(0), jnp.dtype(args.router_dtype), fp8_weights=args.fp8)
    print(f"made {nl} layers in {time.time() - t_start:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    xs_cache = {}

    def xs_for(t):  # [NL, T, D] bf16: every layer's own input
        if t not in xs_cache:
            xs_cache[t] = jnp.asarray(rng.standard_normal((nl, t, D)), jnp.bfloat16)
        return xs_cache[t]

    results = {**header, "layers": nl,
               "method": f"chain of R·NL layers in one executable, slope R={reps[0]}..{reps[1]}",
               "limit": LIMIT, "shared_limit": SHARED_LIMIT, "hbm_bytes_per_s": HBM, "rows": [], "checks": {},
               "profile": {}, "router_dtype": args.router_dtype, "chain": args.chain, "fp8": args.fp8}

    # Correctness, compiled.
    lay = layers[0]
    xr = jnp.asarray(rng.standard_normal((n_batch, D)), jnp.bfloat16)
    w_r, i_r = moe.route(xr, lay["router"], lay["expert_bias"], **ROUTE_KW)

    def check_router(rt, n_tok):  # rt None: the N > 1 default (all n_batch tokens at once); else T = 1, one by one
        if rt is None:
            w_p, i_p = router_mod.route(xr, lay["router"], lay["expert_bias"], **ROUTE_KW)
        else:
            outs = [router_mod.route(xr[i:i + 1], lay["router"], lay["expert_bias"], **ROUTE_KW, tuning=rt)
                    for i in range(n_tok)]
            w_p, i_p = (np.concatenate([np.asarray(o[j]) for o in outs]) for j in (0, 1))
        mism = int((np.asarray(i_p) != np.asarray(i_r[:n_tok])).any(axis=1).sum())
        werr = float(np.abs(np.asarray(w_p) - np.asarray(w_r[:n_tok])).max())
        label = "N>1 default" if rt is None else short(rt)
        results["checks"][f"router_ids_differ_of_{n_tok} {label}"] = mism
        print(f"check router {label}: tokens with different ids {mism}/{n_tok}, weights max err {werr:.2e}",
              flush=True)
        assert mism == 0, label

    check_router(None, n_batch)
    for rt in router_sweep if not args.quick else [parse_tuning(router_mod.default_tuning(1, args.router_dtype),
                                                                args.router)]:
        check_router(rt, n_single)
    for t in check_ts:  # T = 2, 3: experts.FMA_TOKENS_TUNING; T = 16: VERIFY_TUNING (or --verify-* overrides)
        x = xs_for(t)[0]
        err = rel_err(moe_layer(x, lay, "pallas"), moe_layer(x, lay, "reference"))
        results["checks"][f"moe_T{t}_rel_err_bf16"] = err
        print(f"check moe layer T={t}: rel err vs reference {err:.2e} (bound {REL_ERR_MAX})", flush=True)
        assert err <= REL_ERR_MAX

    # One expert matrix's bytes: bf16, or E4M3 plus its float32 128x128 block scales.
    matrix_bytes = D * I + -(-D // 128) * -(-I // 128) * 4 if args.fp8 else D * I * 2

    def floor_bytes(t):
        xs = xs_for(t)
        distinct = statistics.mean(
            len(set(np.asarray(moe.route(xs[l], layers[l]["router"], layers[l]["expert_bias"], **ROUTE_KW)[1])
                    .reshape(-1).tolist())) for l in range(nl))
        return D * E * jnp.dtype(args.router_dtype).itemsize + (distinct + 1) * 3 * matrix_bytes, distinct

    def row(kind, backend, t, us, spread, nbytes, distinct, note=""):
        gbs = nbytes / (us * 1e-6) / 1e9
        r = dict(kind=kind, backend=backend, T=t, us=round(us, 2), spread_us=round(spread, 2),
                 floor_us=round(nbytes / HBM * 1e6, 2), bytes=int(nbytes), GBps=round(gbs, 1),
                 pct_of_4p3TBps=round(100 * gbs * 1e9 / HBM, 1), distinct_experts=distinct, note=note)
        results["rows"].append(r)
        print(f"{kind:10s} {backend:9s} T={t:2d} {us:8.2f} µs/layer (±{spread:.2f}) floor {r['floor_us']:6.2f} µs "
              f"{gbs:7.0f} GB/s {r['pct_of_4p3TBps']:5.1f}% distinct={distinct} {note}", flush=True)

    def timed(t, et=None, rt=None, backend="pallas"):
        return time_chain(lambda x, lay, res: moe_layer(x, lay, backend, et, rt, res), layers, xs_for(t),
                          reps=reps, iters=iters)

    nb1, d1 = floor_bytes(1)
    x1 = xs_for(1)[0]
    y1_ref = moe_layer(x1, lay, "reference")

    # 1) Experts tunings at T = 1 (router default), then router tunings (best experts tuning).
    def device_us(et, rt):  # (layer, router GEMV) device µs per layer (profiler, cold chain); None off the GPU
        if jax.default_backend() != "gpu":
            return None, None
        ks, times, _ = profile_chain(lambda x, lay, res: moe_layer(x, lay, "pallas", et, rt, res), layers,
                                     xs_for(1))
        gemv = sum(k["us_per_layer"] for k in ks if "router_fwd_kernel_gemv" in k["kernel"])
        return times["span"], round(gemv, 2)

    # At T = 1 the chain's wall slope follows the host's kernel launches, not the ~37 µs of device work (30-59 µs
    # per layer over one sweep, some below the device time): the sweep ranks by device time when it has it.
    def sweep(kind, configs, make):
        best = (configs[0], 1e9)
        for c in configs:
            et, rt = make(c)
            try:
                err = rel_err(moe_layer(x1, lay, "pallas", et, rt), y1_ref)
                assert err <= REL_ERR_MAX, f"rel err {err:.2e}"
                dev, dev_gemv = device_us(et, rt)
                # --fp8 on a GPU: device time only (the wall slope, the host's here, would cost two more compiles)
                us, sp = (dev, 0.0) if fp8_experts_only and dev is not None else timed(1, et, rt)
            except Exception as exc:  # a tuning that fails to compile or check is skipped with its reason
                if args.smoke:  # (the smoke run is the script's test: nothing skipped)
                    raise
                print(f"skip {c}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            row(kind, "pallas", 1, us, sp, nb1, d1, note=f"device {dev} µs (router GEMV {dev_gemv}) {short(c)}")
            results["rows"][-1]["device_us"], results["rows"][-1]["router_gemv_device_us"] = dev, dev_gemv
            score = us if dev is None else dev
            if score < best[1]:
                best = (c, score)
        return best[0]

    if args.quick:
        et_best = parse_tuning(decode_base, args.experts)
        rt_best = parse_tuning(router_mod.default_tuning(1, args.router_dtype), args.router)
    else:
        et_best = decode_base if args.router_only else sweep("sweep_exp", experts_sweep, lambda c: (c, None))
        rt_best = router_sweep[0] if fp8_experts_only else sweep("sweep_rtr", router_sweep, lambda c: (et_best, c))
    results["best_experts_tuning"], results["best_router_tuning"] = str(et_best), str(rt_best)
    results["verify_router_tuning"] = str(VERIFY_ROUTER or "router.default_tuning(T)")
    results["verify_experts_tuning"] = str(VERIFY_EXPERTS or "experts.default_tuning(T)")
    print(f"best: {short(et_best)} {short(rt_best)}  [{time.time() - t_start:.0f}s]", flush=True)
    out_name = "bench_moe_fp8.json" if args.fp8 else "bench_moe.json"
    save = lambda: write_results(out_name, results, to_repo=not args.smoke)  # noqa: E731
    save()

    def prof(t):  # per-kernel device times of the best config (profiler, inside the cold chain)
        if args.no_profile or jax.default_backend() != "gpu":
            return
        try:
            ks, times, timeline = profile_chain(
                lambda x, lay, res: moe_layer(x, lay, "pallas", et_best, rt_best, res), layers, xs_for(t))
        except Exception as exc:
            print(f"profile T={t}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return
        results["profile"][f"T{t}"] = ks
        results["profile"][f"T{t}_span_us_per_layer"] = times["span"]
        results["profile"][f"T{t}_layers_us_per_layer"] = times["layers"]
        results["profile"][f"T{t}_period_us_per_layer"] = times["period"]
        results["profile"][f"T{t}_own_us_per_layer"] = times["own"]
        results["profile"][f"T{t}_timeline_first_call"] = timeline
        print(f"\nprofile T={t} (device µs per layer, cold): timeline span {times['span']:.2f}, from the first layer "
              f"{times['layers']:.2f}, steady-state period {times['period']:.2f}, own (GEMV start to down end) "
              f"{times['own']:.2f}, kernel sum {sum(k['us_per_layer'] for k in ks):.2f}")
        for k in ks:
            print(f"  {k['us_per_layer']:8.2f} µs/layer  ({k['per_layer']}× median {k['median_us']} µs)  "
                  f"{k['kernel']}", flush=True)
        save()

    prof(1)

    # 2) Full MoE layer with the best tunings over T, and the XLA reference at T = 1 and 8.
    for t in [] if args.no_ts else [int(v) for v in ts.split(",")]:
        nbytes, distinct = floor_bytes(t)
        if t in (3, 6):  # compiled, at T > 1 (the defaults by T, or the --verify-* overrides: the sweeps are T = 1)
            x = xs_for(t)[0]
            err = rel_err(moe_layer(x, lay, "pallas", et_best, rt_best), moe_layer(x, lay, "reference"))
            results["checks"][f"moe_T{t}_best_tunings_rel_err_bf16"] = err
            print(f"check moe layer T={t}, best tunings: rel err vs reference {err:.2e} (bound {REL_ERR_MAX})",
                  flush=True)
            assert err <= REL_ERR_MAX
        for backend in ("pallas", "reference"):
            if backend == "reference" and t not in (1, 8):
                continue
            us, sp = timed(t, et_best, rt_best, backend)
            row("moe_layer", backend, t, us, sp, nbytes, round(distinct, 2),
                note=f"best tunings [{time.time() - t_start:.0f}s]" if backend == "pallas" else "")
        save()

    if not args.no_ts:
        for t in profile_ts:
            prof(t)

    save()
    print_table(results["rows"], ["kind", "backend", "T", "us", "floor_us", "GBps", "pct_of_4p3TBps",
                                  "distinct_experts", "note"])
    print(f"total bench time {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
