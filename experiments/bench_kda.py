"""KDA kernels on the GPU: compiled correctness checks, then decode / verify / prefill timings vs fla.

Question: how close do the Pallas-Triton KDA kernels get to the HBM floor (decode, verify) and to fla's Triton
kernels (decode: fused_recurrent_kda; prefill: chunk_kda) at the Ling-3.0-flash shape (H = 32, K = V = 128)?

Method (decode/verify: see the comment above bench_decode for exactly what each row includes): one jitted
executable per config = a Python-unrolled chain over 32 layers (x reps), every layer with its own separate state,
window and input buffers (64 MiB of state > 60 MB L2, so states are read cold), states and windows donated and
threaded; `us_per_layer` = median wall time / layer-calls (host-bound for these µs-scale ops: the custom calls
are launched one by one), `kern_us` / `kern_sum_us` = device µs per layer-call by kernel / summed, from the JAX
profiler (the figure experiments/RESULTS.md compares). fla's fused_recurrent_kda runs as a CUDA graph over the
same 32 distinct layers, timed with CUDA events.
Verify sweeps the RecurrentConfig tilings at T = 6, then runs the default and the best tiling at the other T.
Prefill: median of N_REP timed calls after warm-up, block_until_ready around each.

Decode/verify on the H200 (~150 s):
  PYTHONPATH=. timeout 170 python3 experiments/bench_kda.py --sections check_default,check_quick,decode,verify \
      --budget 140

Usage: python experiments/bench_kda.py [--smoke] [--sections check,check_default,check_quick,decode,verify,prefill]
       [--verify-ts 2,...,9] [--verify-reps 1] [--no-profile] [--budget S]
Writes experiments/results/kda_bench.json (and $OUT/kda_bench.json when OUT is set); `--smoke` (toy sizes, CPU
interpret mode, fla skipped) writes nothing under experiments/results.
"""

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import HBM_BYTES_PER_S, median_time, rel_err, run_header, write_results  # noqa: E402

from ling_jax.profiling import call_span_us, split_calls, trace_events  # noqa: E402
from pallas_kernels import kda  # noqa: E402
from pallas_kernels.kda import chunk, conv, recurrent, reference  # noqa: E402

ROWS = []
T_START = time.time()
BUDGET_S = [1e9]
VERIFY_TS = [tuple(range(2, 10))]
PREFILL = dict(dtypes=("bfloat16", "float32"), n_configs=2, fla=True)
PROFILE = [True]


def over_budget(what):
    if time.time() - T_START > BUDGET_S[0]:
        record("skipped", what, reason=f"over the --budget of {BUDGET_S[0]:.0f}s")
        return True
    return False


def log(*a):
    print(*a, flush=True)


def record(section, name, **kw):
    ROWS.append(dict(section=section, name=name, **kw))
    log(f"[{section}] {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in kw.items()))


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
    return reference.layer_inputs(seed, B, T, H, K, dtype, gate)


def packed(seed, B, T, H, K, dtype=jnp.float32, gate="strong"):
    """inputs as decode and verify take them: the fused projection's packed x [B, T, H, 5K+1], then the rest."""
    args = inputs(seed, B, T, H, K, dtype, gate)
    return (reference.pack(*args[:4]), *args[4:])


class Checks:
    """Records each compiled check (rel_err against its tolerance) and whether all passed."""

    def __init__(self):
        self.ok = True

    def __call__(self, name, err, tol):
        passed = err <= tol
        self.ok &= passed
        record("check", name, rel_err=err, tol=tol, passed=passed)


def bitwise(a, b):
    return float(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)).max())


# --- correctness, compiled --------------------------------------------------------------------------------

