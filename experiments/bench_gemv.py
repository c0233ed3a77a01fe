"""How close do the Pallas GEMV and greedy-head kernels (pallas_kernels/gemv/kernel.py) get to reading each weight
once at 4.3 TB/s, at Ling-3.0-flash's decode projection shapes, against XLA (`jnp.dot` in the same layout, the
model's `proj`)?

Run on the GPU: `PYTHONPATH=. python3 experiments/bench_gemv.py` (`--sweep`: a few tunings per shape and T as well
as the default; `--fp8`: the same shapes with block-FP8 weights, below; `--smoke`: toy sizes on CPU in interpret
mode, nothing written under experiments/results).
Shapes, w [K, N] bf16 ([in, out], ling_jax/params.py): 2560x20512 (KDA's fused input projection w_in, 32 heads x
(5·128 + 1)), 4096x2560 (KDA o_proj, with the block's residual added), 2560x576 (MLA kv_a), 2560x6176 (MLA's fused
q|gate w_qg, 32 heads x 193), 2560x157184 (lm_head); T in {1, 4}. Rows per shape and T: `xla` (reference.gemv
jitted: XLA's fusion or library GEMV), `pallas` (kernel.gemv, the default tuning, then the --sweep variants). For
the lm_head also the greedy pick: `xla_argmax` (XLA's logits rounded to bf16 as the model rounds them, then
jnp.argmax) against `pallas_greedy` (kernel.greedy_head: no logits written).
Cold weights: each shape has NW = max(8, COLD_BYTES / weight bytes) distinct copies used in rotation, so a call's
weight was last read NW - 1 calls (>= 200 MB, four times the H200's 50 MB L2) earlier; every call has its own
input x.
Timing: one executable makes R·NW independent calls (R = 1 and 3: `common.slope_per_call`, the wall-clock slope,
medians of --iters runs after 2 warm-ups); on a GPU also the profiler's device time: the R = 1 executable's
timeline span / NW (`device_us`, what a row's µs and GB/s use there) and its kernel time sum / NW (`kernel_us`),
medians over 5 traced runs after 2 warm-ups. Bytes: the weight + x + the output (+ the residual); % of 4.3 TB/s.
Checks, compiled, before each timing: the GEMV against the XLA row's output (L2 relative error <= REL_ERR_MAX); the
greedy ids equal to XLA's argmax, token for token. A tuning that fails to compile or run is a row with its error
(not a crash); a wrong result is listed under `failed` and the run exits 1. Results are saved after each shape.
`--fp8`: each weight is `fp8.quantize` of the bf16 one (IN_OUT: E4M3 [K, N] and fp32 scales [ceil(K/128), N]);
`xla` is what the model runs on XLA (ling_jax/layers/linear.py: the weight dequantised to bf16, then the dot),
`pallas` the kernel (one token by FMAs, more tokens by its hand-pipelined dot; each 128-row block's scale applied
to fp32 partial sums), checked against `reference.gemv` (the weight dequantised in fp32) within FP8_REL_ERR_MAX;
the bytes count the E4M3 values and the scales (+3 %), so the % of 4.3 TB/s is that of the bytes an FP8 step must
read. The shapes default to the four projections (the -fp8 checkpoint keeps the lm_head bf16; `--shapes` can add
it); no greedy rows. `--fp8 --sweep` runs FP8_SWEEP plus the K-split counts next to the default's
(`kernel.fp8_splits`), 53 rows at T = 1, 4 (estimated ~100 s on the H200, not yet run). Results go to
bench_gemv_fp8.json.
`--fp8 --levers`: the FP8 levers side by side (`fp8_levers`), on Flash's fused FP8 decode shapes (`LEVER_SHAPES`:
KDA w_in and o_proj, MLA w_qg and kv_a, the dense MLP's gate|up and down, each with the model's norm prologue or
residual) at T = 1, 4, 16: `before` (kernel.py's default: IN_OUT, FMAs at T = 1, the hand-pipelined dot above),
`d_rows_fma` (rows.py over the ROWS layout, T = 1, FMAs at `rows.default_tuning`: looped in two-block steps at KDA's
w_in, unrolled elsewhere), `d_rows_fma_g2` / `_g4` (T = 1: the FMAs looped, 2 or 4 blocks a step; `_g2_early`: the
first step's loads issued before the norm walks x),
`a_rows_dot_g2` / `_g4` (T > 1: the looped dot, 2 or 4 blocks a step), `d_rows_dot` (rows.py, the unrolled dot),
`a_rows_dot` (rows.py, the dot in a loop Triton pipelines), `c_w8a8` (w8a8.py: E4M3 activations quantised by an XLA
fusion, then an FP8 x FP8 dot; held to `w8a8.reference`, its own numerics), `b_tma` (tma.py: Mosaic GPU, the weight
through a ring of bulk copies, on `tma.prepare`'s layout; the norm, the f16 scaling and the epilogue are XLA
fusions around it); then a sweep of the rows kernel's tunings around its defaults (`ROWS_FMA_SWEEP` at T = 1,
`ROWS_DOT_SWEEP` above, the K-split counts either side) at --sweep-ts (`--sweep-ts 0`: none), while the --budget
lasts (a row past --hard-limit is listed as skipped, to rerun with --shapes / --ts). One executable per row calls
the op on NW cold weight copies (the rotation above; the ROWS copies are `fp8.convert_layout` of the IN_OUT ones,
the TMA ones `tma.prepare` of those: the same weights); a row's µs is the profiler's median device time per call
(the timeline span / NW of 3 traced runs: kernels, K-split sums and XLA fusions included), checked against
`reference.gemv` (op by op) within FP8_REL_ERR_MAX on the first call's output. Prints every row and a table of the
levers per shape and T (µs, % of 4.3 TB/s, the best); results go to bench_gemv_levers.json.
`bash experiments/gpu.sh gemv_levers` runs it with the sweep (the levers alone at T = 1, 4: 131 s on an H100).
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

from common import (HBM_BYTES_PER_S, finish, parse_tunings, print_table, rel_err, run_header, short, slope_per_call,
                    write_results)
from pallas_kernels.common import fp8
from pallas_kernels.gemv import kernel, reference, rows, tma, w8a8

# (name, K, N, with residual): the decode projections of Flash (D 2560, KDA 32 heads x 128, MLA kv_lora 512 + rope
# 64, MLA q 32 heads x 192, vocab 157184).
SHAPES = [("kda_in", 2560, 32 * 641, False), ("kda_o", 4096, 2560, True), ("mla_kv_a", 2560, 576, False),
          ("mla_qg", 2560, 32 * 193, False), ("lm_head", 2560, 157184, False)]
LM_HEAD = "lm_head"
COLD_BYTES = 200e6  # a shape's weight copies together: 4x the H200's 50 MB L2
MIN_COPIES = 8
# bf16 outputs against XLA's: every entry within one bf16 ulp (2^-7 relative at most), tests/ops/test_gemv.py's bound.
REL_ERR_MAX = 8e-3
# Each item replaces fields of the shape's default tuning (kernel.default_tuning / kernel.GREEDY_TUNING): wider and
# narrower column blocks, longer K steps (more bytes in flight per program), fewer or more warps, K-splits.
GEMV_SWEEP = ("block_k=128;block_k=256;num_warps=2;num_warps=1,block_k=256;num_warps=8;block_n=128;block_n=32;"
              "k_splits=1;k_splits=4;k_splits=16;num_stages=1")
GREEDY_SWEEP = "block_n=64;block_n=256;block_k=128;num_warps=8;num_warps=2;num_stages=1"
# FP8 (kernel._fp8_default_tuning): one token by the dot instead of FMAs, 8 warps, the other column width, two scale
# blocks per step (FMAs only: the dot's carried [256, BN] f16 tiles spill registers on sm_90); the K-split counts
# next to the default's are added per shape (fp8_sweep).
FP8_SWEEP = "one_token_dot=true;num_warps=8;block_n=64;block_n=128;block_k=256"
# The FP8 kernel equals the fp32-dequantising reference up to fp32 rounding order before its one rounding to bf16
# (tests/ops/test_gemv.py's bound); a kernel rounding the dequantised weight to bf16 would be ~2e-3 off.
FP8_REL_ERR_MAX = 1e-3


# (name, K, N, residual, norm): the fused FP8 decode projections of Flash (ling_jax/params.py, docs/model.md):
# KDA's w_in (32 heads x q|k|v|f|g|b = 641) and o_proj (32·128 -> 2560, + residual), MLA's w_qg (32 heads x q|gate
# = 193) and kv_a (512 + 64), the dense MLP's gate|up (two [2560, 6144] side by side; params.py keeps them apart
# today) and down (+ residual). MLA's o_proj is KDA's shape.
LEVER_SHAPES = [("kda_in", 2560, 32 * 641, False, True), ("kda_o", 4096, 2560, True, False),
                ("mla_qg", 2560, 32 * 193, False, True), ("mla_kv_a", 2560, 576, False, True),
                ("mlp_gate_up", 2560, 2 * 6144, False, True), ("mlp_down", 6144, 2560, True, False)]
LEVER_TS = "1,4,16"
W8A8 = "c_w8a8"  # lever c: E4M3 activations (per token and 128 columns) x E4M3 weights on the tensor cores
TMA = "tma"  # lever b's layout: tma.prepare of the ROWS weight (rows padded, scales block-major)
# The rows kernel's sweep around its default (items replace its fields; the K-split counts either side are added):
# T = 1 FMAs wider and narrower per thread, the loop or the unrolled blocks (whichever the default is not), the norm
# by XLA; the dot's block and warps (16 rows on one warp, 32 on two, 128 on eight), pipelining depth, the norm in the
# kernel. Items equal to the default drop out.
ROWS_FMA_SWEEP = ("block_n=32;num_warps=2;num_warps=4;num_warps=8;unroll=false;unroll=true,group=1;"
                  "norm_in_kernel=false")
ROWS_DOT_SWEEP = ("block_n=16,num_warps=1;block_n=32,num_warps=2;block_n=128,num_warps=8;num_stages=2;num_stages=4;"
                  "num_stages=5;norm_in_kernel=true")
# Seconds from the start after which the sweep stops, and after which every row is skipped (written as skipped):
# both leave the suite's 330 s timeout room for the last row and the tables.
LEVERS_BUDGET_S = 200
LEVERS_HARD_S = 290


def fp8_levers(t, k, n, norm=True):
    """[(lever, layout, tuning)] of one shape and T, side by side (module docstring, --levers): each lever with its
    own heuristic default; `norm`: the shape has the norm prologue (which `_g2_early` needs)."""
    out = [("before", fp8.IN_OUT, kernel.default_tuning(t, k, n, 1))]
    dot = rows.default_tuning(t, k, n, one_token_dot=True, unroll=False)
    if t == 1:
        fma = rows.default_tuning(1, k, n)
        looped = dataclasses.replace(fma, unroll=False, num_warps=4)
        out += [("d_rows_fma", fp8.ROWS, fma), ("d_rows_fma_g2", fp8.ROWS, dataclasses.replace(looped, group=2)),
                ("d_rows_fma_g4", fp8.ROWS, dataclasses.replace(looped, group=4))]
        if norm:
            out.insert(-1, ("d_rows_fma_g2_early", fp8.ROWS, dataclasses.replace(looped, group=2, early_loads=True)))
    else:
        out += [("a_rows_dot_g2", fp8.ROWS, dataclasses.replace(dot, group=2)),
                ("a_rows_dot_g4", fp8.ROWS, dataclasses.replace(dot, group=4))]
    return out + [("d_rows_dot", fp8.ROWS, rows.default_tuning(t, k, n, one_token_dot=True, unroll=True)),
                  ("a_rows_dot", fp8.ROWS, dot),
                  (W8A8, fp8.ROWS, w8a8.default_tuning(t, k, n)),
                  ("b_tma", TMA, tma_tuning(k, n))]


def lever_list():
    """Every lever's name, the T = 1 ones first."""
    names = [lv for lv, _, _ in fp8_levers(1, 256, 256)]
    return names + [lv for lv, _, _ in fp8_levers(2, 256, 256) if lv not in names]


