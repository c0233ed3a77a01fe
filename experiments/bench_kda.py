"""KDA kernels on the GPU: compiled correctness checks, then decode / verify / prefill timings vs fla.

Question: how close do the Pallas-Triton KDA kernels get to the HBM floor (decode, verify) and to fla's Triton
kernels (decode: fused_recurrent_kda; prefill: chunk_kda) at the Ling-3.0-flash shape (H = 32, K = V = 128)?

Method (decode/verify: see the comment above bench_decode for exactly what each row includes): one jitted
executable per config = a Python-unrolled chain over 32 layers (x reps), every layer with its own separate state,
window and input buffers (64 MiB of state > 60 MB L2, so states are read cold), states and windows donated and
threaded; `us_per_layer` = median wall time / layer-calls (host-bound for these µs-scale ops: the custom calls
are launched one by one), `kern_us` / `kern_sum_us` = device µs per layer-call by kernel / summed, from the JAX
profiler (the figure RESULTS.md compares). fla's fused_recurrent_kda runs as a CUDA graph over the same 32
distinct layers, timed with CUDA events.
Verify sweeps the RecurrentConfig variants (in-kernel vs XLA prologue, unrolled token loop, BV) at T = 6 for
both commit designs, then runs the default and the best variant per design at the other T.
Prefill: median of N_REP timed calls after warm-up, block_until_ready around each.

Lead's decode/verify command (H200, ~150 s):
  timeout 170 python3 experiments/bench_kda.py --sections check_default,check_quick,decode,verify --budget 140

Usage: python experiments/bench_kda.py [--smoke] [--sections check,check_default,check_quick,decode,verify,prefill]
       [--verify-ts 2,...,9] [--verify-reps 1] [--no-profile] [--budget S]
Writes experiments/results/kda_bench.json (and $OUT/kda_bench.json when OUT is set).
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from pallas_kernels import kda  # noqa: E402
from pallas_kernels.kda import chunk, recurrent  # noqa: E402

HBM_BPS = 4.3e12  # measured device-to-device copy on this workplace's H200s (KINDS.md)
ROWS = []
T_START = time.time()
BUDGET_S = [1e9]
VERIFY_TS = [tuple(range(2, 10))]
JSON_NAME = [None]  # --json: the results file's name (two concurrent runs must not share one)
PREFILL = dict(dtypes=("bfloat16", "float32"), n_configs=3, fla=True)


def over_budget(what):
    if time.time() - T_START > BUDGET_S[0]:
        record("skipped", what, reason=f"over the --budget of {BUDGET_S[0]:.0f}s")
        return True
    return False


def log(*a):
    print(*a, flush=True)


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def record(section, name, **kw):
    ROWS.append(dict(section=section, name=name, **kw))
    log(f"[{section}] {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in kw.items()))


def median_time(fn, *args, n_rep=30, n_warm=3):
    out = None
    for _ in range(n_warm):
        out = fn(*args)
        jax.block_until_ready(out)
    ts = []
    for _ in range(n_rep):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def median_time_donated(fn, state, n_rep=30, n_warm=3):
    """fn(state) -> (new_state, out) with state donated: the state threads through the calls."""
    for _ in range(n_warm):
        state, out = fn(state)
        jax.block_until_ready((state, out))
    ts = []
    for _ in range(n_rep):
        t0 = time.perf_counter()
        state, out = fn(state)
        jax.block_until_ready((state, out))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), state


def inputs(seed, B, T, H, K, dtype=jnp.float32, gate="strong"):
    from test_kda import layer_inputs
    return layer_inputs(seed, B, T, H, K, dtype, gate)


# --- correctness, compiled --------------------------------------------------------------------------------

def check(H, K, smoke):
    ok = True

    def verdict(name, err, tol):
        nonlocal ok
        passed = err <= tol
        ok &= passed
        record("check", name, rel_err=err, tol=tol, passed=passed)

    for cfg in [recurrent.RecurrentConfig(BV=32), recurrent.RecurrentConfig(BV=64),
                recurrent.RecurrentConfig(BV=128, num_warps=8)]:
        args = inputs(1, 1, 1, H, K)
        y, w, S = recurrent.decode(*args, cfg=cfg)
        yr, wr, Sr = kda.kda_decode(*args)
        verdict(f"decode f32 BV{cfg.BV} y", rel_err(y, yr), 1e-5)
        verdict(f"decode f32 BV{cfg.BV} state", rel_err(S, Sr), 1e-5)
        verdict(f"decode f32 BV{cfg.BV} window", rel_err(w, wr), 0.0)
    args = inputs(2, 1, 1, H, K, jnp.bfloat16)
    verdict("decode bf16 y", rel_err(kda.kda_decode(*args, backend="pallas")[0], kda.kda_decode(*args)[0]), 2e-2)

    for T in (2, 6, 9):
        args = inputs(3, 2, T + 1, H, K)
        cur = [a[:, :T] for a in args[:4]]
        nxt = [a[:, T:] for a in args[:4]]
        rest = args[4:]
        y_a, st_a = kda.kda_verify(*cur, *rest, backend="pallas")
        y_b, st_b = kda.kda_verify(*cur, *rest, backend="pallas", store="inputs")
        y_r, st_r = kda.kda_verify(*cur, *rest)
        verdict(f"verify T{T} y vs ref", rel_err(y_a, y_r), 1e-5)
        verdict(f"verify T{T} states vs ref", rel_err(st_a.states, st_r.states), 1e-5)
        n = jnp.array([1, T], jnp.int32)
        wa, Sa = kda.kda_commit(st_a, n)
        wb, Sb = kda.kda_commit(st_b, n)
        verdict(f"verify T{T} commit A==B state (bitwise)", float(np.abs(np.asarray(Sa) - np.asarray(Sb)).max()), 0.0)
        ya = kda.kda_decode(*nxt, wa, Sa, *args[6:], backend="pallas")[0]
        yb = kda.kda_decode(*nxt, wb, Sb, *args[6:], backend="pallas")[0]
        verdict(f"verify T{T} next-step y A==B (bitwise)", float(np.abs(np.asarray(ya) - np.asarray(yb)).max()), 0.0)

    import torch
    from test_kda import torch_layer
    for T in (1, 7, 64, 100, 300):
        for dtype in (jnp.float32, jnp.bfloat16):
            args = inputs(4 + T, 1, T, H, K, dtype)
            y, w, S = kda.kda_prefill(*args, backend="pallas")
            yr, wr, Sr = kda.kda_prefill(*args)
            yt, _, St = torch_layer(*args)
            tol = 1e-4 if dtype == jnp.float32 else 2e-2
            dn = jnp.dtype(dtype).name
            verdict(f"prefill {dn} T{T} y vs ref", rel_err(y, yr), tol)
            verdict(f"prefill {dn} T{T} state vs ref", rel_err(S, Sr), tol)
            verdict(f"prefill {dn} T{T} y vs fla naive_recurrent", rel_err(y, yt), tol)
            verdict(f"prefill {dn} T{T} state vs fla naive_recurrent", rel_err(S, St), tol)
            if T % 64 == 0:
                yc, _, Sc = torch_layer(*args, core="chunk")
                verdict(f"prefill {dn} T{T} y vs fla naive_chunk", rel_err(y, yc), tol)
                verdict(f"prefill {dn} T{T} state vs fla naive_chunk", rel_err(S, Sc), tol)
    del torch
    return ok


def check_default(H, K):
    """Compiled decode and verify/commit at the default configs (no torch, decode-sized references only)."""
    ok = True

    def verdict(name, err, tol):
        nonlocal ok
        ok &= err <= tol
        record("check", name, rel_err=err, tol=tol, passed=err <= tol)

    args = inputs(11, 1, 1, H, K)
    y, w, S = kda.kda_decode(*args, backend="pallas")
    yr, wr, Sr = kda.kda_decode(*args)
    cfg = recurrent.DEFAULT_DECODE
    verdict(f"decode f32 default BV{cfg.BV} w{cfg.num_warps} y", rel_err(y, yr), 1e-5)
    verdict(f"decode f32 default BV{cfg.BV} w{cfg.num_warps} state", rel_err(S, Sr), 1e-5)
    T = 6
    args = inputs(12, 2, T + 1, H, K)
    cur = [a[:, :T] for a in args[:4]]
    nxt = [a[:, T:] for a in args[:4]]
    y_a, st_a = kda.kda_verify(*cur, *args[4:], backend="pallas")
    y_b, st_b = kda.kda_verify(*cur, *args[4:], backend="pallas", store="inputs")
    y_r, st_r = kda.kda_verify(*cur, *args[4:])
    cfg = recurrent.DEFAULT_VERIFY
    verdict(f"verify T6 default BV{cfg.BV} w{cfg.num_warps} y vs ref", rel_err(y_a, y_r), 1e-5)
    verdict("verify T6 states vs ref", rel_err(st_a.states, st_r.states), 1e-5)
    n = jnp.array([2, T], jnp.int32)
    wa, Sa = kda.kda_commit(st_a, n)
    wb, Sb = kda.kda_commit(st_b, n)
    verdict("verify T6 commit A==B state (bitwise)", float(np.abs(np.asarray(Sa) - np.asarray(Sb)).max()), 0.0)
    ya = kda.kda_decode(*nxt, wa, Sa, *args[6:], backend="pallas")[0]
    yb = kda.kda_decode(*nxt, wb, Sb, *args[6:], backend="pallas")[0]
    verdict("verify T6 next-step y A==B (bitwise)", float(np.abs(np.asarray(ya) - np.asarray(yb)).max()), 0.0)
    check_variants(H, K, verdict)
    return ok


def check_variants(H, K, verdict):
    """Compiled decode (every swept config) and verify (every swept variant, T = 7) vs the reference;
    commit A == B bitwise with the variant's own replay tiling."""
    args = inputs(13, 1, 1, H, K)
    yr, _, Sr = kda.kda_decode(*args)
    for BV, nw, ns in DECODE_CONFIGS:
        try:
            y, _, S = recurrent.decode(*args, cfg=recurrent.RecurrentConfig(BV=BV, num_warps=nw, num_stages=ns))
        except Exception as e:  # one config failing to compile must not lose the others
            record("check", f"decode BV{BV} w{nw} s{ns}", error=repr(e)[:300])
            verdict(f"decode BV{BV} w{nw} s{ns} compiles", float("inf"), 0.0)
            continue
        verdict(f"decode f32 BV{BV} w{nw} s{ns} y", rel_err(y, yr), 1e-5)
        verdict(f"decode f32 BV{BV} w{nw} s{ns} state", rel_err(S, Sr), 1e-5)
    for T in (7,):
        args = inputs(14 + T, 2, T, H, K)
        y_r, st_r = kda.kda_verify(*args)
        n = jnp.array([2, T], jnp.int32)
        for label, cfg in VERIFY_VARIANTS[1:]:
            try:
                y_a, st_a = recurrent.verify(*args, store="states", cfg=cfg)
                y_b, st_b = recurrent.verify(*args, store="inputs", cfg=cfg)
                Sa, Sb = _commit(st_a, n, cfg)[1], _commit(st_b, n, cfg)[1]
            except Exception as e:
                record("check", f"verify {label}", error=repr(e)[:300])
                verdict(f"verify {label} compiles", float("inf"), 0.0)
                continue
            verdict(f"verify T{T} {label} y vs ref", rel_err(y_a, y_r), 1e-5)
            verdict(f"verify T{T} {label} states vs ref", rel_err(st_a.states, st_r.states), 1e-5)
            verdict(f"verify T{T} {label} y A==B (bitwise)", float(jnp.abs(y_a - y_b).max()), 0.0)
            verdict(f"verify T{T} {label} commit A==B (bitwise)", float(jnp.abs(Sa - Sb).max()), 0.0)
            verdict(f"verify T{T} {label} conv_rows", float(jnp.abs(st_a.conv_rows.astype(jnp.float32)
                                                                    - st_r.conv_rows.astype(jnp.float32)).max()), 0.0)


