"""The Pallas short conv (``ChunkConfig.conv="pallas"``) on the GPU: bitwise vs the XLA reference, its device time
per tiling, then the whole T = 8192 prefill with each conv.

Question: does ``conv.short_conv`` reproduce ``reference.short_conv`` (jitted) bit for bit when compiled, and how
far below XLA's 675 µs (a 474 µs window ++ x concatenate + a 201 µs conv fusion,
experiments/results/kda_prefill_profile.log) does it get at B = 1, T = 8192, H = 32, K = 128 bf16?
The floor: x read once + y written once = 2 × 201 MB = 403 MB → 94 µs at 4.3 TB/s.

1. check: each ConvConfig in VARIANTS at T = 8192 bf16 and the default at T = 7 f32 and T = 100 bf16 (B = 2),
   vs ``jax.jit(reference.short_conv)``: mismatching elements, max |Δ| in units in the last place, rel_err;
   the new window bitwise. (If the compilers contract the multiply-adds into FMAs differently, the fp32 sums differ
   in the last bit: then mismatches > 0 with max ulp 1 (f32) or rare 1-ulp bf16 flips.)
2. conv alone: device µs per variant (JAX profiler, profile_ops.profile) and the XLA reference's kernels.
3. profile_ops kda_prefill8k (conv="xla") vs kda_prefill8k_pconv (conv="pallas", default ConvConfig).

Lead's command (H200, ~60-90 s; timeout leaves margin for first compiles):
  PYTHONPATH=. timeout 150 python3 experiments/check_conv.py
Writes experiments/results/check_conv.json (and $OUT/check_conv.json).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import profile_ops  # noqa: E402
from bench_common import HBM_BYTES_PER_S, run_header, write_results  # noqa: E402

from pallas_kernels.kda import conv, reference  # noqa: E402

H, K, W = 32, 128, 4
VARIANTS = [  # (BT, BC, num_warps, c_fastest); the first is ConvConfig()'s default
    (32, 256, 4, False), (16, 256, 4, False), (16, 512, 4, False), (8, 1024, 4, False), (32, 512, 8, False),
    (32, 256, 4, True), (16, 512, 4, True), (32, 512, 8, True),
]


def inputs(B, T, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, T, 3, H, K)), dtype)
    window = jnp.asarray(rng.standard_normal((B, W - 1, 3, H, K)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((W, 3, H, K)) * 0.5, jnp.float32)
    return x, window, conv_w


@jax.jit
def compare(y, y_r):
    """(mismatches, max |Δ| in ulps, ||y − y_r|| / ||y_r||) on the device."""
    it = jnp.int16 if y.dtype == jnp.bfloat16 else jnp.int32
    ulp = jnp.abs(jax.lax.bitcast_convert_type(y, it).astype(jnp.int32)
                  - jax.lax.bitcast_convert_type(y_r, it).astype(jnp.int32))
    yf, rf = y.astype(jnp.float32), y_r.astype(jnp.float32)
    return jnp.sum(y != y_r), jnp.max(ulp), jnp.linalg.norm(yf - rf) / jnp.linalg.norm(rf)


REF = jax.jit(reference.short_conv)


def check(results, label, args, cfg, ref=None):
    y, w = conv.short_conv(*args, cfg=cfg)
    y_r, w_r = REF(*args) if ref is None else ref
    n_bad, max_ulp, rel = (float(v) for v in compare(y, y_r))
    w_ok = bool(jnp.all(w == w_r))
    ok = n_bad == 0 and w_ok
    row = dict(check=label, cfg=str(cfg), mismatches=int(n_bad), of=int(y.size), max_ulp=int(max_ulp),
               rel_err=rel, window_bitwise=w_ok, bitwise=ok)
    results["checks"].append(row)
    print(f"[check] {label}: {'BITWISE' if ok else 'DIFFERS'} mismatches {int(n_bad)}/{y.size} max_ulp "
          f"{int(max_ulp)} rel_err {rel:.3g} window_bitwise {w_ok}", flush=True)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="T = 64, two variants, no prefill (CPU interpret mode)")
    ap.add_argument("--n", type=int, default=10, help="profiled calls per op")
    ap.add_argument("--quick", action="store_true", help="the default tiling and the last of the sweep only")
    args = ap.parse_args(argv)
    T = 64 if args.smoke else 8192
    results = {**run_header(), "checks": [], "conv": [], "ops": []}
    cfgs = [conv.ConvConfig(BT=bt, BC=bc, num_warps=nw, c_fastest=cf) for bt, bc, nw, cf in VARIANTS]
    tag = lambda c: f"BT{c.BT}_BC{c.BC}_w{c.num_warps}" + ("_cfast" if c.c_fastest else "")  # noqa: E731
    if args.smoke or args.quick:
        cfgs = cfgs[:1] + cfgs[-1:]
    big = inputs(1, T, jnp.bfloat16)
    all_ok = True
    big_ref = REF(*big)
    for cfg in cfgs:
        all_ok &= check(results, f"T{T} bf16 {tag(cfg)}", big, cfg, big_ref)
    del big_ref
    all_ok &= check(results, "T7 f32 B2 default", inputs(2, 7, jnp.float32, 1), conv.ConvConfig())
    all_ok &= check(results, "T100 bf16 B2 default", inputs(2, 100, jnp.bfloat16, 2), conv.ConvConfig())
    all_ok &= check(results, "T100 bf16 B2 cfast", inputs(2, 100, jnp.bfloat16, 2), conv.ConvConfig(c_fastest=True))
    print(f"checks: {'ALL BITWISE' if all_ok else 'NOT ALL BITWISE (see max_ulp)'}", flush=True)

    floor_us = 2 * big[0].nbytes / HBM_BYTES_PER_S * 1e6
    ops = {"conv_xla": lambda b: (REF, big)}
    for cfg in cfgs:
        ops[f"conv_{tag(cfg)}"] = (
            lambda b, cfg=cfg: (jax.jit(lambda *a: conv.short_conv(*a, cfg=cfg)), big))
    profile_ops.OPS.update(ops)
    print(f"\nconv alone, B=1 T={T} bf16 (floor {floor_us:.0f} µs at {HBM_BYTES_PER_S / 1e12} TB/s):", flush=True)
    for name in ops:
        r = profile_ops.profile(name, "pallas", args.n)
        if r is None:
            print(f"  {name}: no GPU events", flush=True)
            continue
        results["conv"].append(r)
        main_k = max(r["kernels"], key=lambda k: k["dur_us"])
        print(f"  {name:30s} kernels {r['kernel_sum_us']:8.1f} µs (largest {main_k['dur_us']:.1f} µs "
              f"{main_k['kernel'][:40]}; {len(r['kernels'])} kernels) = {floor_us / r['kernel_sum_us']:.2f} × floor",
              flush=True)
    for name in () if args.smoke else ("kda_prefill8k", "kda_prefill8k_pconv"):
        r = profile_ops.profile(name, "pallas", args.n)
        if r is None:
            continue
        results["ops"].append(r)
        print(f"\n{name}: span {r['span_us']} µs, kernels {r['kernel_sum_us']} µs", flush=True)
        for k in r["kernels"]:
            print(f"  {k['dur_us']:8.2f} µs  (gap {k['gap_before_us']:5.2f})  {k['kernel']}", flush=True)
    results["all_bitwise"] = bool(all_ok)
    write_results("check_conv.json", results, to_repo=jax.default_backend() == "gpu")


if __name__ == "__main__":
    sys.exit(main())