def tma_tuning(k, n, block_n=64, ctas_per_sm=2):
    """The TMA lever's tuning: block_n-row CTAs, 4 stages, the fewest K-splits (of K/128 blocks) giving
    ctas_per_sm CTAs per SM."""
    blocks, row_blocks = k // fp8.BLOCK, tma.padded_rows(n) // block_n
    ks = next((d for d in range(1, blocks + 1) if blocks % d == 0 and row_blocks * d >= ctas_per_sm * kernel.SMS),
              blocks)
    return tma.TmaTuning(block_n=block_n, k_splits=ks)


def rows_sweep(base, k, t, spec=None):
    """The rows kernel's sweep around `base` (ROWS_FMA_SWEEP at T = 1, ROWS_DOT_SWEEP above), with the K-split
    counts of whole 128-column blocks either side of base's; base itself left out."""
    splits = kernel.fp8_splits(k, fp8.BLOCK)
    i = splits.index(base.k_splits) if base.k_splits in splits else 0
    near = [f"k_splits={d}" for d in splits[max(i - 1, 0):i + 2] if d != base.k_splits]
    spec = spec or (ROWS_FMA_SWEEP if t == 1 else ROWS_DOT_SWEEP)
    return [tu for tu in _distinct(parse_tunings(base, ";".join([spec] + near))) if tu != base]