def check_quick(H, K):
    """Compiled prefill vs the reference only (no torch): for re-checking a changed kernel cheaply."""
    ok = True
    for T, dtype in ((7, jnp.float32), (100, jnp.float32), (300, jnp.float32), (300, jnp.bfloat16)):
        args = inputs(40 + T, 1, T, H, K, dtype)
        y, w, S = kda.kda_prefill(*args, backend="pallas")
        yr, wr, Sr = kda.kda_prefill(*args)
        ys, ws, Ss = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=32, split_o=True))
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        win_ok = bool((w == wr).all()) and bool((ws == wr).all())
        ok &= win_ok
        record("check", f"prefill {jnp.dtype(dtype).name} T{T} conv window == ref", passed=win_ok)
        for name, a, b in (("y", y, yr), ("state", S, Sr), ("split_o BV32 y", ys, yr),
                           ("split_o BV32 state", Ss, Sr)):
            err = rel_err(a, b)
            ok &= err <= tol
            record("check", f"prefill {jnp.dtype(dtype).name} T{T} {name} vs ref", rel_err=err, tol=tol,
                   passed=err <= tol)
    return ok


# --- decode ---------------------------------------------------------------------------------------------
#
# What a decode/verify row includes (µs per layer-call):
#   * pallas rows: one jitted executable = `reps` passes over L = 32 layers, Python-unrolled, each layer with its
#     own inputs, conv window and 2 MiB state as SEPARATE buffers (64 MiB of state > 60 MB L2: read cold), the
#     states and windows donated and threaded layer-call to layer-call (no stacked array, no dynamic slicing).
#     Each layer-call is the whole op between the projections and o_proj: the recurrent kernel plus (BV < V) the
#     gated-RMSNorm XLA fusion; verify rows also the conv_rows concatenate (and the XLA prologue fusion for
#     prologue="xla"), "+commit" rows also the commit (A: dynamic-index copy of the selected 2 MiB state and
#     window slice; B: the kda_replay launch and window slice).
#     `us_per_layer` (the headline, and what "best" picks by) = median wall time of the executable (after
#     warm-up, block_until_ready) / layer-calls: it includes the executable's launch overhead amortised over the
#     calls and any gaps between kernels. From a JAX profiler trace of 5 more runs: `kern_us` = device µs per
#     layer-call of each kernel (median, by kernel name; a MemcpyD2D there is a harness or aliasing copy),
#     `kern_sum_us` = their sum (device-busy time, a lower bound), `prof_span_us` = first kernel start to last
#     kernel end / layer-calls under the profiler (XLA turns command buffers off while profiling unless
#     --xla_enable_command_buffers_during_profiling, so this span includes host launch gaps).
#   * fla rows: fused_recurrent_kda_fwd (L2 norm, gate and beta in kernel; no conv, no gated norm) captured in a
#     CUDA graph over the same 32 distinct layers x reps (separate q/k/v/g/beta/state tensors per layer),
#     states updated in place, timed with CUDA events; once through the default API (which memsets a fresh
#     output with zeros_like every call) and once with `out=` preallocated per layer (kernel only).

