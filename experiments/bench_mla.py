"""How close does the Pallas absorbed-MLA decode kernel get to its byte floor at Ling-3.0-flash sizes
(H = 32, R = 512, P = 64), L in {1k, 8k, 32k}, T in {1, 6}, against the pure-XLA reference? Which tuning wins?

Run on the GPU: `PYTHONPATH=. timeout 170 python3 experiments/bench_mla.py` (~150 s; `--quick`: default tuning
only; `--smoke`: toy sizes on CPU, interpret mode, nothing written under experiments/results). `--tunings` is a
';'-separated list of MLADecodeTuning variants, each `default` or `key=value,...` (e.g.
`block_l=64,num_warps=8,programs_per_sm=1`). Per shape: compiled correctness of every variant first (Pallas vs the
fp32 reference with the positions past start + T poisoned with NaN; a variant past CHECK_TOL fails the run), then
timings. Caches are cold: `--ncache` distinct bf16 caches per length (32k × 576 × 2 B = 37.7 MB each), rotated
across calls. The cache is full: start = L - T, so all L positions are valid and read. Floor bytes: L·576·2
(cache) + q (T·H·576·4) + o (T·H·512·4); % of 4.3 TB/s. Timing: common.slope_per_call (slope between executables
of NL and 2·NL calls, `--reps`; the caches are passed once); for the 10-30 µs calls this host-side slope is noisy,
and experiments/profile_ops.py's device spans are the numbers RESULTS.md quotes. `--budget` seconds: past it, the
remaining variants are skipped (the JSON, rewritten after every shape, still lands).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (HBM_BYTES_PER_S, finish, parse_tunings, print_table, rel_err, run_header,  # noqa: E402
                    short, slope_per_call, write_results)

from pallas_kernels import mla  # noqa: E402
from pallas_kernels.mla.decode import MLADecodeTuning, mla_decode_attention as mla_pallas  # noqa: E402

H, R, P = 32, 512, 64  # Flash; --smoke below shrinks them for a CPU check
SCALE = 192 ** -0.5
# L2 relative error vs the fp32 reference: tests/ops/test_mla.py's bound for the fp32-exact kernel (compiled runs at
# Ling shapes measured 3e-6 to 6e-6 as max-abs error over max-abs value).
CHECK_TOL = 1e-5

# Most promising first: a shape's variants past its share of --budget are skipped (never the first). The default
# takes 255 registers + 16 B spill stack and 97 KiB of shared memory at 4 warps (sm_90, T = 1): two programs per
# SM; block_l 64 fits once (two stages of 64 × 576 bf16 cache rows are 144 KiB); block_l 16 makes smaller steps.
# Their device-time ranking is experiments/RESULTS.md's "MLA" table.
DEFAULT_TUNINGS = ";".join([
    "default",
    "block_l=64,num_warps=8,programs_per_sm=1",
    "programs_per_sm=1",
    "block_l=16",
])


def time_per_call(fn, shared, make_call, n_per_rep, reps=(1, 3), iters=10):
    """µs per call of fn(shared, i, *make_call(i)) (common.slope_per_call), and its spread.

    `shared` (the caches) is passed once per executable; each call adds only its own small inputs.
    """
    def make_run(r):
        calls = [make_call(i) for i in range(r * n_per_rep)]
        run = jax.jit(lambda shared, calls: [fn(shared, i, *c) for i, c in enumerate(calls)])
        return lambda: run(shared, calls)

    return slope_per_call(make_run, n_per_rep, reps, iters)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default tuning only")
    ap.add_argument("--tunings", default=DEFAULT_TUNINGS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--ts", default="1,6")
    ap.add_argument("--ncache", type=int, default=4)
    ap.add_argument("--reps", default="1,2", help="executables of ncache·r calls; the slope between them is timed")
    ap.add_argument("--budget", type=float, default=140.0,
                    help="seconds, shared evenly by the shapes; a shape's variants past its share are skipped")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU; writes nothing under results/")
    args = ap.parse_args(argv)
    global H, R, P
    if args.smoke:
        H, R, P = 4, 64, 16
        # Every tuning and T runs the same kernel code: T = 6 adds the per-token causal limits T = 1 lacks, and
        # block_l 16 more cache blocks per split than the default.
        args.lengths, args.ts, args.tunings, args.ncache, args.iters = "64", "6", "default;block_l=16", 1, 1
    header = run_header()
    rng = np.random.default_rng(0)
    results = {**header, "rows": [], "checks": {}, "skipped": [], "failed": []}
    t_start = time.time()
    tunings = [MLADecodeTuning()] if args.quick else parse_tunings(MLADecodeTuning(), args.tunings)
    lengths = [int(v) for v in args.lengths.split(",")]
    ts = [int(v) for v in args.ts.split(",")]
    reps = tuple(int(v) for v in args.reps.split(","))
    n_shapes, i_shape = len(lengths) * len(ts), 0
    for length in lengths:
        caches = [jnp.asarray(rng.standard_normal((1, length, R + P)), jnp.bfloat16) for _ in range(args.ncache)]
        for t in ts:
            i_shape += 1
            deadline = t_start + args.budget * i_shape / n_shapes
            qs = [(jnp.asarray(rng.standard_normal((1, t, H, R)) * 0.05, jnp.float32),
                   jnp.asarray(rng.standard_normal((1, t, H, P)), jnp.bfloat16))
                  for _ in range(max(reps) * args.ncache)]
            start = jnp.int32(length - t)
            # Correctness, compiled, with the positions past start + T poisoned (start 3 short of the end).
            st = length - t - 3
            poisoned = caches[0].at[:, st + t:].set(jnp.nan)
            o_r = mla.mla_decode_attention(*qs[0], poisoned, jnp.int32(st), scale=SCALE)
            nbytes = length * (R + P) * 2 + t * H * (R + P) * 4 + t * H * R * 4
            variants = ([] if args.no_reference else [("reference", None)]) + [("pallas", tu) for tu in tunings]
            for backend, tu in variants:
                name = short(tu) if tu else ""
                if time.time() > deadline and backend == "pallas" and tu != tunings[0]:
                    results["skipped"].append(f"L{length}_T{t}_{backend}_{name}")
                    print(f"skip L={length} T={t} {backend} {name}: past --budget", flush=True)
                    continue
                err = None
                try:
                    if backend == "pallas":
                        o_p = mla_pallas(*qs[0], poisoned, jnp.int32(st), scale=SCALE, tuning=tu)
                        err = float(f"{rel_err(o_p, o_r):.2e}")  # inf when o_p has a non-finite entry
                        results["checks"][f"L{length}_T{t}_{name}_rel_err"] = err
                        if not err <= CHECK_TOL:
                            results["failed"].append(f"L{length}_T{t}_{name}: rel err {err:.1e} > {CHECK_TOL}")
                            print(f"FAIL {results['failed'][-1]}", flush=True)
                            continue
                        def fn(cs, i, ql, qr, tu=tu):
                            return mla_pallas(ql, qr, cs[i % len(cs)], start, scale=SCALE, tuning=tu)
                    else:
                        def fn(cs, i, ql, qr):
                            return mla.mla_decode_attention(ql, qr, cs[i % len(cs)], start, scale=SCALE)
                    us, sp = time_per_call(fn, caches, lambda i: qs[i], args.ncache, reps, args.iters)
                except Exception as exc:
                    results["failed"].append(f"L{length}_T{t}_{backend}_{name}: {type(exc).__name__}")
                    print(f"FAIL L={length} T={t} {backend} {name}: {type(exc).__name__}: {str(exc)[:300]}",
                          flush=True)
                    continue
                gbs = nbytes / (us * 1e-6) / 1e9
                r = dict(kind="mla_decode", backend=backend, L=length, T=t, us=round(us, 2), spread_us=round(sp, 2),
                         floor_us=round(nbytes / HBM_BYTES_PER_S * 1e6, 2), bytes=nbytes, GBps=round(gbs, 1),
                         pct_of_4p3TBps=round(100 * gbs * 1e9 / HBM_BYTES_PER_S, 1), rel_err=err, note=name)
                results["rows"].append(r)
                e = f"err {err:.1e}" if err is not None else ""
                print(f"mla L={length:6d} T={t} {backend:9s} {us:8.2f} µs (±{sp:.2f}) floor {r['floor_us']:6.2f} µs "
                      f"{r['pct_of_4p3TBps']:5.1f}% {e:11s} {name}  [{time.time() - t_start:.0f}s]", flush=True)
        del caches
        write_results("bench_mla.json", results, to_repo=not args.smoke)
    print_table(results["rows"], ["L", "T", "backend", "us", "floor_us", "pct_of_4p3TBps", "rel_err", "note"])
    best = {}
    for r in results["rows"]:
        if r["backend"] == "pallas":
            k = (r["L"], r["T"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    for (length, t), r in sorted(best.items()):
        ref = [x["us"] for x in results["rows"] if x["backend"] == "reference" and (x["L"], x["T"]) == (length, t)]
        print(f"best L={length} T={t}: {r['us']:.2f} µs ({r['note']})"
              + (f", reference {ref[0]:.2f} µs" if ref else ""))
    return finish(results, t_start)


if __name__ == "__main__":
    sys.exit(main())
