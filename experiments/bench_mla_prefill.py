"""How fast is the Pallas MLA flash prefill kernel at Ling-3.0-flash sizes (H = 32, Dqk 192 = 128 + 64, Dv 128,
bf16), against the eager reference it replaces and cuDNN's fused attention? Which tuning wins?

Shapes: one-shot causal prefills at T = 2048 and 8192 (start 0, L = T), and prefill chunks of C = 2048 queries at
the end of the cache, start 6144 over L = 8192 and start 30720 over L = 32768 (the chunk sees every earlier key).
Per shape: compiled correctness first (the kernel and cuDNN against the reference; for the chunks at start - 64,
with the 64 key/value rows past the chunk NaN for the kernel; the kernel past CHECK_TOL fails the run), then the
median of --iters timed calls (block_until_ready around each; the calls are ms long, so the host's share is small).
TFLOP/s counts useful causal FLOPs only: 2·H·(Dqk + Dv) per visible (query, key) pair, T·start + T(T + 1)/2 pairs.
The reference materialises [H, T, L] scores (8.6 GB in fp32 at T = 8192): an out-of-memory error is a row. cuDNN
runs through jax.nn.dot_product_attention(implementation="cudnn"): causal for the one-shot shapes; for a chunk its
causal mask would align the queries with the first keys, so it gets the boolean [T, L] mask (an additive bias
inside). jax refuses Dv != Dqk (a row), so cuDNN also runs with v zero-padded to Dqk and the output sliced
("cudnn_padv": a third more ·V work than needed, still counted at the useful FLOPs).

Run on the GPU: `PYTHONPATH=. timeout 200 python3 experiments/bench_mla_prefill.py --sweep` (~3 min with the
compiles; without --sweep the default tuning only). `--sweep` times SWEEP's MLAPrefillTuning variants (or
`--tunings`, ';'-separated `default` / `key=value,...`) at the shapes of `--sweep-shapes`; a variant that fails to
compile or run is a row with its error. `--budget` seconds: past it the remaining sweep variants are skipped (the
JSON, rewritten after every shape, still lands). `--smoke`: toy sizes on CPU, interpret mode, nothing written under
experiments/results. Writes experiments/results/bench_mla_prefill.json (and $OUT/bench_mla_prefill.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from common import (finish, median_time, parse_tunings, print_table, rel_err, run_header, short,  # noqa: E402
                    write_results)

from pallas_kernels import mla  # noqa: E402
from pallas_kernels.mla.prefill import MLAPrefillTuning, mla_prefill_attention as mla_pallas  # noqa: E402

H, DQK, DV = 32, 192, 128  # Flash; --smoke shrinks them for a CPU check
SCALE = 192 ** -0.5
# (kind, T, L, start)
SHAPES = [("oneshot", 2048, 2048, 0), ("oneshot", 8192, 8192, 0), ("chunk", 2048, 8192, 6144),
          ("chunk", 2048, 32768, 30720)]
# Kernel vs the bf16 reference, relative L2 error: tests/ops/test_mla_prefill.py measured up to 3.4e-3 on CPU; a
# GPU sums the dots in another order and XLA may keep the reference's scores in fp32 (excess precision), so 1e-2.
CHECK_TOL = 1e-2
POISON_ROWS = 64  # the chunk check runs at start - 64 with the rows past the chunk NaN

# None spills on sm_90, compiled on the CPU the way experiments/triton_resources.py compiles the decode kernel:
# the default holds 247 registers at 8 warps and 128 KiB of shared memory (one program per SM); block_q 64 at 4
# warps fits twice (104 KiB); a third stage takes 168 KiB; 16 warps halve the registers per thread (128). Left
# out for spilling: block_k 128 (104 B of stack at 8 warps) and 4 warps at block_q 128 (616 B).
SWEEP = ";".join([
    "default",
    "num_stages=3",
    "block_q=64,num_warps=4",
    "block_q=64,num_warps=4,num_stages=3",
    "num_warps=16",
    "block_k=32,num_stages=3",
    "block_q=64",
])


def visible_pairs(t, start):
    return t * start + t * (t + 1) // 2


def cudnn_attention(q, k, v, start, *, pad_v=False):
    """jax.nn.dot_product_attention through cuDNN; a chunk gets the explicit [T, L] causal mask. pad_v: v
    zero-padded to Dqk and the output sliced back to Dv."""
    t, length, dv = q.shape[1], k.shape[1], v.shape[3]
    if pad_v:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[3] - dv)))
    if start == 0 and length == t:
        o = jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=True, implementation="cudnn")
    else:
        visible = jnp.arange(length)[None, :] <= start + jnp.arange(t)[:, None]
        o = jax.nn.dot_product_attention(q, k, v, mask=visible[None, None], scale=SCALE, implementation="cudnn")
    return o[..., :dv]


def error_note(exc) -> str:
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "OOM"
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time the tuning variants too")
    ap.add_argument("--tunings", default=SWEEP, help="the --sweep variants")
    ap.add_argument("--sweep-shapes", default="oneshot:8192,chunk:32768",
                    help="kind:L of the shapes the sweep runs at")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; past it sweep variants are skipped")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU; writes nothing under results/")
    args = ap.parse_args(argv)
    global H, DQK, DV, SHAPES
    if args.smoke:
        H, DQK, DV = 2, 48, 32
        SHAPES = [("oneshot", 32, 32, 0), ("chunk", 16, 96, 80)]
        args.tunings, args.sweep_shapes, args.iters, args.sweep = "default;block_q=16,block_k=16", "chunk:96", 1, True
    header = run_header()
    results = {**header, "rows": [], "checks": {}, "skipped": [], "failed": []}
    t_start = time.time()
    sweep = parse_tunings(MLAPrefillTuning(), args.tunings) if args.sweep else []
    sweep_shapes = set(args.sweep_shapes.split(","))
    key = jax.random.key(0)
    for kind, t, length, start in SHAPES:
        name = f"{kind}_T{t}_L{length}"
        kq, kk, kv, key = jax.random.split(key, 4)
        q = jax.random.normal(kq, (1, t, H, DQK), jnp.bfloat16)
        k = jax.random.normal(kk, (1, length, H, DQK), jnp.bfloat16)
        v = jax.random.normal(kv, (1, length, H, DV), jnp.bfloat16)
        flops = 2 * H * (DQK + DV) * visible_pairs(t, start)
        # The correctness inputs: for a chunk, start - 64 with the rows past the chunk NaN.
        st = max(start - POISON_ROWS, 0) if kind == "chunk" else start
        k_chk, v_chk = (a.at[:, st + t:].set(jnp.nan) for a in (k, v))
        reference = jax.jit(lambda q, k, v, s: mla.mla_prefill_attention(q, k, v, s, scale=SCALE))
        try:
            o_ref = reference(q, k_chk, v_chk, jnp.int32(st))
        except Exception as exc:  # an OOM is a result: the checks below then have nothing to compare to
            o_ref = None
            print(f"{name}: reference for the check failed: {error_note(exc)}", flush=True)
        tunings = [MLAPrefillTuning()]
        if f"{kind}:{length}" in sweep_shapes:
            tunings += [tu for tu in sweep if tu != MLAPrefillTuning()]
        variants = [("pallas", tu) for tu in tunings] + [("cudnn", None), ("cudnn_padv", None)]
        if not args.no_reference:
            variants.append(("reference", None))
        for backend, tu in variants:
            note = short(tu) if tu else ""
            if backend == "pallas" and tu != MLAPrefillTuning() and time.time() - t_start > args.budget:
                results["skipped"].append(f"{name}_{note}")
                print(f"skip {name} {note}: past --budget", flush=True)
                continue
            if backend == "pallas":
                fn = jax.jit(lambda q, k, v, s, tu=tu: mla_pallas(q, k, v, s, scale=SCALE, tuning=tu))
            elif backend.startswith("cudnn"):
                fn = jax.jit(lambda q, k, v, s, pad=backend == "cudnn_padv": cudnn_attention(q, k, v, s, pad_v=pad),
                             static_argnums=3)
            else:
                fn = reference
            s_chk, s_run = (x if backend.startswith("cudnn") else jnp.int32(x) for x in (st, start))
            err, error = None, None
            try:
                if backend != "reference" and o_ref is not None:
                    # cuDNN gets the clean rows: it computes every masked score, and 0 · NaN poisons a row.
                    chk = (k_chk, v_chk) if backend == "pallas" else (k, v)
                    err = float(f"{rel_err(fn(q, *chk, s_chk), o_ref):.2e}")
                    results["checks"][f"{name}_{backend}_{note}_rel_err"] = err
                    if backend == "pallas" and not err <= CHECK_TOL:
                        results["failed"].append(f"{name}_{note}: rel err {err:.1e} > {CHECK_TOL}")
                        print(f"FAIL {results['failed'][-1]}", flush=True)
                sec, _ = median_time(fn, q, k, v, s_run, n_rep=args.iters, n_warm=2)
            except Exception as exc:
                sec, error = None, error_note(exc)
                if backend == "pallas" and tu == MLAPrefillTuning():
                    results["failed"].append(f"{name}_pallas_default: {error}")
            row = dict(kind=kind, backend=backend, T=t, L=length, start=start, note=note, rel_err=err,
                       us=None if sec is None else round(sec * 1e6, 1),
                       TFLOPs=None if sec is None else round(flops / sec / 1e12, 1), error=error)
            results["rows"].append(row)
            shown = f"{row['us']:10.1f} µs {row['TFLOPs']:6.1f} TFLOP/s" if sec else f"{'':29s}{error}"
            e = f"err {err:.1e}" if err is not None else ""
            print(f"{name:22s} {backend:9s} {shown} {e:11s} {note}  [{time.time() - t_start:.0f}s]", flush=True)
        del q, k, v, k_chk, v_chk, o_ref
        write_results("bench_mla_prefill.json", results, to_repo=not args.smoke)
    print_table(results["rows"], ["kind", "T", "L", "start", "backend", "us", "TFLOPs", "rel_err", "note", "error"])
    best = {}
    for r in results["rows"]:
        if r["backend"] == "pallas" and r["us"] is not None:
            shape = (r["kind"], r["T"], r["L"])
            if shape not in best or r["us"] < best[shape]["us"]:
                best[shape] = r
    for (kind, t, length), r in best.items():
        print(f"best {kind} T={t} L={length}: {r['us']:.1f} µs, {r['TFLOPs']} TFLOP/s ({r['note']})")
    return finish(results, t_start)


if __name__ == "__main__":
    sys.exit(main())
