"""Probe: how fast can a Pallas-Triton program structure stream expert rows from HBM? Read-only kernels over the
18 gate/up slabs one MoE layer reads at T = 1 (9 experts × gate, up: [I, D] = [768, 2560] bf16, 70.8 MB), NL = 8
cold layers, device time per kernel (JAX profiler), against XLA's reductions over the same bytes.

Structures (each program owns BI rows of one slab, as the gate/up kernel does):
  tile   [BI, BK] tiles, loop over the D chunks (the gate/up kernel's order: BI rows advance together)
  rowseq one row at a time, each row's five [512] chunks loaded together: a sequential stream per program
  flat   the slab viewed [I·D/BK, BK] (rows of BK contiguous): [BR, BK] tiles, each one contiguous block
  unrolled  [BI, BK] tiles of whole rows, the D/BK loads written out (no loop), so all are issued up front;
         with num_stages 1 they go straight to registers (no cp.async pipeline through shared memory)
Run on the GPU: `PYTHONPATH=. python3 experiments/probe_stream.py --sweep s4` (s3: session 3's call 5).
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
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_t1 import per_kernel_us  # noqa: E402

D, I, NL, NS = 2560, 768, 8, 18
MB = NS * I * D * 2 / 1e6


def tile_kernel(w_ref, o_ref, *, BK):
    s, j = pl.program_id(0), pl.program_id(1)
    bi = o_ref.shape[0]
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)

    def body(c, acc):
        return acc + w_ref[s, rows, pl.ds(pl.multiple_of(c * BK, BK), BK)].astype(jnp.float32)

    o_ref[...] = jnp.sum(lax.fori_loop(0, D // BK, body, jnp.zeros((bi, BK), jnp.float32)), axis=1)


def unrolled_kernel(w_ref, o_ref, *, BK):
    s, j = pl.program_id(0), pl.program_id(1)
    bi = o_ref.shape[0]
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)
    tiles = [w_ref[s, rows, pl.ds(c * BK, BK)] for c in range(D // BK)]
    o_ref[...] = jnp.sum(sum(t.astype(jnp.float32) for t in tiles), axis=1)


def rowseq_kernel(w_ref, o_ref, *, BK):
    s, j = pl.program_id(0), pl.program_id(1)
    bi = o_ref.shape[0]
    r_i = lax.iota(jnp.int32, bi)

    def body(r, acc):
        row = j * bi + r
        tot = jnp.zeros((BK,), jnp.float32)
        for c in range(D // BK):
            tot = tot + w_ref[s, row, pl.ds(c * BK, BK)].astype(jnp.float32)
        return acc + jnp.where(r_i == r, jnp.sum(tot), 0.0)

    o_ref[...] = lax.fori_loop(0, bi, body, jnp.zeros((bi,), jnp.float32))


def flat_kernel(w_ref, o_ref, *, BR, n_steps):
    # w_ref [NS, I·D/BK, BK]; program (s, j) reads sub-rows [j·BR·n_steps, (j+1)·BR·n_steps)
    s, j = pl.program_id(0), pl.program_id(1)

    def body(c, acc):
        rows = pl.ds(pl.multiple_of((j * n_steps + c) * BR, BR), BR)
        return acc + w_ref[s, rows, :].astype(jnp.float32)

    acc = lax.fori_loop(0, n_steps, body, jnp.zeros((BR, w_ref.shape[2]), jnp.float32))
    o_ref[...] = jnp.full((1,), jnp.sum(acc))


def run(kind, warps, stages=3, **kw):
    def f(x, slabs):
        params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
        if kind == "flat":
            bk, br, n_steps = kw["BK"], kw["BR"], kw["n_steps"]
            v = slabs.reshape(NS, I * D // bk, bk)
            n_prog = I * D // bk // (br * n_steps)
            return pl.pallas_call(
                functools.partial(flat_kernel, BR=br, n_steps=n_steps), grid=(NS, n_prog),
                in_specs=[pl.no_block_spec], out_specs=pl.BlockSpec((None, None, 1), lambda s, j: (s, j, 0)),
                out_shape=jax.ShapeDtypeStruct((NS, n_prog, 1), jnp.float32), compiler_params=params,
                name=f"read_{kind}")(v)
        bi = kw["BI"]
        kern = dict(tile=tile_kernel, rowseq=rowseq_kernel, unrolled=unrolled_kernel)[kind]
        return pl.pallas_call(
            functools.partial(kern, BK=kw["BK"]), grid=(NS, I // bi), in_specs=[pl.no_block_spec],
            out_specs=pl.BlockSpec((None, bi), lambda s, j: (s, j)),
            out_shape=jax.ShapeDtypeStruct((NS, I), jnp.float32), compiler_params=params, name=f"read_{kind}")(slabs)
    return f


VARIANTS_S3 = [
    ("tile", 4, dict(BI=8, BK=512)), ("tile", 2, dict(BI=4, BK=512)), ("tile", 4, dict(BI=4, BK=512)),
    ("tile", 8, dict(BI=8, BK=512)), ("tile", 8, dict(BI=16, BK=512)), ("tile", 1, dict(BI=2, BK=512)),
    ("rowseq", 4, dict(BI=8, BK=512)), ("rowseq", 4, dict(BI=4, BK=512)), ("rowseq", 2, dict(BI=8, BK=512)),
    ("rowseq", 8, dict(BI=16, BK=512)), ("rowseq", 4, dict(BI=16, BK=512)),
    ("flat", 4, dict(BK=512, BR=8, n_steps=5)), ("flat", 4, dict(BK=512, BR=16, n_steps=5)),
    ("flat", 8, dict(BK=512, BR=32, n_steps=5)), ("flat", 4, dict(BK=1024, BR=8, n_steps=5)),
    ("flat", 2, dict(BK=512, BR=4, n_steps=10)), ("flat", 8, dict(BK=1024, BR=16, n_steps=5)),
]


VARIANTS_S4 = [  # (kind, warps, kw incl. stages)
    ("tile", 1, dict(BI=2, BK=512)), ("tile", 1, dict(BI=2, BK=512, stages=1)),
    ("unrolled", 1, dict(BI=2, BK=512, stages=1)), ("unrolled", 1, dict(BI=2, BK=512)),
    ("unrolled", 1, dict(BI=1, BK=512, stages=1)), ("unrolled", 1, dict(BI=4, BK=512, stages=1)),
    ("unrolled", 1, dict(BI=2, BK=256, stages=1)), ("unrolled", 2, dict(BI=4, BK=512, stages=1)),
    ("unrolled", 2, dict(BI=2, BK=512, stages=1)), ("unrolled", 4, dict(BI=8, BK=512, stages=1)),
    ("unrolled", 4, dict(BI=4, BK=512, stages=1)), ("unrolled", 8, dict(BI=16, BK=512, stages=1)),
]
SWEEPS = {"s3": VARIANTS_S3, "s4": VARIANTS_S4}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="s4")
    args = ap.parse_args()
    results = {**run_header(), "MB": MB, "sweep": args.sweep, "rows": []}
    slabs = [jax.random.normal(jax.random.key(l), (NS, I, D), jnp.bfloat16) for l in range(NL)]
    x = jnp.zeros((1,), jnp.float32)
    for kind, warps, kw in SWEEPS[args.sweep]:
        label = f"{kind} w{warps} " + " ".join(f"{k}{v}" for k, v in kw.items())
        try:
            ks = per_kernel_us(run(kind, warps, **kw), x, slabs)
        except Exception as exc:  # one variant's failure must not lose the others
            print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        us = sum(v[0] * v[1] for v in ks.values())
        results["rows"].append(dict(label=label, us=us, tb_s=MB / us))
        print(f"{label:40s} {us:7.2f} µs  {MB / us:.2f} TB/s", flush=True)
        write_results("probe_stream.json", results)
    for label, fn in (("XLA row sums", lambda x, w: jnp.sum(w.astype(jnp.float32), axis=2)),
                      ("XLA slab sums", lambda x, w: jnp.sum(w.astype(jnp.float32), axis=(1, 2)))):
        ks = per_kernel_us(fn, x, slabs)
        print(label, ks, flush=True)
        results["rows"].append(dict(label=label, kernels=ks))
    write_results("probe_stream.json", results)


if __name__ == "__main__":
    main()