def layer_stack(L, B, T, H, K, dtype):
    """L independent layers of inputs, plus their states (2 MiB each at H=32, K=V=128), as separate buffers."""
    per = [inputs(100 + l, B, T, H, K, dtype) for l in range(L)]
    xs = tuple(p[:4] for p in per)                      # qkv, f, b, z
    windows = tuple(p[4] for p in per)
    states = tuple(p[5] for p in per)
    params = per[0][6:]                                 # conv_w, A_log, dt_bias, o_norm_w (shared)
    return xs, windows, states, params


def decode_bytes(B, H, K, dtype):
    it = jnp.dtype(dtype).itemsize
    state = 2 * B * H * K * K * 4
    ins = B * H * K * it * (3 + 1 + 1) + B * H * it          # qkv, f, z rows, b
    window = 2 * B * 3 * 3 * H * K * it                     # read old, write new
    out = B * H * K * it
    params = (4 * 3 * H * K + H + H * K + K) * 4
    return state + ins + window + out + params


PROFILE = [True]


def device_profile(fn, carry, calls, n=5):
    """(median device span / calls, {kernel: median device µs per call}, carry) from a JAX profiler trace of n
    runs of fn(carry) -> (carry, out). None on failure (no CUPTI)."""
    if not PROFILE[0]:
        return None, None, carry
    import collections
    import tempfile
    from ling_jax.profiling import gpu_events
    try:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(n):
                    carry, out = fn(carry)
                    jax.block_until_ready((carry, out))
                    time.sleep(0.002)  # a clear gap between executables
            ev = gpu_events(d)
    except Exception as e:
        log(f"profiler failed: {e!r:.200}")
        return None, None, carry
    runs, cur = [], [ev[0]] if ev else []
    for prev, e in zip(ev, ev[1:]):
        if e[1] - (prev[1] + prev[2]) > 1000:
            runs.append(cur)
            cur = [e]
        else:
            cur.append(e)
    if cur:
        runs.append(cur)
    runs = runs[-n:]
    if not runs:
        return None, None, carry
    span = statistics.median(r[-1][1] + r[-1][2] - r[0][1] for r in runs) / calls
    per = collections.defaultdict(list)
    for r in runs:
        tot = collections.Counter()
        for name, _, dur in r:
            tot[name[:40]] += dur
        for k_, v in tot.items():
            per[k_].append(v / calls)
    kern = {k_: round(statistics.median(v), 3) for k_, v in per.items()}
    return span, kern, carry