def label(tuning, default, t):
    """Every field of a tuning, short (`bn64 bk64 ks8 w4 s3`, ` fma` for one token by FMAs), marked when it is the
    shape's default."""
    text = (f"bn{tuning.block_n} bk{tuning.block_k} ks{tuning.k_splits} w{tuning.num_warps} "
            f"s{tuning.num_stages}{' fma' if t == 1 and not tuning.one_token_dot else ''}")
    return f"default {text}" if tuning == default else text


def fp8_sweep(base, k, t, spec):
    """The FP8 sweep of a shape: `spec`'s items and the K-split counts either side of the default's. At T > 1
    one_token_dot changes nothing (such an item is the default and drops out), and steps over 128 rows are left
    out (FP8_SWEEP)."""
    splits = kernel.fp8_splits(k)
    i = splits.index(base.k_splits) if base.k_splits in splits else 0
    near = [f"k_splits={d}" for d in splits[max(i - 1, 0):i + 2] if d != base.k_splits]
    tunings = parse_tunings(base, ";".join([spec] + near))
    if t > 1:
        tunings = [dataclasses.replace(tu, one_token_dot=base.one_token_dot) for tu in tunings
                   if tu.block_k <= fp8.BLOCK]
    return tunings


def _distinct(tunings):
    """The tunings in order, each once (a sweep item may equal the shape's default)."""
    return list(dict.fromkeys(tunings))