def check_verify(verdict, H, K, T, seed, cfg=None, label=""):
    """verify (T positions, B = 2) vs the reference; commit (n = 1 and T) and the next decode step from it."""
    args = packed(seed, 2, T + 1, H, K)
    cur = [args[0][:, :T]]
    nxt = [args[0][:, T:]]
    rest = args[1:]
    if cfg is None:
        y, rows, states = kda.kda_verify(*cur, *rest, backend="pallas")
    else:
        y, rows, states = recurrent.verify(*cur, *rest, cfg=cfg)
    y_r, rows_r, states_r = kda.kda_verify(*cur, *rest)
    name = f"verify T{T} {label}".rstrip()
    verdict(f"{name} y vs ref", rel_err(y, y_r), 1e-5)
    verdict(f"{name} states vs ref", rel_err(states, states_r), 1e-5)
    verdict(f"{name} conv_rows == ref", bitwise(rows, rows_r), 0.0)
    n = jnp.array([1, T], jnp.int32)
    w, S = kda.kda_commit(rows, states, n)
    w_r, S_r = kda.kda_commit(rows_r, states_r, n)
    verdict(f"{name} commit state vs ref", rel_err(S, S_r), 1e-5)
    verdict(f"{name} commit window == ref", bitwise(w, w_r), 0.0)
    y1 = kda.kda_decode(*nxt, w, S, *args[3:], backend="pallas")[0]
    y1_r = kda.kda_decode(*nxt, w_r, S_r, *args[3:])[0]
    verdict(f"{name} next-step y vs ref", rel_err(y1, y1_r), 1e-5)


def check_prefill(verdict, H, K, Ts, seed0, dtypes=(jnp.float32, jnp.bfloat16)):
    """The prefill (default config) vs the reference."""
    for T in Ts:
        for dtype in dtypes:
            args = inputs(seed0 + T, 1, T, H, K, dtype)
            y, w, S = kda.kda_prefill(*args, backend="pallas")
            yr, wr, Sr = kda.kda_prefill(*args)
            tol = 1e-4 if dtype == jnp.float32 else 2e-2
            dn = jnp.dtype(dtype).name
            verdict(f"prefill {dn} T{T} y vs ref", rel_err(y, yr), tol)
            verdict(f"prefill {dn} T{T} state vs ref", rel_err(S, Sr), tol)
            verdict(f"prefill {dn} T{T} window == ref", bitwise(w, wr), 0.0)


def check(H, K, smoke):
    verdict = Checks()
    RC = recurrent.RecurrentConfig
    for cfg in [RC(BV=16), RC(BV=32)] if smoke else [RC(BV=32), RC(BV=64), RC(BV=128, num_warps=8)]:
        args = packed(1, 1, 1, H, K)
        y, w, S = recurrent.decode(*args, cfg=cfg)
        yr, wr, Sr = kda.kda_decode(*args)
        verdict(f"decode f32 BV{cfg.BV} y", rel_err(y, yr), 1e-5)
        verdict(f"decode f32 BV{cfg.BV} state", rel_err(S, Sr), 1e-5)
        verdict(f"decode f32 BV{cfg.BV} window", rel_err(w, wr), 0.0)
    args = packed(2, 1, 1, H, K, jnp.bfloat16)
    verdict("decode bf16 y", rel_err(kda.kda_decode(*args, backend="pallas")[0], kda.kda_decode(*args)[0]), 2e-2)
    for T in (2,) if smoke else (2, 6, 9):
        check_verify(verdict, H, K, T, seed=3)
    if smoke:  # bf16 runs in the prefill section
        check_prefill(verdict, H, K, (20,), seed0=4, dtypes=(jnp.float32,))
    else:
        check_prefill(verdict, H, K, (1, 7, 64, 100, 300), seed0=4)
    return verdict.ok