def time_chain(fn, carry, calls, n_rep):
    """Wall and device µs per layer-call of fn(carry) -> (carry, out), carry donated."""
    t, carry = median_time_donated(fn, carry, n_rep=n_rep)
    span, kern, carry = device_profile(fn, carry, calls)
    res = dict(us_per_layer=t / calls * 1e6)
    if span is not None:
        res.update(kern_sum_us=round(sum(kern.values()), 3), prof_span_us=round(span, 3), kern_us=kern)
    return res, carry


DECODE_CONFIGS = [(16, 2, 1), (8, 1, 1), (8, 2, 1), (16, 1, 1), (32, 4, 1), (8, 1, 2), (128, 8, 1)]


def bench_decode(H, K, L, reps, n_rep, smoke):
    B, dtype = 1, jnp.bfloat16
    xs, windows, states, params = layer_stack(L, B, 1, H, K, dtype)
    floor_us = decode_bytes(B, H, K, dtype) / HBM_BPS * 1e6
    record("decode", "byte floor per layer", bytes=decode_bytes(B, H, K, dtype), us=floor_us)
    configs = DECODE_CONFIGS[:2] if smoke else DECODE_CONFIGS
    best = None
    for BV, nw, ns in configs:
        if over_budget(f"decode BV{BV} w{nw} s{ns}"):
            continue
        cfg = recurrent.RecurrentConfig(BV=BV, num_warps=nw, num_stages=ns)

        def step(carry, xs):
            windows, states = list(carry[0]), list(carry[1])
            ys = []
            for _ in range(reps):
                for l in range(L):
                    y, windows[l], states[l] = recurrent.decode(*xs[l], windows[l], states[l], *params, cfg=cfg)
                    ys.append(y)
            return (tuple(windows), tuple(states)), ys

        fn = jax.jit(step, donate_argnums=0)
        try:
            res, (windows, states) = time_chain(lambda c: fn(c, xs), (windows, states), L * reps, n_rep)
        except Exception as e:  # a config Triton cannot compile: report and go on
            record("decode", f"pallas BV{BV} w{nw} s{ns}", error=repr(e)[:300])
            _, windows, states, _ = layer_stack(L, B, 1, H, K, dtype)
            continue
        us = res["us_per_layer"]
        record("decode", f"pallas BV{BV} warps{nw} stages{ns}", **res, pct_of_floor=100 * floor_us / us)
        if best is None or us < best[0]:
            best = (us, BV, nw, ns)
    if best:
        record("decode", "best pallas", us_per_layer=best[0], BV=best[1], warps=best[2],
               stages=best[3])

    try:
        import torch
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        dev = "cuda"
        tdt = torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)
        mk = lambda *s: torch.randn(*s, device=dev, generator=g)
        lay = [dict(q=mk(B, 1, H, K).to(tdt), k=mk(B, 1, H, K).to(tdt), v=mk(B, 1, H, K).to(tdt),
                    g=mk(B, 1, H, K).to(tdt), beta=mk(B, 1, H).to(tdt), h=mk(B, H, K, K) * 0.5) for _ in range(L)]
        A_log = torch.rand(H, device=dev) + 1.5
        dt_bias = torch.rand(H * K, device=dev) + 2.0

        for d in lay:
            d["o"] = torch.zeros_like(d["v"])
        for prealloc in (False, True):
            def run():
                for d in lay:
                    # prealloc: the output buffer is passed in (`out=`), skipping fla's zeros_like memset.
                    fused_recurrent_kda_fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=A_log,
                                            dt_bias=dt_bias, initial_state=d["h"], output_final_state=True,
                                            inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                            lower_bound=-5.0, **(dict(out=d["o"]) if prealloc else {}))
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    run()
            graph.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(n_rep):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
            us = statistics.median(ts) / (L * reps) * 1e6
            what = "out= preallocated, no memset" if prealloc else "default API: zeros_like(out) memset"
            record("decode", f"fla fused_recurrent_kda (core only, CUDA graph, events; {what})", us_per_layer=us,
                   pct_of_floor=100 * floor_us / us)
            del graph
        lay = None
        torch.cuda.empty_cache()
    except Exception as e:
        record("decode", "fla fused_recurrent_kda", error=repr(e)[:300])
    return best


