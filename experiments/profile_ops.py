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
from bench_common import run_header, write_results  # noqa: E402

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


def gpu_events(trace_dir, device=None):
    """(name, ts µs, dur µs) of every event on a GPU stream in the Perfetto trace, in time order; `device`: only
    GPU number `device`'s (a sharded step runs on every GPU at once, so their merged timelines would count each kernel
    once per device)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    want = re.compile(r"/device:GPU" if device is None else rf"/device:GPU:{int(device)}\b")
    gpu_pids = {p for p, n in procs.items() if want.search(n)}
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    return sorted(out, key=lambda e: e[1])


def trace_kernels(run, n):
    """GPU events (as `gpu_events`) of n calls of the zero-argument `run`, after two untraced warm-up calls."""
    jax.block_until_ready(run())
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(n):
                jax.block_until_ready(run())
        return gpu_events(d)


def split_calls(events, gap_us=20.0):
    """The traced kernels grouped by call: calls are separated by host syncs, so the stream is split at gaps
    > gap_us; only the calls with the most common kernel count are kept (a call cut by the trace is dropped).
    No events (no GPU, or CUPTI unavailable): no calls."""
    if not events:
        return []
    calls, cur = [], [events[0]]
    for prev, e in zip(events, events[1:]):
        if e[1] - (prev[1] + prev[2]) < gap_us:
            cur.append(e)
        else:
            calls.append(cur)
            cur = [e]
    calls.append(cur)
    n_k = collections.Counter(len(c) for c in calls).most_common(1)[0][0]
    return [c for c in calls if len(c) == n_k]


def call_span_us(calls, first=None):
    """Median timeline span of the calls: first kernel start to last kernel end (gaps in, overlaps once); `first`:
    start at the first event whose name contains it instead (e.g. a chain's first layer, leaving out a copy of the
    chain's input and the gap before the first layer); a call without such an event is skipped. NaN when no call
    counts."""
    spans = []
    for c in calls:
        starts = [ts for name, ts, _ in c if first is None or first in name]
        if starts:
            spans.append(max(e[1] + e[2] for e in c) - starts[0])
    return statistics.median(spans) if spans else float("nan")


def call_period_us(calls, marker, n_layers):
    """Median over the calls of a chain's steady-state period per layer: the end of the last launch whose name
    contains `marker` minus the end of the first, / (n_layers - 1), where the marker names a kernel launched exactly
    once per layer (a call with another count is skipped, so a marker that also matches a second kernel gives NaN,
    not half the period). It leaves out the chain's start and its whole first layer (there, the first layer's first
    kernel is not admitted early by a predecessor as the others are), so it does not depend on the chain's length;
    NaN when no call qualifies or n_layers < 2."""
    periods = []
    for c in calls:
        ends = sorted(ts + dur for name, ts, dur in c if marker in name)
        if n_layers >= 2 and len(ends) == n_layers:
            periods.append((ends[-1] - ends[0]) / (n_layers - 1))
    return statistics.median(periods) if periods else float("nan")


def call_layer_span_us(calls, first, last, n_layers):
    """Median over the calls and layers of one layer's own span: the end of its `last` launch minus the start of
    its `first` launch (the l-th of each in the call), where both markers name kernels launched exactly once per
    layer (a call with other counts is skipped; NaN when none qualifies). It counts the layer alone, not what runs
    between layers; with a first kernel admitted early by PDL it also counts that kernel's wait."""
    spans = []
    for c in calls:
        starts = sorted(ts for name, ts, dur in c if first in name)
        ends = sorted(ts + dur for name, ts, dur in c if last in name)
        if len(starts) == len(ends) == n_layers:
            spans.extend(e - s for s, e in zip(starts, ends))
    return statistics.median(spans) if spans else float("nan")


def kernel_family(name, width=60):
    """A kernel's name without arguments and XLA's instance numbers: loop_add_fusion_3 -> loop_add_fusion."""
    return re.sub(r"[_.\d]+$", "", name.split("(")[0])[:width]


def exclusive_by_family(events):
    """({family: exclusive µs}, {family: Counter of its predecessors' families}) over time-ordered events. With PDL
    a kernel admitted early counts its entry wait in its duration; its exclusive time is the part past the end of
    every earlier kernel: what it adds to the timeline."""
    excl, after = collections.defaultdict(float), collections.defaultdict(collections.Counter)
    prev, prev_end = None, None
    for name, ts, dur in events:
        key = kernel_family(name)
        start = ts if prev_end is None else max(ts, prev_end)
        excl[key] += max(0.0, ts + dur - start)
        after[key][prev] += 1
        prev, prev_end = key, ts + dur if prev_end is None else max(prev_end, ts + dur)
    return dict(excl), dict(after)


def durations_by_name(events, width=60):
    """{kernel name (first `width` characters): [durations µs]} over the traced events."""
    by_name = collections.defaultdict(list)
    for name, _, dur in events:
        by_name[name[:width]].append(dur)
    return by_name


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
