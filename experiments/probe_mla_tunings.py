"""Probe: the Pallas MLA decode kernel's tunings by device time (JAX profiler timeline span per attention call, as
RESULTS.md's MLA table), at Ling sizes over 8 distinct cold caches per call (profile_ops.mla_op), each tuning first
checked compiled against the fp32 reference at L = 8k, T = 6 (NaN-free full cache; the NaN-poison checks are the
tests').

Why: `bench_mla.py`'s sweep timed by the host-side slope, which cannot resolve these 10-80 µs calls (RESULTS.md),
and ran out of its budget; the defaults were chosen by registers and spills (experiments/triton_resources.py),
never by device time.

Run on the GPU: `PYTHONPATH=.:experiments timeout 540 python3 experiments/probe_mla_tunings.py` (`--tunings` in
bench_mla.py's syntax, relative to the MLADecodeTuning defaults of the code run; `--ops` profile_ops' MLA op names).
RESULTS.md's calls name the commit each ran at: the defaults and the split rule changed during session 7.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import profile_ops  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402
from bench_mla import parse_tunings, short  # noqa: E402

from pallas_kernels import mla  # noqa: E402

OUT = "probe_mla_tunings.json"
TUNINGS = ";".join(["default", "block_l=64,block_k=None,num_warps=8,programs_per_sm=1",
                    "block_k=None,num_warps=8,programs_per_sm=1", "block_l=64,num_stages=1",
                    "q_pieces=1,p_pieces=1"])  # the tunings are relative to the defaults of the code run
OPS = "mla_32k_t1,mla_8k_t1,mla_1k_t1,mla_32k_t6,mla_8k_t6"


def check(tuning, t=6, length=8192):
    """Relative error of the Pallas kernel against the reference backend (fp32) on one full cache."""
    rng = np.random.default_rng(1)
    ql = jnp.asarray(rng.standard_normal((1, t, 32, 512)) * 0.05, jnp.float32)
    qr = jnp.asarray(rng.standard_normal((1, t, 32, 64)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((1, length, 576)), jnp.bfloat16)
    run = lambda backend, **kw: np.asarray(jax.jit(lambda ql, qr, c: mla.mla_decode_attention(  # noqa: E731
        ql, qr, c, jnp.int32(length - t), scale=192 ** -0.5, backend=backend, **kw))(ql, qr, c), np.float64)
    got, ref = run("pallas", tuning=tuning), run("reference")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tunings", default=TUNINGS)
    ap.add_argument("--ops", default=OPS)
    ap.add_argument("--n", type=int, default=5)
    args = ap.parse_args()
    results = {**run_header(), "rows": []}
    for tu in parse_tunings(args.tunings):
        label = short(tu)
        try:
            err = check(tu)
        except Exception as exc:  # one tuning's failure must not lose the others
            print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        profile_ops.MLA_TUNING = tu
        spans = {}
        for op in args.ops.split(","):
            r = profile_ops.profile(op, "pallas", args.n)
            kern = [k for k in r["kernels"] if k["kernel"].startswith("mla_decode")]
            spans[op] = dict(span_us=r["span_us_per_op"], kernel_us=kern[0]["dur_us"] if kern else None)
        results["rows"].append(dict(tuning=label, err=err, ops=spans))
        print(f"{label:40s} err {err:.2e}  " + "  ".join(f"{op[4:]} {v['span_us']:6.1f} ({v['kernel_us']})"
                                                         for op, v in spans.items()), flush=True)
        write_results(OUT, results, to_repo=jax.default_backend() == "gpu")  # CPU runs: no timings


if __name__ == "__main__":
    main()
