"""Probe: the T = 1 down projection read as row slabs instead of 128-byte column stripes.

The down kernel (experts.experts_fwd_kernel_down) streams 35.4 MB in 11.1-11.3 µs (3.2 TB/s) while gate/up streams
70.8 MB at 3.75 TB/s: its programs own 64 output columns and read a 128-byte stripe of each of the 768 rows of
W_down [I, D], so every 5 KB row is fetched in 40 pieces by 40 programs. Here a program owns BR whole rows of one
slot's W_down (BR·5 KB contiguous), reads them in [BR, BN] tiles (h row broadcast to 16 rows, tensor-core dot)
and writes the slot's partial for those rows, fp32 [S, I/BR, D]; XLA sums the partials per slot, rounds each
expert's output to the compute dtype (as the reference) and combines. Against: the current kernel + its XLA
combine, and read-only kernels over the same 9 down slabs (stripe tiles vs row tiles vs the gate/up kernel's
one-warp two-row programs) to separate the access pattern from the arithmetic.

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_moe_down_slabs.py` (`--toy`: CPU interpret smoke run).

As run: with W_down stored [E, I, D] and pallas_kernels/moe/experts.py of its commit (RESULTS.md names it).
Session 10 stores W_down [E, D, I] (probe_moe_t1.make_layers too) and removed `experts._down_cols` / `_dot`;
run this probe at its commit.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
import probe_moe_t1 as pt  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import experts as ex  # noqa: E402

OUT = "probe_moe_down_slabs.json"


def down_inputs(lay, key):
    """Random post-SwiGLU activations h [K + 1, 1, I], K distinct expert ids, routing weights."""
    k1, k2, k3 = jax.random.split(key, 3)
    h = (jax.random.normal(k1, (pt.K + 1, 1, pt.I), jnp.float32) * 0.5).astype(jnp.bfloat16)
    ids = jax.random.permutation(k2, pt.E)[:pt.K].astype(jnp.int32)[None, :]
    w = jax.random.uniform(k3, (1, pt.K), jnp.float32, 0.1, 0.6)
    return h, ids, w


def current_down(h, w, ids, lay):
    tu = ex.DECODE_TUNING
    bki = min(tu.block_ki, pt.I)
    kern = functools.partial(ex.experts_fwd_kernel_down, BKI=bki, n_chunks=pt.I // bki, n_routed=pt.K, group=1,
                             n_groups=pt.K)
    parts = pl.pallas_call(
        kern, grid=(pt.K + 1, pt.D // tu.block_d), in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, 1, tu.block_d), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((pt.K + 1, 1, pt.D), jnp.float32),
        interpret=interpret_mode(),
        compiler_params=pltriton.CompilerParams(num_warps=tu.warps_down, num_stages=tu.stages_down),
        name="experts_fwd_kernel_down",
    )(h, ids.reshape(-1), ids, w, lay["wd"], lay["sd"])
    return jnp.sum(parts[:pt.K], axis=0).astype(h.dtype) + parts[pt.K].astype(h.dtype)


def slab_kernel(h_ref, ids_ref, wd_ref, sd_ref, o_ref, *, BR, BN, n_routed):
    # h_ref [S, 1, I]; ids_ref [K]; wd_ref [E, I, D]; sd_ref [I, D]; o_ref [S, NQ, 1, D] fp32 partials
    s, q = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(pl.multiple_of(q * BR, BR), BR)
    hb = jnp.broadcast_to(h_ref[s, :, rows], (16, BR))
    d = o_ref.shape[-1]

    def run(load):
        def body(c, carry):
            cols = pl.ds(pl.multiple_of(c * BN, BN), BN)
            acc = ex._dot(hb, load(cols))  # [16, BN]
            o_ref[s, q, :, cols] = ex._token_rows(acc, 1)
            return carry

        lax.fori_loop(0, d // BN, body, 0)

    @pl.when(s < n_routed)
    def _():
        e = jnp.sum(jnp.where(lax.iota(jnp.int32, ids_ref.shape[0]) == s, ids_ref[...], 0))
        run(lambda cols: wd_ref[e, rows, cols])

    @pl.when(s == n_routed)
    def _():
        run(lambda cols: sd_ref[rows, cols])


def slab_down(BR=64, BN=256, warps=4, stages=3):
    def f(h, w, ids, lay):
        nq = pt.I // BR
        parts = pl.pallas_call(
            functools.partial(slab_kernel, BR=BR, BN=BN, n_routed=pt.K), grid=(pt.K + 1, nq),
            in_specs=[pl.no_block_spec] * 4, out_specs=pl.no_block_spec,
            out_shape=jax.ShapeDtypeStruct((pt.K + 1, nq, 1, pt.D), jnp.float32),
            interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
            name="down_slabs",
        )(h, ids.reshape(-1), lay["wd"], lay["sd"])
        ys = jnp.sum(parts, axis=1)[:, 0].astype(h.dtype).astype(jnp.float32)  # [S, D]: each expert rounded
        routed = jnp.sum(w[0, :, None] * ys[:pt.K], axis=0)
        return (routed.astype(h.dtype) + ys[pt.K].astype(h.dtype))[None]
    return f


def read_kernel(w_ref, o_ref, *, BR, BN, stripe):
    # stripe: program (s, j) reads column block j of all rows in [BR, BN] tiles; else rows block j, all columns
    s, j = pl.program_id(0), pl.program_id(1)
    i_dim, d = w_ref.shape[1], w_ref.shape[2]
    if stripe:
        cols = pl.ds(pl.multiple_of(j * BN, BN), BN)
        n, tile = i_dim // BR, lambda c: w_ref[s, pl.ds(pl.multiple_of(c * BR, BR), BR), cols]
    else:
        rows = pl.ds(pl.multiple_of(j * BR, BR), BR)
        n, tile = d // BN, lambda c: w_ref[s, rows, pl.ds(pl.multiple_of(c * BN, BN), BN)]
    acc = lax.fori_loop(0, n, lambda c, a: a + tile(c).astype(jnp.float32), jnp.zeros((BR, BN), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=0)[None, :]


def read_down(BR, BN, stripe, warps):
    def f(h, w, ids, lay):
        slabs = lay["wd"]  # the first K + 1 experts' down slabs: (K + 1) × [I, D] bf16 = 35.4 MB
        nj = pt.D // BN if stripe else pt.I // BR
        return pl.pallas_call(
            functools.partial(read_kernel, BR=BR, BN=BN, stripe=stripe), grid=(pt.K + 1, nj),
            in_specs=[pl.no_block_spec], out_specs=pl.BlockSpec((None, 1, BN), lambda s, j: (s, j, 0)),
            out_shape=jax.ShapeDtypeStruct((pt.K + 1, nj, BN), jnp.float32),
            interpret=interpret_mode(), compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3),
            name="read_down")(slabs)
    return f


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    args = ap.parse_args()
    results = {**run_header(), "rows": []}
    if args.toy:
        OUT = "probe_moe_down_slabs_toy.json"
        pt.TO_REPO = False
        pt.D, pt.I, pt.E, pt.NL = 512, 128, 64, 2
    _, layers = pt.make_layers()
    ins = [down_inputs(lay, jax.random.key(50 + n)) for n, lay in enumerate(layers)]
    for lay, (h, ids, w) in zip(layers, ins):
        lay.update(h=h, ids=ids, w=w)

    def rec(label, fn, check=True):
        g = lambda _x, lay: fn(lay["h"], lay["w"], lay["ids"], lay)  # noqa: E731
        ref = (lambda _x, lay: current_down(lay["h"], lay["w"], lay["ids"], lay)) if check else None
        pt.record_row(results, OUT, label, g, jnp.zeros((1,)), layers, ref)

    rec("current down + XLA combine", current_down)
    for br, bn, warps, stages in ((64, 256, 4, 3), (64, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 3),
                                  (64, 256, 8, 3), (128, 256, 8, 3), (64, 256, 4, 4), (16, 512, 4, 3)):
        br, bn = min(br, pt.I), min(bn, pt.D)
        rec(f"slabs BR{br} BN{bn} w{warps} s{stages}", slab_down(br, bn, warps, stages))
    for br, bn, stripe, warps in ((256, 64, True, 4), (64, 256, False, 4), (32, 512, False, 4),
                                  (2, 512, False, 1), (4, 512, False, 1)):
        br, bn = min(br, pt.I), min(bn, pt.D)
        rec(f"read {'stripes' if stripe else 'rows'} BR{br} BN{bn} w{warps}", read_down(br, bn, stripe, warps),
            check=False)
    rec("current down + XLA combine, again", current_down)
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
