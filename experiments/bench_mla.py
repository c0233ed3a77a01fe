"""How close does the Pallas absorbed-MLA decode kernel get to its byte floor at Ling-3.0-flash sizes
(H = 32, R = 512, P = 64), L in {1k, 8k, 32k}, T in {1, 6}, against the pure-XLA reference?

Run on the GPU: `PYTHONPATH=. python3 experiments/bench_mla.py` (`--quick`: default tuning only). Compiled
correctness first (Pallas vs reference, NaN poison past start + T), then timings. Caches are cold: 8 distinct
bf16 caches per length (32k × 576 × 2 B = 37.7 MB each, 302 MB in all, > the 60 MB L2), rotated across calls.
The cache is full: start = L - T, so all L positions are valid and read. Floor bytes: L·576·2 (cache) + q (T·H·576·4)
+ o (T·H·512·4); % of 4.3 TB/s. Timing as in bench_moe.py (slope between executables of NL and 3·NL calls; the caches are passed once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import print_table, run_header, write_results  # noqa: E402
from bench_moe import HBM, rel_err, time_per_call  # noqa: E402

from pallas_kernels import mla  # noqa: E402
from pallas_kernels.mla.decode import MLADecodeTuning, mla_decode_attention as mla_pallas  # noqa: E402

H, R, P = 32, 512, 64  # Flash; --toy below shrinks them for a CPU check
SCALE = 192 ** -0.5


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--with-reference", action="store_true", help="time the XLA reference at every L, not only max")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--ts", default="1,6")
    ap.add_argument("--ncache", type=int, default=8)
    ap.add_argument("--toy", action="store_true")
    args = ap.parse_args(argv)
    global H, R, P
    if args.toy:
        H, R, P = 4, 64, 16
    header = run_header()
    rng = np.random.default_rng(0)
    results = {**header, "rows": [], "checks": {}}
    t_start = time.time()
    tunings = [MLADecodeTuning()]
    if not args.quick:
        tunings += [MLADecodeTuning(block_l=16), MLADecodeTuning(num_warps=8)]
    lengths = [int(v) for v in args.lengths.split(",")]
    for length in lengths:
        caches = [jnp.asarray(rng.standard_normal((1, length, R + P)), jnp.bfloat16) for _ in range(args.ncache)]
        for t in [int(v) for v in args.ts.split(",")]:
            qs = [(jnp.asarray(rng.standard_normal((1, t, H, R)) * 0.05, jnp.float32),
                   jnp.asarray(rng.standard_normal((1, t, H, P)), jnp.bfloat16)) for _ in range(3 * args.ncache)]
            start = jnp.int32(length - t)
            # Correctness, compiled, with the positions past start + T poisoned.
            poisoned = caches[0].at[:, length - t - 3 + t:].set(jnp.nan) if length > 64 else caches[0]
            st = jnp.int32(length - t - 3)
            o_p = mla.mla_decode_attention(*qs[0], poisoned, st, scale=SCALE, backend="pallas")
            o_r = mla.mla_decode_attention(*qs[0], poisoned, st, scale=SCALE)
            err = rel_err(o_p, o_r)
            results["checks"][f"L{length}_T{t}_rel_err"] = err
            print(f"check L={length} T={t}: rel err vs reference {err:.2e}, finite "
                  f"{bool(np.isfinite(np.asarray(o_p)).all())}", flush=True)
            nbytes = length * (R + P) * 2 + t * H * (R + P) * 4 + t * H * R * 4
            variants = [("pallas", tu) for tu in tunings] + [("reference", None)]
            for backend, tu in variants:
                if backend == "pallas":
                    fn = lambda cs, i, ql, qr, tu=tu: mla_pallas(ql, qr, cs[i % len(cs)], start, scale=SCALE,  # noqa: E731
                                                                  tuning=tu)
                else:
                    fn = lambda cs, i, ql, qr: mla.mla_decode_attention(ql, qr, cs[i % len(cs)], start,  # noqa: E731
                                                                        scale=SCALE)
                if backend == "reference" and not args.with_reference and length != max(lengths):
                    continue
                try:
                    us, sp = time_per_call(fn, caches, lambda i: qs[i], args.ncache, (1, 3), args.iters)
                except Exception as exc:
                    print(f"skip {backend} {tu}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                gbs = nbytes / (us * 1e-6) / 1e9
                r = dict(kind="mla_decode", backend=backend, L=length, T=t, us=round(us, 2), spread_us=round(sp, 2),
                         floor_us=round(nbytes / HBM * 1e6, 2), bytes=nbytes, GBps=round(gbs, 1),
                         pct_of_4p3TBps=round(100 * gbs * 1e9 / HBM, 1),
                         note=str(tu).replace("MLADecodeTuning", "") if tu else "")
                results["rows"].append(r)
                print(f"mla L={length:6d} T={t} {backend:9s} {us:8.2f} µs (±{sp:.2f}) floor {r['floor_us']:6.2f} µs "
                      f"{gbs:7.0f} GB/s {r['pct_of_4p3TBps']:5.1f}% {r['note']}", flush=True)
        del caches
    write_results("bench_mla.json", results, to_repo=not args.toy)
    print_table(results["rows"], ["L", "T", "backend", "us", "floor_us", "GBps", "pct_of_4p3TBps", "note"])
    print(f"total bench time {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