def make_weights(k, n, copies, key, fp8_weights=False):
    """`copies` distinct bf16 [K, N] buffers with the statistics of a fan-in init (their block-FP8 quantisations with
    fp8_weights)."""
    base = jax.random.normal(key, (k, n), jnp.bfloat16) * (k ** -0.5)
    ws = [(base * (1.0 + 0.01 * c)).astype(jnp.bfloat16) for c in range(copies)]
    return [jax.block_until_ready(fp8.quantize(w) if fp8_weights else w) for w in ws]


def weight_bytes(k, n, fp8_weights):
    """HBM bytes of one [K, N] weight: bf16, or E4M3 values plus one fp32 scale per 128 rows and column."""
    return k * n + -(-k // fp8.BLOCK) * n * 4 if fp8_weights else k * n * 2


def device_times(run, n_calls, n_traced=5):
    """(timeline span, kernel time sum) per call in µs from the profiler, medians over n_traced traced runs of
    `run` (one executable of n_calls calls); (None, None) off the GPU."""
    if jax.default_backend() != "gpu":
        return None, None
    from ling_jax.profiling import call_span_us, split_calls, trace_kernels

    calls = split_calls(trace_kernels(run, n_traced))
    if not calls:
        return None, None
    kernel_sum = statistics.median(sum(dur for _, _, dur in c) for c in calls)
    return round(call_span_us(calls) / n_calls, 2), round(kernel_sum / n_calls, 2)


def time_op(op, ws, xs, rs, reps, iters):
    """op(w, x, r) over the NW weight copies in rotation, each call with its own x (and r): (wall µs per call, its
    spread, device µs per call, kernel µs per call)."""
    nw = len(ws)
    runs = {}

    def make_run(r):
        if r not in runs:
            m = r * nw
            fn = jax.jit(lambda ws, xs, rs: [op(ws[i % nw], xs[i], None if rs is None else rs[i]) for i in range(m)])
            runs[r] = functools.partial(fn, ws, xs[:m], None if rs is None else rs[:m])
        return runs[r]

    wall, spread = slope_per_call(make_run, nw, reps, iters)
    dev, kern = device_times(make_run(1), nw)
    return wall, spread, dev, kern


def lever_time(op, ws, xs, rs, want, iters):
    """op(w, x, r) over the NW weight copies, one executable: (µs per call: the profiler's median device time on a
    GPU, else the median wall time; kernel µs per call or None; the first call's relative error against want),
    or no timing (None, None, err) when the error exceeds FP8_REL_ERR_MAX."""
    nw = len(ws)
    fn = jax.jit(lambda ws, xs, rs: [op(ws[i], xs[i], None if rs is None else rs[i]) for i in range(nw)])
    run = functools.partial(fn, ws, xs[:nw], None if rs is None else rs[:nw])
    err = rel_err(jax.block_until_ready(run())[0], want)
    if not err <= FP8_REL_ERR_MAX:
        return None, None, err
    dev, kern = device_times(run, nw, n_traced=3)
    if dev is None:
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            ts.append(time.perf_counter() - t0)
        dev = round(statistics.median(ts) / nw * 1e6, 2)
    return dev, kern, err


def _lever_inputs(shape, t, nw, rng):
    """(xs, rs or None, norm or None) of one shape and T: NW distinct bf16 inputs and residuals, the norm weight
    near ones."""
    _, k, n, with_res, with_norm = shape
    xs = [jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16) for _ in range(nw)]
    rs = [jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16) for _ in range(nw)] if with_res else None
    norm = (jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), jnp.bfloat16), 1e-6) if with_norm else None
    return xs, rs, norm


