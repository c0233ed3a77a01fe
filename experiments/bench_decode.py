"""Batch-1 decode TPOT of a Ling-3.0-flash slice on one GPU: exact widths, fewer layers, random bf16 weights.

Question: how far is the engine's decode step (prefill, then jitted blocks of `fori_loop` steps) from the byte
floor, per backend? The slice is `--layers` layers of the real config (5 KDA + 1 MLA per 6, all MoE, the last
layers' SwiGLU clamps, which bite) plus the real embedding and lm_head; a full-model TPOT is extrapolated per layer
and labelled so. Workload as SGLang's: random prompt, greedy, EOS ignored, batch 1. TPOT and TTFT are medians
over `--repeats` generations after a warm-up one; the floor is the step's HBM bytes (weights once, KDA state read
and written, MLA cache read) at 4.3 TB/s. `--profile` adds the device time of a step by kernel family (JAX
profiler), `--tp N` shards the weights N ways over the first N devices (ling_jax/sharding.py) and decodes under
that mesh; its floor is then the step's bytes split N ways, a lower bound (the router, norms and a few small
tensors are read by every device). `--flax` times the same generations through the Flax NNX module too
(`flax_tpot_us`), alternating with the params runs.

    python experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 257 --backends fast,reference \
        --router-dtype bfloat16 --profile

Prints a table and writes experiments/results/bench_decode.json (and $OUT/bench_decode.json when OUT is set).
`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/bench_decode.py --smoke`: the toy preset, 2 layers (KDA, MLA),
a short prompt, one generation (no warm-up) per backend, reference and pallas, on the CPU in interpret mode; it
writes nothing to the repo.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from common import HBM_BYTES_PER_S, run_header, write_results
from ling_jax.bench import (count_launches, kernel_counts, kernels_per_step, op_breakdown, op_family,  # noqa: F401
                            print_breakdown, profile_step, slice_config, step_bytes)
from ling_jax.config import preset
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.flax_model import LingForCausalLM
from ling_jax.params import init_params
from ling_jax.sharding import make_mesh, param_shardings

SMOKE = dict(preset="toy", layers=2, prompt_len=16, new_tokens=9, block_size=4, warmup=0, repeats=1,
             backends="reference,pallas")


def run(args) -> list[dict]:
    cfg = slice_config(args.layers, args.preset).replace(router_weight_dtype=args.router_dtype)
    dtype = jnp.dtype(args.dtype)
    mesh = make_mesh(args.tp) if args.tp > 1 else None
    # Each weight made on its shards directly: made whole on one device first, then resharded, the 6-layer slice's
    # 43 GB expert stack and its copy do not fit beside JAX's preallocation on a 2-GPU H200 machine.
    params = init_params(cfg, jax.random.key(0), dtype, with_mtp=False,
                         shardings=mesh and param_shardings(cfg, mesh, with_mtp=False))
    mesh_ctx = jax.set_mesh(mesh) if mesh else contextlib.nullcontext()
    jax.block_until_ready(params)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, args.prompt_len))
    context = args.prompt_len + args.new_tokens
    moved = step_bytes(cfg, context)
    total = sum(moved.values())
    floor_us = total / (HBM_BYTES_PER_S * max(args.tp, 1)) * 1e6
    full_bytes = sum(step_bytes(preset(args.preset), context).values())
    rows = []
    with mesh_ctx:
        for backend in args.backends.split(","):
            rows.append(run_backend(args, cfg, params, prompt, backend, total, floor_us, full_bytes, moved))
    return rows, moved


def run_backend(args, cfg, params, prompt, backend, total, floor_us, full_bytes, moved) -> dict:
    """TPOT / TTFT medians over args.repeats generations after args.warmup untimed ones (+ the profile if asked)."""
    kwargs = dict(max_new_tokens=args.new_tokens, sampler=Greedy(), backend=backend,
                  block_size=args.block_size, ignore_eos=True)
    module = LingForCausalLM(cfg, params) if args.flax else None
    for _ in range(args.warmup):  # compile + warm up
        G.generate(params, cfg, prompt, **kwargs)
        if module is not None:
            module.generate(prompt, **kwargs)
    tpots, ttfts, flax_tpots = [], [], []
    for _ in range(args.repeats):  # with --flax, params and the module alternate, so drift hits both alike
        res = G.generate(params, cfg, prompt, **kwargs)
        tpots.append(res.tpot_s)
        ttfts.append(res.ttft_s)
        if module is not None:
            flax_tpots.append(module.generate(prompt, **kwargs).tpot_s)
    tpot_us = float(np.median(tpots)) * 1e6
    row = dict(backend=backend, layers=cfg.num_layers, tp=args.tp, tpot_us=tpot_us,
               ttft_ms=float(np.median(ttfts)) * 1e3, bytes_per_step=total, floor_us=floor_us,
               frac_of_floor=floor_us / tpot_us, **kernel_counts(params, cfg, backend),
               # Extrapolation, not a measurement: the full model at the slice's fraction of the floor.
               extrapolated_full_tpot_ms=tpot_us * full_bytes / total / 1e3)
    if module is not None:
        row.update(tpots_us=[t * 1e6 for t in tpots], flax_tpot_us=float(np.median(flax_tpots)) * 1e6,
                   flax_tpots_us=[t * 1e6 for t in flax_tpots])
    if args.profile:
        row["profile"] = profile_step(params, cfg, backend, prompt, args.block_size,
                                      device=0 if args.tp > 1 else None)
        row["breakdown"] = op_breakdown(row["profile"]["families"], moved, tpot_us)
        print_breakdown(row["breakdown"])
    print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "launches_of_first_layers")}),
          flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--preset", default="ling-3.0-flash", help="the config whose widths are sliced")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=257)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations first (compile, warm up)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="reference,pallas")
    parser.add_argument("--profile", action="store_true", help="per-kernel device time of a step (JAX profiler)")
    parser.add_argument("--router-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the MoE routers' dtype (LingConfig.router_weight_dtype): bfloat16 as the BF16 release "
                             "stores them, float32 (LingConfig's default) as transformers' save_pretrained does")
    parser.add_argument("--flax", action="store_true",
                        help="also decode through the Flax NNX module (ling_jax/flax_model.py), alternating with params")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: weights sharded over N devices")
    parser.add_argument("--json", default="bench_decode.json", help="results file name (experiments/results, $OUT)")
    parser.add_argument("--smoke", action="store_true", help="toy preset on the CPU; writes nothing to the repo")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens} must be >= 2: TPOT needs a decode step after the prefill's token")
    if args.smoke:
        vars(args).update(SMOKE)
    header = run_header()
    rows, moved = run(args)
    print(f"slice of {args.layers} layers of {args.preset} x tp {max(args.tp, 1)}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, block {args.block_size}, router {args.router_dtype}")
    print("bytes per step: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in moved.items()))
    print(f"{'backend':10s} {'TPOT us':>9s} {'floor us':>9s} {'of floor':>9s} {'kernels':>8s} {'TTFT ms':>9s} "
          f"{'full model, extrapolated':>25s}")
    for r in rows:
        print(f"{r['backend']:10s} {r['tpot_us']:9.1f} {r['floor_us']:9.1f} {r['frac_of_floor']:9.1%} "
              f"{r['kernels_per_step']:8g} {r['ttft_ms']:9.1f} {r['extrapolated_full_tpot_ms']:22.2f} ms")
        print(f"{'':10s} kernels per layer: " + ", ".join(f"{k} {v}" for k, v in r["kernels_per_layer"].items()))
        for kind, launches in r["launches_of_first_layers"].items():
            print(f"{'':10s} {kind}: " + "; ".join(launches))
    write_results(args.json, dict(args=vars(args), rows=rows, bytes=moved, **header), to_repo=not args.smoke)


if __name__ == "__main__":
    main()