def check_default(H, K):
    """Compiled decode and verify/commit at the default configs, then every swept decode config and verify
    tiling (decode-sized references only)."""
    verdict = Checks()
    args = packed(11, 1, 1, H, K)
    y, w, S = kda.kda_decode(*args, backend="pallas")
    yr, wr, Sr = kda.kda_decode(*args)
    cfg = recurrent.DEFAULT_DECODE
    verdict(f"decode f32 default BV{cfg.BV} w{cfg.num_warps} y", rel_err(y, yr), 1e-5)
    verdict(f"decode f32 default BV{cfg.BV} w{cfg.num_warps} state", rel_err(S, Sr), 1e-5)
    check_verify(verdict, H, K, 6, seed=12, label="default")
    args = packed(13, 1, 1, H, K)
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
    for label, cfg in VERIFY_CONFIGS[1:]:
        try:
            check_verify(verdict, H, K, 7, seed=21, cfg=cfg, label=label)
        except Exception as e:
            record("check", f"verify {label}", error=repr(e)[:300])
            verdict(f"verify {label} compiles", float("inf"), 0.0)
    return verdict.ok


def check_quick(H, K):
    """Compiled prefill vs the reference only: for re-checking a changed kernel cheaply."""
    verdict = Checks()
    check_prefill(verdict, H, K, (7, 100, 300), seed0=40)
    return verdict.ok


# --- decode ---------------------------------------------------------------------------------------------
#
# What a decode/verify row includes (µs per layer-call):
#   * pallas rows: one jitted executable = `reps` passes over L = 32 layers, Python-unrolled, each layer with its
#     own inputs, conv window and 2 MiB state as SEPARATE buffers (64 MiB of state > 60 MB L2: read cold), the
#     states and windows donated and threaded layer-call to layer-call (no stacked array, no dynamic slicing).
#     Each layer-call is the whole op between the projections and o_proj: the recurrent kernel plus (BV < V) the
#     gated-RMSNorm XLA fusion; "+commit" verify rows also the commit (dynamic-index copy of the selected 2 MiB
#     state and window slice).
#     `us_per_layer` = median wall time of the executable (after
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
    per = [packed(100 + l, B, T, H, K, dtype) for l in range(L)]
    xs = tuple(p[:1] for p in per)                      # the packed projection output x
    windows = tuple(p[1] for p in per)
    states = tuple(p[2] for p in per)
    params = per[0][3:]                                 # conv_w, A_log, dt_bias, o_norm_w (shared)
    return xs, windows, states, params


def decode_bytes(B, H, K, dtype):
    it = jnp.dtype(dtype).itemsize
    state = 2 * B * H * K * K * 4
    ins = B * H * (5 * K + 1) * it                           # the packed q|k|v|f|g|b row
    window = 2 * B * 3 * 3 * H * K * it                     # read old, write new
    out = B * H * K * it
    params = (4 * 3 * H * K + H + H * K + K) * 4
    return state + ins + window + out + params


def device_profile(fn, carry, calls, n=5):
    """(median device span / calls, {kernel: median device µs per call}, carry) from a JAX profiler trace of n
    runs of fn(carry) -> (carry, out). (None, None, carry) without GPU events (CPU, or no CUPTI)."""
    if not PROFILE[0]:
        return None, None, carry
    state = [carry]

    def run():
        state[0], out = fn(state[0])
        return state[0], out

    try:
        ev = trace_events(run, n, pause_s=0.002)  # a clear gap between executables
    except Exception as e:
        log(f"profiler failed: {e!r:.200}")
        return None, None, state[0]
    carry = state[0]
    runs = split_calls(ev, gap_us=1000.0)[-n:]
    if not runs:
        return None, None, carry
    per = collections.defaultdict(list)
    for r in runs:
        tot = collections.Counter()
        for name, _, dur in r:
            tot[name[:40]] += dur
        for k_, v in tot.items():
            per[k_].append(v / calls)
    kern = {k_: round(statistics.median(v), 3) for k_, v in per.items()}
    return call_span_us(runs) / calls, kern, carry