def lever_summary(rows_out, names):
    """[{shape, T, <lever>: µs, <lever>_pct, best, best_pct}] of the lever rows (the sweep's best as
    `rows_sweep_best`)."""
    table = {}
    for r in rows_out:
        if r.get("us") is None:
            continue
        cell = table.setdefault((r["shape"], r["T"]), {"shape": r["shape"], "T": r["T"]})
        key = r["lever"] if r["lever"] in names else "rows_sweep_best"
        if key not in cell or r["us"] < cell[key]:
            cell[key], cell[f"{key}_pct"] = r["us"], r["pct_of_4p3TBps"]
            if key == "rows_sweep_best":
                cell["sweep_tuning"] = r["tuning"]
        best = cell.get("best_us")
        if best is None or r["us"] < best:
            cell.update(best_us=r["us"], best=f"{r['lever']} {r['tuning']}", best_pct=r["pct_of_4p3TBps"])
    return list(table.values())


@dataclasses.dataclass
class _LeverRun:
    """The state of one --levers run: the results so far, the weight copies per shape and layout, the clock."""
    results: dict
    data: dict
    iters: int
    smoke: bool
    t_start: float  # the run's start, before the weights are made: the limits count from it

    def measure(self, shape, t, lever, layout, tu, inputs, limit):
        """One timed and checked row (skipped past `limit` seconds; a compile or launch failure is a row)."""
        name, k, n, with_res, _ = shape
        if time.time() - self.t_start > limit:
            self.results.setdefault("skipped", []).append(f"{name} T={t} {lever} {short(tu)}")
            return
        xs, rs, norm, want = inputs
        mod = w8a8 if lever == W8A8 else tma if layout == TMA else kernel if layout == fp8.IN_OUT else rows
        if lever == W8A8:  # its own numerics (E4M3 activations): held to its own reference
            want = w8a8.reference(xs[0], self.data[name][fp8.ROWS][0], None if rs is None else rs[0], norm=norm)
        nbytes = weight_bytes(k, n, True) + t * k * 2 + t * n * 2 * (2 if with_res else 1)
        row = dict(shape=name, K=k, N=n, T=t, lever=lever, layout=layout, tuning=short(tu), bytes=int(nbytes),
                   floor_us=round(nbytes / HBM_BYTES_PER_S * 1e6, 2),
                   programs=_programs(n, layout, tu))
        try:
            us, kern, err = lever_time(lambda w, x, r: mod.gemv(x, w, r, norm=norm, tuning=tu), self.data[name][layout],
                                       xs, rs, want, self.iters)
            row.update(rel_err=float(f"{err:.2e}"), kernel_us=kern)
            if us is None:
                self.results["failed"].append(f"{name} T={t} {lever} {short(tu)}: rel err {err:.2e} > "
                                              f"{FP8_REL_ERR_MAX}")
            else:
                gbs = nbytes / (us * 1e-6) / 1e9
                row.update(us=us, GBps=round(gbs, 1), pct_of_4p3TBps=round(100 * gbs * 1e9 / HBM_BYTES_PER_S, 1))
        except Exception as exc:  # a tuning that does not compile or launch is a row, not a crash
            if self.smoke:
                raise
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.results["errors"].append(f"{name} T={t} {lever} {short(tu)}: {row['error']}")
        self.results["rows"].append(row)
        state = (f"{row['us']:8.2f} µs {row['pct_of_4p3TBps']:5.1f}%" if "us" in row
                 else f"FAILED {row.get('error', '')}")
        print(f"{name:11s} T={t:<2d} {lever:18s} {state}  floor {row['floor_us']:.2f} µs  {short(tu)}  "
              f"[{time.time() - self.t_start:.0f}s]", flush=True)