# --- verify -----------------------------------------------------------------------------------------------

RC = recurrent.RecurrentConfig
# (label, cfg): the default first; the variants are swept at T = 6, then the best per store runs at every other
# T (and the default too at T = 2 and 9). Verify executables pass over the 32 layers once (--verify-reps).
VERIFY_VARIANTS = [
    ("default", recurrent.DEFAULT_VERIFY),
    ("kernel unroll", RC(BV=16, num_warps=2, unroll=True)),
    ("hoist BV16 w2", RC(BV=16, num_warps=2, prologue="hoist")),
    ("hoist BV8 w1", RC(BV=8, num_warps=1, prologue="hoist")),
    ("vec BV16 w2", RC(BV=16, num_warps=2, prologue="vec")),
    ("vec BV8 w1", RC(BV=8, num_warps=1, prologue="vec")),
    ("xla BV16 w2 unroll", RC(BV=16, num_warps=2, prologue="xla", unroll=True)),
    ("xla BV8 w1 unroll", RC(BV=8, num_warps=1, prologue="xla", unroll=True)),
]


def _commit(staged, n, cfg):
    """kda_commit, with design B's replay at the verify's own tiling (the sweep's configs, not the default)."""
    if staged.states is not None:
        return kda.kda_commit(staged, n)
    B, R = staged.conv_rows.shape[:2]
    nb = jnp.broadcast_to(n, (B,))
    Wm1 = R - staged.k.shape[1]
    window = jax.vmap(lambda rows, i: jax.lax.dynamic_slice_in_dim(rows, i, Wm1, axis=0))(staged.conv_rows, nb)
    return window, recurrent.replay(staged.state0, staged.k, staged.v, staged.g, staged.beta, n, cfg=cfg)