def time_chain(fn, carry, calls, n_rep):
    """Wall and device µs per layer-call of fn(carry) -> (carry, out), carry donated."""
    t, carry = median_time_donated(fn, carry, n_rep=n_rep)
    span, kern, carry = device_profile(fn, carry, calls)
    res = dict(us_per_layer=t / calls * 1e6)
    if span is not None:
        res.update(kern_sum_us=round(sum(kern.values()), 3), prof_span_us=round(span, 3), kern_us=kern)
    return res, carry


DECODE_CONFIGS = [(16, 2, 1), (8, 1, 1), (8, 2, 1), (16, 1, 1), (32, 4, 1), (8, 1, 2), (128, 8, 1)]


def device_us(res):
    """What "best", the floor fraction and × decode compare: the profiled device time per layer-call when there is
    one (the wall time of these latency-bound chains is mostly host launches), else the wall time."""
    return res.get("kern_sum_us") or res["us_per_layer"]


def bench_decode(H, K, L, reps, n_rep, smoke):
    B, dtype = 1, jnp.bfloat16
    xs, windows, states, params = layer_stack(L, B, 1, H, K, dtype)
    floor_us = decode_bytes(B, H, K, dtype) / HBM_BYTES_PER_S * 1e6
    record("decode", "byte floor per layer", bytes=decode_bytes(B, H, K, dtype), us=floor_us)
    configs = DECODE_CONFIGS[:1] if smoke else DECODE_CONFIGS
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
        us = device_us(res)
        record("decode", f"pallas BV{BV} warps{nw} stages{ns}", **res, pct_of_floor=100 * floor_us / us)
        if best is None or us < best[0]:
            best = (us, BV, nw, ns)
    if best:
        record("decode", "best pallas", us=best[0], BV=best[1], warps=best[2],
               stages=best[3])
    if not smoke:  # fla's kernels are Triton: GPU only
        bench_fla_decode(B, H, K, L, reps, n_rep, floor_us)
    return best


def bench_fla_decode(B, H, K, L, reps, n_rep, floor_us):
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


# --- verify -----------------------------------------------------------------------------------------------

RC = recurrent.RecurrentConfig
# (label, cfg): the default first; the tilings are swept at T = 6, then the best runs at every other T (and the
# default too at T = 2 and 9). Verify executables pass over the 32 layers once (--verify-reps).
VERIFY_CONFIGS = [
    ("default", recurrent.DEFAULT_VERIFY),
    ("BV8 w1", RC(BV=8, num_warps=1)),
    ("BV32 w4", RC(BV=32, num_warps=4)),
]
EXTRA_DEFAULT_TS = (2, 9)  # the other T at which the default also runs, as the baseline


