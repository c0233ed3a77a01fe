"""Where does the time of one decode-path op go, kernel by kernel? (device-side durations from the JAX profiler)

Runs each op at Ling-3.0-flash shape (batch 1) N times inside `jax.profiler.trace`, then reads the Perfetto
trace and prints, per op, every GPU kernel's median duration and the median gap between consecutive kernels.
This is the tool behind the "where the µs go" notes in RESULTS.md; the benches' end-to-end numbers remain the
headline. Inputs are hot here (the same weights every call), so kernel durations are a lower bound for the
memory-bound ops; latency-bound ones (KDA decode, router, MLA at short L) are what this is for.

Run on the GPU: `PYTHONPATH=. python3 experiments/profile_ops.py [--ops kda_decode,moe,mla] [--n 20]`.
KDA chunked prefill at T = 8192 (not in the default list): `--ops kda_prefill8k,kda_prefill8k_split,
kda_prefill8k_pconv --backends pallas --n 10` (pconv: the default config with conv="pallas").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import run_header, write_results  # noqa: E402

from ling_jax.profiling import call_span_us, split_calls, trace_kernels  # noqa: E402

from pallas_kernels import kda, mla, moe  # noqa: E402

H, K, W = 32, 128, 4
D, E, I = 2560, 512, 768
R, P = 512, 64


def kda_op(backend, T, split_o=None, conv="xla"):
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    a = lambda shape, s=1.0, dt=bf: jnp.asarray(rng.standard_normal(shape) * s, dt)  # noqa: E731
    args = (a((1, T, 3, H, K)), a((1, T, H, K)), a((1, T, H)), a((1, T, H, K)), a((1, W - 1, 3, H, K)),
            a((1, H, K, K), 0.1, jnp.float32), a((W, 3, H, K), 0.5, jnp.float32), a((H,), 0.5, jnp.float32),
            a((H, K), 0.5, jnp.float32), a((K,), 1.0))
    if split_o is not None:  # prefill; the chunk config is only chosen for the pallas backend
        from pallas_kernels.kda import chunk
        cfg = chunk.ChunkConfig(BV=32, split_o=True) if split_o else chunk.DEFAULT
        cfg = dataclasses.replace(cfg, conv=conv)
        fn = jax.jit(lambda *x: chunk.prefill(*x, cfg=cfg) if backend == "pallas"
                     else kda.kda_prefill(*x, backend=backend))
    elif T == 1:
        fn = jax.jit(lambda *x: kda.kda_decode(*x, backend=backend))
    else:
        fn = jax.jit(lambda *x: kda.kda_verify(*x, backend=backend))
    return fn, args


def moe_op(backend, T):
    k = jax.random.split(jax.random.key(0), 8)
    bf = jnp.bfloat16
    lay = dict(  # every expert matrix [out, in] (ling_jax/params.py): gate/up [.., I, D], down [.., D, I]
        we_gate=jax.random.normal(k[0], (E, I, D), bf), we_up=jax.random.normal(k[1], (E, I, D), bf),
        we_down=jax.random.normal(k[2], (E, D, I), bf), ws_gate=jax.random.normal(k[3], (I, D), bf),
        ws_up=jax.random.normal(k[4], (I, D), bf), ws_down=jax.random.normal(k[5], (D, I), bf),
        router=jax.random.normal(k[6], (E, D), jnp.float32) * D ** -0.5,  # [E, D]
        expert_bias=0.01 * jax.random.normal(k[7], (E,), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (T, D), bf)

    def layer(x, lay):
        w, ids = moe.route(x, lay["router"], lay["expert_bias"], n_group=8, topk_group=4, top_k=8,
                           routed_scaling_factor=2.5, backend=backend)
        return moe.moe_experts(x, w, ids, lay["we_gate"], lay["we_up"], lay["we_down"], lay["ws_gate"],
                               lay["ws_up"], lay["ws_down"], limit=4.0, shared_limit=5.0, backend=backend)
    return jax.jit(layer), (x, lay)


MLA_TUNING = None  # --mla-tuning: an MLADecodeTuning for the Pallas MLA ops


MLA_CACHES = 8  # distinct full caches per call: 8 × 37.7 MB at L = 32k > the 60 MB L2, so reads are cold


def mla_op(backend, T, L):
    """MLA_CACHES attention calls per executable, each over its own full cache (start = L - T)."""
    rng = np.random.default_rng(0)
    ql = jnp.asarray(rng.standard_normal((1, T, H, R)) * 0.05, jnp.float32)
    qr = jnp.asarray(rng.standard_normal((1, T, H, P)), jnp.bfloat16)
    caches = [jnp.asarray(rng.standard_normal((1, L, R + P)), jnp.bfloat16) for _ in range(MLA_CACHES)]
    kw = dict(tuning=MLA_TUNING) if backend == "pallas" and MLA_TUNING is not None else {}
    fn = jax.jit(lambda ql, qr, cs: [mla.mla_decode_attention(ql, qr, c, jnp.int32(L - T), scale=192 ** -0.5,
                                                              backend=backend, **kw) for c in cs])
    return fn, (ql, qr, caches)


OPS = {
    "kda_decode": lambda b: kda_op(b, 1),
    "kda_verify6": lambda b: kda_op(b, 6),
    "kda_prefill8k": lambda b: kda_op(b, 8192, split_o=False),  # default ChunkConfig
    "kda_prefill8k_split": lambda b: kda_op(b, 8192, split_o=True),  # split_o, BV 32
    "kda_prefill8k_pconv": lambda b: kda_op(b, 8192, split_o=False, conv="pallas"),  # default but the Pallas conv
    "moe": lambda b: moe_op(b, 1),
    "moe6": lambda b: moe_op(b, 6),
    **{f"mla_{L // 1024}k_t{T}": functools.partial(lambda b, T, L: mla_op(b, T, L), T=T, L=L)
       for L in (1024, 8192, 32768) for T in (1, 6)},
}
OPS_PER_CALL = {name: MLA_CACHES for name in OPS if name.startswith("mla_")}  # op instances per profiled call


def profile(name, backend, n):
    fn, args = OPS[name](backend)
    events = trace_kernels(lambda: fn(*args), n)
    if not events:
        return None
    calls = split_calls(events)
    n_k = len(calls[0])
    kernels = []
    for j in range(n_k):
        durs = [c[j][2] for c in calls]
        gaps = [c[j][1] - (c[j - 1][1] + c[j - 1][2]) for c in calls] if j else [0.0]
        kernels.append(dict(kernel=calls[0][j][0][:90], dur_us=round(statistics.median(durs), 2),
                            gap_before_us=round(statistics.median(gaps), 2)))
    span = call_span_us(calls)
    per = OPS_PER_CALL.get(name, 1)
    return dict(op=name, backend=backend, calls=len(calls), ops_per_call=per, span_us=round(span, 2),
                kernel_sum_us=round(sum(k["dur_us"] for k in kernels), 2), span_us_per_op=round(span / per, 2),
                kernel_sum_us_per_op=round(sum(k["dur_us"] for k in kernels) / per, 2), kernels=kernels)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="kda_decode,kda_verify6,moe,moe6,mla_1k_t1,mla_32k_t1")
    ap.add_argument("--backends", default="pallas,reference")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--mla-tuning", default=None, help="e.g. block_k=128,num_warps=8 (bench_mla.py --tunings syntax)")
    args = ap.parse_args(argv)
    if args.mla_tuning:
        from bench_mla import parse_tunings

        global MLA_TUNING
        MLA_TUNING = parse_tunings(args.mla_tuning)[0]
    results = {**run_header(), "ops": []}
    for name in args.ops.split(","):
        for backend in args.backends.split(","):
            try:
                r = profile(name, backend, args.n)
            except Exception as exc:  # one op's failure must not lose the others' numbers
                print(f"{name} {backend}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            if r is None:
                print(f"{name} {backend}: no GPU events in the trace (CUPTI unavailable?)", flush=True)
                continue
            results["ops"].append(r)
            print(f"\n{name} [{backend}] span {r['span_us']} µs, kernels {r['kernel_sum_us']} µs over "
                  f"{len(r['kernels'])} kernels ({r['calls']} calls); per op ({r['ops_per_call']} per call): span "
                  f"{r['span_us_per_op']} µs, kernels {r['kernel_sum_us_per_op']} µs", flush=True)
            for k in r["kernels"]:
                print(f"  {k['dur_us']:8.2f} µs  (gap {k['gap_before_us']:5.2f})  {k['kernel']}", flush=True)
    write_results("profile_ops.json", results)


if __name__ == "__main__":
    sys.exit(main())
