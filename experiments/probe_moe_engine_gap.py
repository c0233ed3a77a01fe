"""Probe: why the T = 1 experts kernels run slower in the engine than in the MoE bench's cold chain.

In the engine (bench_decode.py --profile, session 6 call 4) gate/up takes 20.2 µs and down 13.0 µs per layer, both
as kernel duration and as exclusive timeline time, against 18.5 / 11.1 in bench_moe.py's chain of 8 independent
cold layers. The chain differs from a decode step in three ways tested here, one at a time, on the same 8 layers
of Flash-size weights (probe_moe_t1.make_layers), with the production defaults:
  chain8      the bench's chain: 8 layers per call, each on the same x (no data dependence), host sync per call;
  dep32       32 layer calls per call (the 8 layers 4 times), each layer's input the previous layer's output: the
              GPU stays busy for ~1.2 ms, as in a decode block;
  dep32+proj  dep32 with an XLA projection between MoE layers (x · W, W [D, 12288] bf16, 63 MB, a different W
              per layer: the size of a KDA layer's input projections), as attention layers sit between MoE layers.
Per variant: median duration of each MoE kernel, its exclusive time (past the end of every earlier kernel), and
the span per MoE layer (dep32+proj: the span includes the projections; their time is printed too).

`--weights engine` (session 6's calls 8, 9) runs the independent chain on the engine's own MoE weights instead (the
6 MoE layers of bench_decode's slice from `ling_jax.params.init_params`), and a chain through the model's
`ling_jax.layers.moe.moe_block` (the engine's MoE entry, per-layer clamps), to tell the engine's weights and MoE
path apart from the rest of its step.

Result (RESULTS.md, "MoE, session 6"): gate/up 18.5 µs and down 11.0-11.2 in every one of these chains, so none of
them is the cause; the rest of the decode step and its while loop remain.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_moe_engine_gap.py` (`--toy`: CPU smoke run).
"""

from __future__ import annotations

import argparse
import collections
import statistics

import jax
import jax.numpy as jnp

import probe_moe_t1 as pt
from bench_common import run_header, write_results
from profile_ops import call_span_us, exclusive_by_family, kernel_family, split_calls, trace_kernels

OUT = "probe_moe_engine_gap.json"


def kernel_table(events, n_layers):
    """{kernel family: (median duration µs, exclusive µs per MoE layer)} and the span per MoE layer, over the calls
    split_calls keeps (a call cut by the trace is dropped from every figure)."""
    calls = split_calls(events)
    kept = [e for c in calls for e in c]
    dur = collections.defaultdict(list)
    for name, _, d in kept:
        dur[kernel_family(name)].append(d)
    excl = exclusive_by_family(kept)[0]
    span = call_span_us(calls) / n_layers
    n = len(calls) * n_layers
    rows = {k: (round(statistics.median(v), 2), round(excl[k] / n, 2)) for k, v in dur.items()}
    return rows, round(span, 2)


def engine_layers(preset_name):
    """x [1, D] and the MoE layers of bench_decode's 6-layer slice as the engine builds them (init_params, bf16),
    keyed as probe_moe_t1's layers; and block(x, ffn, i): the model's moe_block for layer i."""
    from bench_decode import slice_config
    from ling_jax.layers.moe import moe_block
    from ling_jax.params import init_params

    cfg = slice_config(6, preset_name)
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, with_mtp=False)
    ffns = [lay["ffn"] for lay in params["layers"]]
    names = dict(wg="we_gate", wu="we_up", wd="we_down", sg="ws_gate", su="ws_up", sd="ws_down", router="router",
                 bias="expert_bias")
    layers = [{k: f[v] for k, v in names.items()} | {"ffn": f} for f in ffns]
    x = jax.random.normal(jax.random.key(99), (1, cfg.hidden_size), jnp.bfloat16)
    # the weights come in as arguments of the jitted chain: closed over, they would be 36 GB of HLO constants
    return x, layers, lambda x, ffn, i: moe_block(ffn, x, cfg, i, backend="pallas")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--weights", choices=("chain", "engine"), default="chain")
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    block = None
    if args.weights == "engine":
        x, layers, block = engine_layers("toy" if args.toy else "ling-3.0-flash")
    elif args.toy:
        import probe_moe_fused_router as pf
        x, layers = pf.toy_layers()
    else:
        x, layers = pt.make_layers()
    moe = pt.separate()
    d = x.shape[1]
    projs = [jax.random.normal(jax.random.key(500 + l), (d, 12288 if not args.toy else 256), jnp.bfloat16) * d ** -0.5
             for l in range(len(layers))]

    def chain8(x, layers, projs):
        return [moe(x, lay) for lay in layers]

    def dep32(x, layers, projs, proj=False):
        for _ in range(4):
            for lay, w in zip(layers, projs):
                if proj:  # keep x's shape: the projection's output feeds back as a residual-like mix
                    x = x + (x @ w)[:, :d].astype(x.dtype) * 1e-3
                x = moe(x, lay)
        return x

    variants = {"chain8": (chain8, len(layers)), "dep32": (dep32, 4 * len(layers)),
                "dep32+proj": (lambda x, l, p: dep32(x, l, p, True), 4 * len(layers))}
    if block is not None:  # the model's MoE entry on the engine's weights, each layer with its own clamps
        variants = {"chain": variants["chain8"],
                    "moe_block": (lambda x, l, p: [block(x, lay["ffn"], i) for i, lay in enumerate(l)], len(layers))}
    only = [v for v in args.variants.split(",") if v]
    variants = {k: v for k, v in variants.items() if not only or k in only}
    results = {**run_header(), "rows": []}
    for label, (fn, n_layers) in variants.items():
        run = jax.jit(fn)
        events = trace_kernels(lambda: run(x, layers, projs), args.n)
        if not events:
            print(f"{label}: no GPU events (CPU run)", flush=True)
            continue
        rows, span = kernel_table(events, n_layers)
        results["rows"].append(dict(label=label, span_per_moe_layer=span, kernels=rows))
        print(f"{label:12s} span/MoE layer {span:6.2f} µs  " + "  ".join(
            f"{k} {v[0]} ({v[1]})" for k, v in sorted(rows.items(), key=lambda kv: -kv[1][1])), flush=True)
        write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