def verify_row(T, store, label, cfg, L, reps, n_rep, decode_best, with_commit=True):
    B, H, K, dtype = 1, VERIFY_SHAPE[0], VERIFY_SHAPE[1], jnp.bfloat16
    xs, windows, states, params = layer_stack(L, B, T, H, K, dtype)
    n = jnp.int32(max(1, T // 2))

    def step(carry, xs):
        windows, states = list(carry[0]), list(carry[1])
        outs = []
        for _ in range(reps):
            for l in range(L):
                y, st = recurrent.verify(*xs[l], windows[l], states[l], *params, store=store, cfg=cfg)
                if with_commit:
                    windows[l], states[l] = _commit(st, n, cfg)
                    outs.append(y)
                else:
                    outs.append((y, st))
        return (tuple(windows), tuple(states)), outs

    fn = jax.jit(step, donate_argnums=0 if with_commit else ())
    design = "A" if store == "states" else "B"
    name = f"T{T} {design} {label} " + ("verify+commit" if with_commit else "verify only")
    try:
        res, _ = time_chain(lambda c: fn(c, xs), (windows, states), L * reps, n_rep)
    except Exception as e:
        record("verify", name, error=repr(e)[:300])
        return None
    us = res["us_per_layer"]
    record("verify", name, **res, x_decode=us / decode_best if decode_best else float("nan"))
    return us


VERIFY_SHAPE = [32, 128]
VERIFY_STORES = [["states", "inputs"], ["states", "inputs"]]  # swept at T0; run at the other T
EXTRA_DEFAULT_TS = (2, 9)  # the other T at which the default also runs, as the baseline


def bench_verify(H, K, L, reps, n_rep, smoke, decode_best):
    VERIFY_SHAPE[:] = [H, K]
    Ts = (2, 6) if smoke else VERIFY_TS[0]
    variants = VERIFY_VARIANTS[:1] + VERIFY_VARIANTS[4:6] if smoke else VERIFY_VARIANTS
    best = {}
    T0 = 6 if 6 in Ts else Ts[0]
    for store in VERIFY_STORES[0]:
        for label, cfg in variants:
            if over_budget(f"verify T{T0} {store} {label}"):
                continue
            us = verify_row(T0, store, label, cfg, L, reps, n_rep, decode_best)
            if us is not None and (store not in best or us < best[store][0]):
                best[store] = (us, label, cfg)
        if store in best and not over_budget(f"verify T{T0} {store} verify only"):
            verify_row(T0, store, best[store][1], best[store][2], L, reps, n_rep, decode_best, with_commit=False)
    for store, (us, label, _) in best.items():
        record("verify", f"best at T{T0} store={store}", us_per_layer=us, variant=label)
    for T in Ts:
        if T == T0:
            continue
        for store in VERIFY_STORES[1]:
            runs = [best[store][1:]] if store in best else [VERIFY_VARIANTS[0]]
            if T in EXTRA_DEFAULT_TS and runs[0][0] != "default":
                runs.append(VERIFY_VARIANTS[0])
            for label, cfg in runs:
                if over_budget(f"verify T{T} {store} {label}"):
                    continue
                verify_row(T, store, label, cfg, L, reps, n_rep, decode_best)


# --- prefill ----------------------------------------------------------------------------------------------

def bench_prefill(H, K, T, n_rep, smoke):
    """Whole layer (conv + kernels + norm) per config; the first n_configs of the list run, fla's chunk_kda
    right after config 0 (the default: the Pallas conv pass) so that the key comparison lands first. Config 1
    (the XLA conv pass) also times the XLA conv alone and the conv-free core; config 2 fuses the conv into the
    intra kernel. Every config's output is compared with config 0's. Later configs sweep BV, warps, split_o."""
    B = 1
    for dtype in (jnp.dtype(d) for d in PREFILL["dtypes"]):
        args = inputs(7, B, T, H, K, dtype)
        dn = jnp.dtype(dtype).name
        # BV < 64 gives the h kernel (grid B × H × V/BV, chunks in sequence) more than 64 programs for the
        # H200's 132 SMs; split_o takes the output dots off that serial chain.
        CC = chunk.ChunkConfig
        configs = [CC(BV=64), CC(BV=64, conv="xla"), CC(BV=64, conv="fused"), CC(BV=64, num_warps_intra=8),
                   CC(BV=32, split_o=True), CC(BV=16, split_o=True), CC(BV=32), CC(BV=16)]
        configs = configs[:PREFILL["n_configs"]]
        if dtype == jnp.float32:
            configs = configs[:2]
        out0 = None
        for i_cfg, cfg in enumerate(configs):
            if i_cfg == 1 and not smoke and PREFILL["fla"]:
                bench_fla_prefill(B, T, H, K, dtype, n_rep)
            if over_budget(f"prefill {dn} {cfg}"):
                continue
            fn = jax.jit(lambda *a, cfg=cfg: chunk.prefill(*a, cfg=cfg))
            try:
                t, out = median_time(fn, *args, n_rep=n_rep)
            except Exception as e:
                record("prefill", f"pallas {dn} {cfg}", error=repr(e)[:300])
                continue
            if out0 is None:
                out0 = out
            else:
                record("prefill", f"pallas {dn} T{T} {cfg} vs config 0", y_rel_err=rel_err(out[0], out0[0]),
                       state_rel_err=rel_err(out[2], out0[2]), window_equal=bool((out[1] == out0[1]).all()))
            record("prefill", f"pallas {dn} T{T} conv={cfg.conv} split_o={int(cfg.split_o)} BV{cfg.BV} "
                   f"wi{cfg.num_warps_intra} wh{cfg.num_warps_h} (whole layer)", ms=t * 1e3)
            if cfg.conv == "xla" and not over_budget(f"prefill {dn} core"):
                bench_prefill_core(args, cfg, dn, T, n_rep)
        if len(configs) == 1 and not smoke and PREFILL["fla"]:
            bench_fla_prefill(B, T, H, K, dtype, n_rep)


def bench_prefill_core(args, cfg, dn, T, n_rep):
    """The XLA conv alone, and the conv-free core (both kernels + gated norm on a precomputed conv output):
    the closest match to what fla's chunk_kda does (it has no conv and no norm)."""
    from pallas_kernels.kda import reference
    qkv, f, b, z, win, state, conv_w, A_log, dt_bias, o_norm_w = args
    conv = jax.jit(lambda qkv, win, cw: reference.short_conv(qkv, win, cw))
    t, (y_conv, _) = median_time(conv, qkv, win, conv_w, n_rep=n_rep)
    record("prefill", f"pallas {dn} T{T} XLA conv+SiLU alone", ms=t * 1e3)
    core = jax.jit(lambda *a: chunk.core(*a, cfg=cfg))
    t, _ = median_time(core, y_conv, f, b, z, state, A_log, dt_bias, o_norm_w, n_rep=n_rep)
    record("prefill", f"pallas {dn} T{T} core BV{cfg.BV} (kernels + gated norm, no conv)", ms=t * 1e3)


def bench_fla_prefill(B, T, H, K, dtype, n_rep):
    """fla's chunk_kda (autotunes on its first call: budget ~100 s for it)."""
    dn = jnp.dtype(dtype).name
    try:
        import torch
        from fla.ops.kda import chunk_kda
        tdt = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
        dev = "cuda"
        gen = torch.Generator(device=dev).manual_seed(0)
        mk = lambda *s: torch.randn(*s, device=dev, generator=gen)
        q, k, v, f = (mk(B, T, H, K).to(tdt) for _ in range(4))
        beta = mk(B, T, H).to(tdt)
        h0 = mk(B, H, K, K) * 0.5
        A_log = torch.rand(H, device=dev) + 1.5
        dt_bias = torch.rand(H * K, device=dev) + 2.0

        def run():
            return chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                             A_log=A_log, dt_bias=dt_bias)
        with torch.inference_mode():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            ts = []
            for _ in range(n_rep):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1))
        record("prefill", f"fla chunk_kda {dn} T{T} (core: l2norm+gate in kernel, no conv/norm)",
               ms=statistics.median(ts))
    except Exception as e:
        record("prefill", f"fla chunk_kda {dn}", error=repr(e)[:300])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU in interpret mode)")
    p.add_argument("--sections", default="check,decode,verify,prefill")
    p.add_argument("--verify-ts", default="2,3,4,5,6,7,8,9")
    p.add_argument("--decode-us", type=float, default=None, help="decode µs/layer for the verify ratio when "
                   "the decode section is not run")
    p.add_argument("--prefill-dtypes", default="bfloat16,float32")
    p.add_argument("--prefill-configs", type=int, default=3)
    p.add_argument("--no-fla", action="store_true", help="skip fla's chunk_kda (its autotuning takes ~100 s)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler's device times")
    p.add_argument("--json", default=None, help="results file name (default kda_bench.json)")
    p.add_argument("--decode-configs", default=None, help='subset of the decode sweep, "BV,warps,stages;..."')
    p.add_argument("--verify-variants", default=None, help="subset of VERIFY_VARIANTS labels, comma-separated")
    p.add_argument("--verify-stores", default="states,inputs", help="designs swept at T=6 (states = A, inputs = B)")
    p.add_argument("--verify-other-stores", default="states,inputs",
                   help="designs run (best variant) at the other T")
    p.add_argument("--verify-reps", type=int, default=1, help="passes over the L layers per verify executable")
    p.add_argument("--budget", type=float, default=1e9, help="seconds after which remaining configs are skipped")
    a = p.parse_args()
    BUDGET_S[0] = a.budget
    JSON_NAME[0] = a.json
    PROFILE[0] = not a.no_profile
    VERIFY_TS[0] = tuple(int(t) for t in a.verify_ts.split(","))
    if a.decode_configs:
        DECODE_CONFIGS[:] = [tuple(int(v) for v in c.split(",")) for c in a.decode_configs.split(";")]
    if a.verify_variants:
        wanted = a.verify_variants.split(",")
        unknown = set(wanted) - {label for label, _ in VERIFY_VARIANTS}
        if unknown:
            p.error(f"--verify-variants: unknown {sorted(unknown)}; known: {[lb for lb, _ in VERIFY_VARIANTS]}")
        VERIFY_VARIANTS[:] = [v for v in VERIFY_VARIANTS if v[0] in wanted]
    VERIFY_STORES[:] = [a.verify_stores.split(","), a.verify_other_stores.split(",")]
    PREFILL.update(dtypes=tuple(a.prefill_dtypes.split(",")), n_configs=a.prefill_configs, fla=not a.no_fla)
    sections = a.sections.split(",")
    if a.smoke:
        H, K, L, reps, n_rep, T_pf = 2, 32, 2, 1, 2, 130
    else:
        H, K, L, reps, n_rep, T_pf = 32, 128, 32, 2, 30, 8192
    meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__, backend=jax.default_backend(),
                device=str(jax.devices()[0].device_kind), H=H, K=K, L_cold=L, argv=sys.argv)
    log(meta)
    t0 = time.time()
    ok = None
    if "check" in sections:
        ok = check(H, K, a.smoke)
        dump(meta, ok)
        log(f"checks {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    if "check_default" in sections:
        ok = check_default(H, K)
        dump(meta, ok)
        log(f"default-config checks {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    if "check_quick" in sections:
        ok = check_quick(H, K)
        dump(meta, ok)
        log(f"quick checks {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    best = None
    if "decode" in sections:
        best = bench_decode(H, K, L, reps, n_rep, a.smoke)
        dump(meta, ok)
        log(f"decode done ({time.time() - t0:.0f}s)")
    if "verify" in sections:
        bench_verify(H, K, L, 1 if a.smoke else a.verify_reps, max(5, n_rep // 2), a.smoke,
                     best[0] if best else a.decode_us)
        dump(meta, ok)
        log(f"verify done ({time.time() - t0:.0f}s)")
    if "prefill" in sections:
        bench_prefill(H, K, T_pf, 10 if not a.smoke else 1, a.smoke)
        dump(meta, ok)
        log(f"prefill done ({time.time() - t0:.0f}s)")
    dump(meta, ok)
    log("\n| section | name | numbers |\n|---|---|---|")
    for r in ROWS:
        if r["section"] == "check" and r.get("passed"):
            continue
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        log(f"| {r['section']} | {r['name']} | {nums} |")
    log(f"checks passed: {ok}; total {time.time() - t0:.0f}s")


def dump(meta, ok):
    res = dict(meta=meta, checks_passed=ok, rows=ROWS)
    name = "kda_bench_smoke.json" if meta["H"] < 32 else (JSON_NAME[0] or "kda_bench.json")
    for d in [os.path.join(ROOT, "experiments", "results") if name != "kda_bench_smoke.json" else None,
              os.environ.get("OUT")]:
        if d:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, name), "w") as fh:
                json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