def _programs(n, layout, tuning):
    """The launch's programs (CTAs): row blocks x K-splits; the TMA layout's rows are padded first."""
    rows_ = tma.padded_rows(n) if layout == TMA else n
    return -(-rows_ // tuning.block_n) * tuning.k_splits


def _lever_weights(shapes, min_copies, cold_bytes):
    """{shape: {layout: NW cold copies}}: the IN_OUT quantisations and their exact ROWS conversions."""
    data = {}
    for si, (name, k, n, _, _) in enumerate(shapes):
        nw = max(min_copies, -(-int(cold_bytes) // weight_bytes(k, n, True)))
        ws = make_weights(k, n, nw, jax.random.key(si), fp8_weights=True)
        data[name] = {fp8.IN_OUT: ws, fp8.ROWS: [jax.block_until_ready(fp8.convert_layout(w, fp8.ROWS)) for w in ws]}
        data[name][TMA] = [jax.block_until_ready(tma.prepare(w)) for w in data[name][fp8.ROWS]]
        print(f"{name}: [{k}, {n}] fp8, {nw} copies per layout", flush=True)
    return data


def _print_levers(results, budget, hard):
    lever_names = lever_list()
    print_table(results["rows"], ["shape", "T", "lever", "us", "floor_us", "pct_of_4p3TBps", "GBps", "programs",
                                  "tuning", "error"])
    cols = lever_names + ["rows_sweep_best"]
    shown = [{**c, **{lv: f"{c[lv]} ({c[lv + '_pct']} %)" for lv in cols if lv in c}} for c in results["summary"]]
    print("\nµs (% of 4.3 TB/s) per lever:")
    print_table(shown, ["shape", "T"] + cols + ["sweep_tuning", "best_pct", "best"])
    if results.get("skipped"):
        print(f"{len(results['skipped'])} rows skipped past the --budget of {budget:.0f}s (sweep) or the "
              f"--hard-limit of {hard:.0f}s: run them with --shapes / --ts")


def run_levers(args):
    """--fp8 --levers (module docstring): the lever rows of every T and shape, then the rows sweep while the budget
    lasts; results to bench_gemv_levers.json, the exit code 1 on a wrong result."""
    t_start = time.time()
    shapes = [s for s in LEVER_SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    ts, sweep_ts = [int(v) for v in (args.ts or LEVER_TS).split(",")], [int(v) for v in args.sweep_ts.split(",")]
    min_copies, cold_bytes, iters, budget, hard = MIN_COPIES, COLD_BYTES, args.iters, args.budget, args.hard_limit
    if args.smoke:  # K = 256: two scale blocks; N = 88 ragged at every block width
        shapes, ts, sweep_ts = [("kda_in", 256, 88, False, True), ("kda_o", 256, 96, True, False)], [1, 3], [1, 3]
        min_copies, cold_bytes, iters = 2, 0, 1
    results = {**run_header(), "hbm_bytes_per_s": HBM_BYTES_PER_S, "cold_bytes": cold_bytes, "rows": [],
               "errors": [], "failed": [], "method": "one executable of NW calls on cold weight copies; device: the "
                                                     "profiler's median span / NW"}
    run = _LeverRun(results, _lever_weights(shapes, min_copies, cold_bytes), iters, args.smoke, t_start)
    rng, inputs = np.random.default_rng(0), {}
    for t in ts:  # T-major: past the hard limit the last T is what goes missing, at every shape alike
        for shape in shapes:
            xs, rs, norm = _lever_inputs(shape, t, len(run.data[shape[0]][fp8.IN_OUT]), rng)
            # Op by op: under jit XLA's excess precision may skip rms_norm's bf16 rounding inside a fusion.
            want = reference.gemv(xs[0], run.data[shape[0]][fp8.IN_OUT][0], None if rs is None else rs[0], norm=norm)
            inputs[shape[0], t] = (xs, rs, norm, want)
            for lever, layout, tu in fp8_levers(t, shape[1], shape[2], norm=shape[4]):
                run.measure(shape, t, lever, layout, tu, inputs[shape[0], t], hard)
            write_results("bench_gemv_levers.json", results, to_repo=not args.smoke)
    for t in [t for t in sweep_ts if t in ts]:
        for shape in shapes:
            base = rows.default_tuning(t, shape[1], shape[2])
            for tu in rows_sweep(base, shape[1], t, "block_n=32;num_stages=2" if args.smoke else None):
                run.measure(shape, t, "rows_sweep", fp8.ROWS, tu, inputs[shape[0], t], min(budget, hard))
        write_results("bench_gemv_levers.json", results, to_repo=not args.smoke)
    results["summary"] = lever_summary(results["rows"], set(lever_list()))
    write_results("bench_gemv_levers.json", results, to_repo=not args.smoke)
    _print_levers(results, budget, hard)
    return finish(results, run.t_start)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="the --gemv-tunings / --greedy-tunings variants too")
    ap.add_argument("--gemv-tunings", default=None, help="';'-separated fields replacing the default's "
                                                        "(default GEMV_SWEEP, FP8_SWEEP with --fp8)")
    ap.add_argument("--greedy-tunings", default=GREEDY_SWEEP)
    ap.add_argument("--shapes", default=None, help="default: all of SHAPES (no lm_head with --fp8)")
    ap.add_argument("--ts", default=None, help=f"default 1,4 ({LEVER_TS} with --levers)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (E4M3 + fp32 scale per 128 rows and "
                                                       "column); no greedy rows")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpret mode); writes nothing under "
                                                         "experiments/results")
    ap.add_argument("--levers", action="store_true", help="the FP8 levers side by side (implies --fp8; "
                                                          "module docstring)")
    ap.add_argument("--sweep-ts", default="1,16", help="--levers: the T values of the rows kernel's sweep")
    ap.add_argument("--budget", type=float, default=LEVERS_BUDGET_S, help="--levers: seconds after which the "
                                                                          "sweep stops")
    ap.add_argument("--hard-limit", type=float, default=LEVERS_HARD_S, help="--levers: seconds after which every "
                                                                            "row is skipped")
    args = ap.parse_args(argv)
    if args.levers:
        return run_levers(args)
    names = args.shapes.split(",") if args.shapes else [s[0] for s in SHAPES if not (args.fp8 and s[0] == LM_HEAD)]
    shapes = [s for s in SHAPES if s[0] in names]
    ts = [int(v) for v in (args.ts or "1,4").split(",")]
    reps, iters, min_copies, cold_bytes = (1, 3), args.iters, MIN_COPIES, COLD_BYTES
    gemv_sweep = args.gemv_tunings or (FP8_SWEEP if args.fp8 else GEMV_SWEEP)
    greedy_sweep = args.greedy_tunings
    max_err = FP8_REL_ERR_MAX if args.fp8 else REL_ERR_MAX
    if args.smoke:  # every call is an interpreted kernel inlined into the executable: few and tiny
        shapes = [("kda_o", 128, 256, True), ("mla_kv_a", 128, 80, False), (LM_HEAD, 128, 300, False)]
        if args.fp8:  # K = 256: two scale blocks
            shapes = [("kda_o", 256, 256, True), ("mla_kv_a", 256, 80, False)]
        reps, iters, min_copies, cold_bytes = (1, 2), 1, 2, 0
        gemv_sweep = "block_n=64,k_splits=2;one_token_dot=true" if args.fp8 else "block_n=16,k_splits=2"
        greedy_sweep, args.sweep = "block_n=64", True
    header = run_header()
    results = {**header, "hbm_bytes_per_s": HBM_BYTES_PER_S, "cold_bytes": cold_bytes,
               "weights": "fp8 e4m3 + fp32 scale per 128 rows and column" if args.fp8 else "bf16",
               "rows": [], "errors": [],
               "failed": [], "method": f"R·NW independent calls per executable, wall slope R={reps[0]}..{reps[1]}; "
                                     "device: profiler span / NW of the R = 1 executable"}
    t_start = time.time()
    rng = np.random.default_rng(0)

    def record(kind, name, k, n, t, backend, tuning, nbytes, timing=None, error=None, **extra):
        row = dict(kind=kind, shape=name, K=k, N=n, T=t, backend=backend, tuning=tuning, bytes=int(nbytes),
                   floor_us=round(nbytes / HBM_BYTES_PER_S * 1e6, 2), **extra)
        if timing is not None:
            wall, spread, dev, kern = timing
            us = dev if dev is not None else wall
            gbs = nbytes / (us * 1e-6) / 1e9
            row.update(us=round(us, 2), wall_us=round(wall, 2), spread_us=round(spread, 2), device_us=dev,
                       kernel_us=kern, GBps=round(gbs, 1), pct_of_4p3TBps=round(100 * gbs * 1e9 / HBM_BYTES_PER_S, 1))
        if error is not None:
            row["error"] = error
            results["errors"].append(f"{kind} {name} T={t} {backend} {tuning}: {error}")
        results["rows"].append(row)
        state = f"{row['us']:9.2f} µs {row['pct_of_4p3TBps']:5.1f}%" if timing is not None else f"ERROR {error}"
        print(f"{kind:6s} {name:9s} T={t} {backend:13s} {state}  floor {row['floor_us']:.2f} µs  {tuning}  "
              f"[{time.time() - t_start:.0f}s]", flush=True)

    def attempt(fn):
        """fn() -> (timing, extra); an exception becomes an error string (re-raised in the smoke run, which is the
        script's test)."""
        try:
            return (*fn(), None)
        except Exception as exc:  # a tuning that does not compile or launch is a row, not a crash
            if args.smoke:
                raise
            return None, {}, f"{type(exc).__name__}: {str(exc)[:300]}"

    for si, (name, k, n, with_res) in enumerate(shapes):
        w_bytes = weight_bytes(k, n, args.fp8)
        nw = max(min_copies, -(-int(cold_bytes) // w_bytes))
        ws = make_weights(k, n, nw, jax.random.key(si), args.fp8)
        print(f"{name}: [{k}, {n}] {'fp8' if args.fp8 else 'bf16'}, {nw} copies ({nw * w_bytes / 1e6:.0f} MB)",
              flush=True)
        for t in ts:
            m = max(reps) * nw
            xs = [jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16) for _ in range(m)]
            rs = [jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16) for _ in range(m)] if with_res else None
            nbytes = w_bytes + t * k * 2 + t * n * 2 * (2 if with_res else 1)
            want = jax.jit(reference.gemv)(xs[0], ws[0], None if rs is None else rs[0])
            # The model's XLA projection: an FP8 weight dequantised to x's dtype first (ling_jax/layers/linear.py).
            xla_w = (lambda w, x: fp8.dequantize(w, x.dtype)) if args.fp8 else (lambda w, x: w)

            def run_xla():
                return time_op(lambda w, x, r: reference.gemv(x, xla_w(w, x), r), ws, xs, rs, reps, iters), {}

            timing, extra, error = attempt(run_xla)
            record("gemv", name, k, n, t, "xla", "", nbytes, timing, error, **extra)
            base = kernel.default_tuning(t, k, n, 1 if args.fp8 else 2)
            variants = []
            if args.sweep:
                variants = fp8_sweep(base, k, t, gemv_sweep) if args.fp8 else parse_tunings(base, gemv_sweep)
            for tu in _distinct([base] + variants):
                def run_pallas(tu=tu):
                    op = functools.partial(kernel.gemv, tuning=tu)
                    err = rel_err(op(xs[0], ws[0], None if rs is None else rs[0]), want)
                    if not err <= max_err:
                        results["failed"].append(f"gemv {name} T={t} {tu}: rel err {err:.2e} > {max_err}")
                        raise AssertionError(results["failed"][-1])
                    extra = dict(rel_err=float(f"{err:.2e}"), programs=-(-n // tu.block_n) * tu.k_splits)
                    return time_op(lambda w, x, r: op(x, w, r), ws, xs, rs, reps, iters), extra

                timing, extra, error = attempt(run_pallas)
                record("gemv", name, k, n, t, "pallas", label(tu, base, t), nbytes, timing, error, **extra)
            if name == LM_HEAD and not args.fp8:
                g_bytes = w_bytes + t * k * 2
                ids_want, max_want = jax.jit(reference.greedy_head)(xs[0], ws[0])

                def run_xla_argmax():
                    return time_op(lambda w, x, r: reference.greedy_head(x, w), ws, xs, None, reps, iters), {}

                timing, extra, error = attempt(run_xla_argmax)
                record("greedy", name, k, n, t, "xla_argmax", "", g_bytes, timing, error, **extra)
                g_base = kernel.GREEDY_TUNING
                for tu in _distinct([g_base] + (parse_tunings(g_base, greedy_sweep) if args.sweep else [])):
                    def run_greedy(tu=tu):
                        op = functools.partial(kernel.greedy_head, tuning=tu)
                        ids, max_logit = op(xs[0], ws[0])
                        differ = int((np.asarray(ids) != np.asarray(ids_want)).sum())
                        if differ:
                            results["failed"].append(f"greedy {name} T={t} {tu}: {differ}/{t} ids differ from "
                                                     f"XLA's argmax (max logits {np.asarray(max_logit)} vs "
                                                     f"{np.asarray(max_want)})")
                            raise AssertionError(results["failed"][-1])
                        return (time_op(lambda w, x, r: op(x, w), ws, xs, None, reps, iters),
                                dict(ids_differ=differ, programs=-(-n // tu.block_n)))

                    timing, extra, error = attempt(run_greedy)
                    record("greedy", name, k, n, t, "pallas_greedy", label(tu, g_base, t), g_bytes, timing, error,
                           **extra)
        del ws
        write_results("bench_gemv_fp8.json" if args.fp8 else "bench_gemv.json", results, to_repo=not args.smoke)

    print_table(results["rows"], ["kind", "shape", "T", "backend", "us", "floor_us", "pct_of_4p3TBps", "GBps",
                                  "tuning", "error"])
    return finish(results, t_start)


if __name__ == "__main__":
    sys.exit(main())