def verify_row(shape, T, label, cfg, L, reps, n_rep, decode_best, with_commit=True):
    B, (H, K), dtype = 1, shape, jnp.bfloat16
    xs, windows, states, params = layer_stack(L, B, T, H, K, dtype)
    n = jnp.int32(max(1, T // 2))

    def step(carry, xs):
        windows, states = list(carry[0]), list(carry[1])
        outs = []
        for _ in range(reps):
            for l in range(L):
                y, rows, post = recurrent.verify(*xs[l], windows[l], states[l], *params, cfg=cfg)
                if with_commit:
                    windows[l], states[l] = kda.kda_commit(rows, post, n)
                    outs.append(y)
                else:
                    outs.append((y, rows, post))
        return (tuple(windows), tuple(states)), outs

    fn = jax.jit(step, donate_argnums=0 if with_commit else ())
    name = f"T{T} {label} " + ("verify+commit" if with_commit else "verify only")
    try:
        res, _ = time_chain(lambda c: fn(c, xs), (windows, states), L * reps, n_rep)
    except Exception as e:
        record("verify", name, error=repr(e)[:300])
        return None
    us = device_us(res)
    record("verify", name, **res, x_decode=us / decode_best if decode_best else float("nan"))
    return us


def bench_verify(H, K, L, reps, n_rep, smoke, decode_best):
    Ts = (2, 3) if smoke else VERIFY_TS[0]
    configs = VERIFY_CONFIGS[:1] if smoke else VERIFY_CONFIGS
    run = lambda T, label, cfg, **kw: verify_row((H, K), T, label, cfg, L, reps, n_rep, decode_best, **kw)
    best = None
    T0 = 6 if 6 in Ts else Ts[0]
    for label, cfg in configs:
        if over_budget(f"verify T{T0} {label}"):
            continue
        us = run(T0, label, cfg)
        if us is not None and (best is None or us < best[0]):
            best = (us, label, cfg)
    if best is None:
        return
    record("verify", f"best at T{T0}", us=best[0], variant=best[1])
    if not over_budget(f"verify T{T0} verify only"):
        run(T0, best[1], best[2], with_commit=False)
    for T in Ts:
        if T == T0:
            continue
        runs = [best[1:]] + ([VERIFY_CONFIGS[0]] if T in EXTRA_DEFAULT_TS and best[1] != "default" else [])
        for label, cfg in runs:
            if not over_budget(f"verify T{T} {label}"):
                run(T, label, cfg)


# --- prefill ----------------------------------------------------------------------------------------------

def bench_prefill(H, K, T, n_rep, smoke):
    """Whole layer (conv + kernels + norm) per config; the first n_configs of the list run, fla's chunk_kda
    right after config 0 (the default) so that the key comparison lands first, then the conv pass alone and the
    conv-free core. Every config's output is compared with config 0's. Later configs sweep BV and warps."""
    B = 1
    fla = PREFILL["fla"] and not smoke  # fla's kernels are Triton: GPU only
    CC = chunk.ChunkConfig
    # BV < 64 gives the h kernel (grid B × H × V/BV, chunks in sequence) more than 64 programs for the
    # H200's 132 SMs.
    all_configs = [CC(), CC(num_warps_intra=8), CC(BV=32), CC(BV=16)]
    for dtype in (jnp.dtype(d) for d in PREFILL["dtypes"]):
        args = inputs(7, B, T, H, K, dtype)
        dn = jnp.dtype(dtype).name
        configs = all_configs[:PREFILL["n_configs"] if dtype == jnp.bfloat16 else 1]
        out0 = None
        for i_cfg, cfg in enumerate(configs):
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
            record("prefill", f"pallas {dn} T{T} BV{cfg.BV} wi{cfg.num_warps_intra} wh{cfg.num_warps_h} "
                   "(whole layer)", ms=t * 1e3)
            if i_cfg == 0:
                if fla:
                    bench_fla_prefill(B, T, H, K, dtype, n_rep)
                if not over_budget(f"prefill {dn} core"):
                    bench_prefill_parts(args, cfg, dn, T, n_rep)


def bench_prefill_parts(args, cfg, dn, T, n_rep):
    """The conv pass alone, and the conv-free core (both kernels + gated norm on a precomputed conv output):
    the closest match to what fla's chunk_kda does (it has no conv and no norm)."""
    qkv, f, b, z, win, state, conv_w, A_log, dt_bias, o_norm_w = args
    conv_pass = jax.jit(lambda qkv, win, cw: conv.short_conv(qkv, win, cw, cfg=cfg.conv_cfg))
    t, (y_conv, _) = median_time(conv_pass, qkv, win, conv_w, n_rep=n_rep)
    record("prefill", f"pallas {dn} T{T} conv+SiLU pass alone", ms=t * 1e3)
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
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpret mode); fla skipped, nothing "
                   "written under experiments/results")
    p.add_argument("--sections", default="check,decode,verify,prefill")
    p.add_argument("--verify-ts", default="2,3,4,5,6,7,8,9")
    p.add_argument("--decode-us", type=float, default=None, help="decode µs/layer for the verify ratio when "
                   "the decode section is not run")
    p.add_argument("--prefill-dtypes", default="bfloat16,float32")
    p.add_argument("--prefill-configs", type=int, default=2, help="how many of the bf16 prefill configs run")
    p.add_argument("--no-fla", action="store_true", help="skip fla's chunk_kda (its autotuning takes ~100 s)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler's device times")
    p.add_argument("--json", default="kda_bench.json", help="results file name (two concurrent runs must not "
                   "share one)")
    p.add_argument("--decode-configs", default=None, help='subset of the decode sweep, "BV,warps,stages;..."')
    p.add_argument("--verify-configs", default=None, help="subset of VERIFY_CONFIGS labels, comma-separated")
    p.add_argument("--verify-reps", type=int, default=1, help="passes over the L layers per verify executable")
    p.add_argument("--budget", type=float, default=1e9, help="seconds after which remaining configs are skipped")
    a = p.parse_args()
    BUDGET_S[0] = a.budget
    PROFILE[0] = not a.no_profile
    VERIFY_TS[0] = tuple(int(t) for t in a.verify_ts.split(","))
    if a.decode_configs:
        DECODE_CONFIGS[:] = [tuple(int(v) for v in c.split(",")) for c in a.decode_configs.split(";")]
    if a.verify_configs:
        wanted = a.verify_configs.split(",")
        unknown = set(wanted) - {label for label, _ in VERIFY_CONFIGS}
        if unknown:
            p.error(f"--verify-configs: unknown {sorted(unknown)}; known: {[lb for lb, _ in VERIFY_CONFIGS]}")
        VERIFY_CONFIGS[:] = [v for v in VERIFY_CONFIGS if v[0] in wanted]
    PREFILL.update(dtypes=tuple(a.prefill_dtypes.split(",")), n_configs=a.prefill_configs, fla=not a.no_fla)
    sections = a.sections.split(",")
    if a.smoke:  # one config per sweep, bf16 prefill only: the real run's code paths in under a minute
        H, K, L, reps, n_rep, T_pf = 2, 32, 2, 1, 2, 20
        PREFILL.update(dtypes=("bfloat16",), n_configs=1)
    else:
        H, K, L, reps, n_rep, T_pf = 32, 128, 32, 2, 30, 8192
    meta = dict(**run_header(), H=H, K=K, L_cold=L, argv=sys.argv)
    t0 = time.time()
    ok = None

    def dump():
        write_results(a.json, dict(meta=meta, checks_passed=ok, rows=ROWS), to_repo=not a.smoke)

    for section, fn in (("check", lambda: check(H, K, a.smoke)), ("check_default", lambda: check_default(H, K)),
                        ("check_quick", lambda: check_quick(H, K))):
        if section in sections:
            ok = fn() and ok is not False
            dump()
            log(f"{section} {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    best = None
    if "decode" in sections:
        best = bench_decode(H, K, L, reps, n_rep, a.smoke)
        dump()
        log(f"decode done ({time.time() - t0:.0f}s)")
    if "verify" in sections:
        bench_verify(H, K, L, 1 if a.smoke else a.verify_reps, max(5, n_rep // 2), a.smoke,
                     best[0] if best else a.decode_us)
        dump()
        log(f"verify done ({time.time() - t0:.0f}s)")
    if "prefill" in sections:
        bench_prefill(H, K, T_pf, 10 if not a.smoke else 1, a.smoke)
        dump()
        log(f"prefill done ({time.time() - t0:.0f}s)")
    log("\n| section | name | numbers |\n|---|---|---|")
    for r in ROWS:
        if r["section"] == "check" and r.get("passed"):
            continue
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        log(f"| {r['section']} | {r['name']} | {nums} |")
    verdict = "not run" if ok is None else ("passed" if ok else "FAILED")
    log(f"checks {verdict}; total {time.time() - t0:.0f}s")
    if ok is False:
        sys.exit(1)


if __name__ == "__main__":
    main()
