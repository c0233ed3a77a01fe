"""Probe: the flash-decoding combine of the MLA decode partials, by device time (JAX profiler timeline span).

After the kernel, `decode._combine` merges NS partials (o [NS, TH, R] fp32, m and l [NS, TH]) in XLA: on the H200
four kernels (max, exp-weighted sum of o, weighted sum of l, divide), 5 µs at L = 1k, T = 1 (NS = 32), where the
kernel itself takes 5.7 (RESULTS.md, "Session 7"). Variants, each checked against a float64 combine:
  current   decode._combine.
  variadic  one lax.reduce over NS of (m, l, o) tuples with the online-softmax merge (m and l broadcast over R),
            then the divide.
  bcast     the max first, then the weighted sums of o and of l (broadcast over R) in one reduction's shape.
Inputs are cold: 8 distinct partial sets per profiled call (8 × 8.6 MB at NS = 132).

Measured (RESULTS.md, "Session 7", S7 10): `current` 5.2 / 12.6 / 6.7 µs at NS 32 / 132 / 22 (× TH 32 / 32 / 192),
`bcast` the same, `variadic` slower (9.3 / 16.9 / 8.4: XLA's variadic reduction is one slow kernel); the combine
stays as it is.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_mla_combine.py`.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_header, write_results  # noqa: E402
from profile_ops import call_span_us, durations_by_name, split_calls, trace_kernels  # noqa: E402

from pallas_kernels.mla import decode  # noqa: E402

OUT = "probe_mla_combine.json"
SHAPES = {"1k T=1 (NS 32)": (32, 32), "8k+ T=1 (NS 132)": (132, 32), "32k T=6 (NS 22)": (22, 192)}
R = 512


def combine_variadic(o, m, l):
    shape = o.shape

    def merge(a, b):
        (m1, l1, o1), (m2, l2, o2) = a, b
        mn = jnp.maximum(m1, m2)
        x, y = jnp.exp(m1 - mn), jnp.exp(m2 - mn)
        return mn, l1 * x + l2 * y, o1 * x + o2 * y

    init = (jnp.float32(decode._M_INIT), jnp.float32(0), jnp.float32(0))
    _, den, num = lax.reduce((jnp.broadcast_to(m[..., None], shape), jnp.broadcast_to(l[..., None], shape), o),
                             init, merge, (1,))
    return num / den


def combine_bcast(o, m, l):
    w = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))[..., None]  # [B, NS, TH, 1]
    num = jnp.sum(w * o, axis=1)
    den = jnp.sum(jnp.broadcast_to(w * l[..., None], o.shape), axis=1)
    return num / den


VARIANTS = {"current": decode._combine, "variadic": combine_variadic, "bcast": combine_bcast}


def partials(ns, th, seed):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((1, ns, th)).astype(np.float32) * 3
    m[:, -1] = decode._M_INIT  # an empty split, as the kernel writes one
    l = np.where(m > decode._M_INIT, rng.uniform(1, 30, m.shape), 0).astype(np.float32)
    o = (rng.standard_normal((1, ns, th, R)) * l[..., None]).astype(np.float32)
    return jnp.asarray(o), jnp.asarray(m), jnp.asarray(l)


def combine64(o, m, l):
    o, m, l = (np.asarray(a, np.float64) for a in (o, m, l))
    w = np.exp(m - m.max(axis=1, keepdims=True))
    return np.einsum("bsh,bshr->bhr", w, o) / (w * l).sum(axis=1)[..., None]


def main():
    results = {**run_header(), "rows": []}
    for shape, (ns, th) in SHAPES.items():
        sets = [partials(ns, th, s) for s in range(8)]
        want = combine64(*sets[0])
        for name, fn in VARIANTS.items():
            got = np.asarray(jax.jit(fn)(*sets[0]), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            run = jax.jit(lambda sets: [fn(*s) for s in sets])
            events = trace_kernels(lambda: run(sets), 10)
            span = call_span_us(split_calls(events)) / len(sets)
            ks = {k: round(statistics.median(v), 2) for k, v in durations_by_name(events).items()}
            results["rows"].append(dict(shape=shape, variant=name, err=err, span_us=round(span, 2), kernels=ks))
            print(f"{shape:18s} {name:9s} err {err:.1e}  span {span:6.2f} µs  " +
                  "  ".join(f"{k[:26]} {v}" for k, v in ks.items()), flush=True)
            write_results(OUT, results, to_repo=jax.default_backend() == "gpu")  # CPU runs: no timings


if __name__ == "__main__":
    main()
