"""Where does the time of one decode-path op go, kernel by kernel? (device-side durations from the JAX profiler)

Runs each op (the kernels' default configs) at Ling-3.0-flash shape, batch 1, N times inside
`jax.profiler.trace`, then reads the Perfetto trace and prints, per op, every GPU kernel's median duration, the
median gap before it, and the call's timeline span (first kernel start to last kernel end). The MLA ops run
MLA_CACHES attention calls per executable, each over its own full cache, so the cache reads are cold and the
per-op numbers divide by that count; the KDA and MoE ops reuse their weights every call (kernel durations are then
a lower bound for the memory-bound ones). The benches' end-to-end numbers remain the headline; this is for
latency-bound ops (KDA decode, the router, MLA at short L), whose times the host clock cannot resolve.

Run on the GPU: `PYTHONPATH=. python3 experiments/profile_ops.py [--ops kda_decode,moe,mla_32k_t1] [--n 20]
[--mla-tuning block_k=128,num_warps=8] [--json mla_profile.json]`; `--ops` names: see ops_table (kda_prefill8k,
not in the default list, is the T = 8192 chunked prefill). `PYTHONPATH=. JAX_PLATFORMS=cpu python
experiments/profile_ops.py --smoke`: toy shapes, every op function traced once in interpret mode; the CPU trace
holds no GPU events, and nothing is written to the repo.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import parse_tuning, run_header, write_results
from ling_jax.profiling import call_span_us, split_calls, trace_kernels
from pallas_kernels import kda, mla, moe
from pallas_kernels.mla.decode import MLADecodeTuning

FLASH = dict(H=32, K=128, W=4, D=2560, E=512, I=768, R=512, P=64)
TOY = dict(H=2, K=16, W=4, D=256, E=64, I=128, R=64, P=16)
S = dict(FLASH)  # the shapes the ops build; --smoke replaces them with TOY
MLA_CACHES = 8  # distinct full caches per call: 8 × 37.7 MB at L = 32k > the 60 MB L2, so reads are cold
MLA_TUNING = None  # --mla-tuning: an MLADecodeTuning for the Pallas MLA ops


def kda_op(backend, T):
    H, K, W = S["H"], S["K"], S["W"]
    rng = np.random.default_rng(0)
    a = lambda shape, s=1.0, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(shape) * s, dt)  # noqa: E731
    args = (a((1, T, 3, H, K)), a((1, T, H, K)), a((1, T, H)), a((1, T, H, K)), a((1, W - 1, 3, H, K)),
            a((1, H, K, K), 0.1, jnp.float32), a((W, 3, H, K), 0.5, jnp.float32), a((H,), 0.5, jnp.float32),
            a((H, K), 0.5, jnp.float32), a((K,), 1.0))
    if T <= 16:  # decode and verify take the fused projection's output packed
        args = (kda.reference.pack(*args[:4]), *args[4:])
    op = kda.kda_decode if T == 1 else kda.kda_verify if T <= 16 else kda.kda_prefill
    return jax.jit(lambda *x: op(*x, backend=backend)), args


def moe_op(backend, T):
    D, E, I = S["D"], S["E"], S["I"]
    k = jax.random.split(jax.random.key(0), 8)
    bf = jnp.bfloat16
    lay = dict(  # every expert matrix [out, in] (ling_jax/params.py): gate/up [.., I, D], down [.., D, I]
        we_gate=jax.random.normal(k[0], (E, I, D), bf), we_up=jax.random.normal(k[1], (E, I, D), bf),
        we_down=jax.random.normal(k[2], (E, D, I), bf), ws_gate=jax.random.normal(k[3], (I, D), bf),
        ws_up=jax.random.normal(k[4], (I, D), bf), ws_down=jax.random.normal(k[5], (D, I), bf),
        router=jax.random.normal(k[6], (E, D), jnp.float32) * D ** -0.5,
        expert_bias=0.01 * jax.random.normal(k[7], (E,), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (T, D), bf)

    def layer(x, lay):
        w, ids = moe.route(x, lay["router"], lay["expert_bias"], n_group=8, topk_group=4, top_k=8,
                           routed_scaling_factor=2.5, backend=backend)
        return moe.moe_experts(x, w, ids, lay["we_gate"], lay["we_up"], lay["we_down"], lay["ws_gate"],
                               lay["ws_up"], lay["ws_down"], limit=4.0, shared_limit=5.0, backend=backend)
    return jax.jit(layer), (x, lay)


def mla_op(backend, T, L):
    """MLA_CACHES attention calls per executable, each over its own full cache (start = L - T)."""
    H, R, P = S["H"], S["R"], S["P"]
    rng = np.random.default_rng(0)
    ql = jnp.asarray(rng.standard_normal((1, T, H, R)) * 0.05, jnp.float32)
    qr = jnp.asarray(rng.standard_normal((1, T, H, P)), jnp.bfloat16)
    caches = [jnp.asarray(rng.standard_normal((1, L, R + P)), jnp.bfloat16) for _ in range(MLA_CACHES)]
    kw = dict(tuning=MLA_TUNING) if backend == "pallas" and MLA_TUNING is not None else {}
    fn = jax.jit(lambda ql, qr, cs: [mla.mla_decode_attention(ql, qr, c, jnp.int32(L - T), scale=192 ** -0.5,
                                                              backend=backend, **kw) for c in cs])
    return fn, (ql, qr, caches)


def ops_table(smoke=False):
    """Op name -> (backend -> (jitted fn, args)); smoke: the same ops at toy lengths (prefill T 100, caches 128)."""
    prefill_t = 100 if smoke else 8192
    return {
        "kda_decode": lambda b: kda_op(b, 1),
        "kda_verify6": lambda b: kda_op(b, 6),
        "kda_prefill8k": lambda b: kda_op(b, prefill_t),
        "moe": lambda b: moe_op(b, 1),
        "moe6": lambda b: moe_op(b, 6),
        **{f"mla_{L // 1024}k_t{T}": functools.partial(lambda b, T, L: mla_op(b, T, L), T=T, L=128 if smoke else L)
           for L in (1024, 8192, 32768) for T in (1, 6)},
    }


OPS = ops_table()
DEFAULT_OPS = "kda_decode,kda_verify6,moe,moe6,mla_1k_t1,mla_32k_t1"
SMOKE_OPS = "kda_decode,kda_verify6,kda_prefill8k,moe,moe6,mla_1k_t1"  # every op function once


def profile(name, backend, n):
    """Per-kernel medians over the n traced calls, or None when the trace holds no GPU events."""
    fn, args = OPS[name](backend)
    calls = split_calls(trace_kernels(lambda: fn(*args), n))
    if not calls:
        return None
    kernels = []
    for j in range(len(calls[0])):
        durs = [c[j][2] for c in calls]
        gaps = [c[j][1] - (c[j - 1][1] + c[j - 1][2]) for c in calls] if j else [0.0]
        kernels.append(dict(kernel=calls[0][j][0][:90], dur_us=round(statistics.median(durs), 2),
                            gap_before_us=round(statistics.median(gaps), 2)))
    span, per = call_span_us(calls), MLA_CACHES if name.startswith("mla_") else 1
    k_sum = sum(k["dur_us"] for k in kernels)
    return dict(op=name, backend=backend, calls=len(calls), ops_per_call=per, span_us=round(span, 2),
                kernel_sum_us=round(k_sum, 2), span_us_per_op=round(span / per, 2),
                kernel_sum_us_per_op=round(k_sum / per, 2), kernels=kernels)


def report(r):
    print(f"\n{r['op']} [{r['backend']}] span {r['span_us']} µs, kernels {r['kernel_sum_us']} µs over "
          f"{len(r['kernels'])} kernels ({r['calls']} calls); per op ({r['ops_per_call']} per call): span "
          f"{r['span_us_per_op']} µs, kernels {r['kernel_sum_us_per_op']} µs", flush=True)
    for k in r["kernels"]:
        print(f"  {k['dur_us']:8.2f} µs  (gap {k['gap_before_us']:5.2f})  {k['kernel']}", flush=True)


def main(argv=None):
    global MLA_TUNING
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=None, help=f"default {DEFAULT_OPS} ({SMOKE_OPS} with --smoke)")
    ap.add_argument("--backends", default="pallas,reference")
    ap.add_argument("--n", type=int, default=20, help="traced calls per op")
    ap.add_argument("--mla-tuning", default=None, help="MLADecodeTuning fields, e.g. block_k=128,num_warps=8")
    ap.add_argument("--json", default="profile_ops.json", help="results file name (experiments/results, $OUT)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU: every op runs, nothing is written")
    args = ap.parse_args(argv)
    if args.mla_tuning:
        MLA_TUNING = parse_tuning(MLADecodeTuning(), args.mla_tuning)
    if args.smoke:
        S.update(TOY)
        OPS.update(ops_table(smoke=True))
        args.n = 1
    results = {**run_header(), "ops": []}
    failed = 0
    for name in (args.ops or (SMOKE_OPS if args.smoke else DEFAULT_OPS)).split(","):
        for backend in args.backends.split(","):
            try:
                r = profile(name, backend, args.n)
            except Exception as exc:  # one op's failure must not lose the others' numbers
                print(f"{name} {backend}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                failed += 1
                continue
            if r is None:
                print(f"{name} {backend}: ran, no GPU events in the trace (no GPU, or CUPTI unavailable)", flush=True)
                continue
            results["ops"].append(r)
            report(r)
    write_results(args.json, results, to_repo=not args.smoke)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
