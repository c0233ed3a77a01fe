"""The copies XLA inserts into a compiled decode block: compile only (abstract params, no weights), then list every
`copy` instruction outside fused computations, in the loop body (every step) or around it (once per block).

A loop-carried buffer that a kernel rewrites into a fresh buffer instead of in place is copied back into the loop's
buffer every step: KDA's conv window (every V-tile program of a head reads the old one, so the kernel cannot write it
in place). `--double-buffer` compiles with XLA's while-loop double buffering, which unrolls the loop by two so such a
buffer alternates between two instead.

Run on the GPU: `PYTHONPATH=. python3 experiments/decode_copies.py --layers 6 [--double-buffer]` (the exact-width
Flash slice in FP8; a GPU compile, since the CPU's interpret-mode kernels copy differently). `--smoke`: the toy
preset on the CPU, the same code path.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re

import jax
import jax.numpy as jnp

from ling_jax import bench
from ling_jax.cache import cache_len
from ling_jax.config import preset
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.params import abstract_params

DOUBLE_BUFFER = {"xla_gpu_enable_while_loop_double_buffering": True}


def compiled_block(cfg, *, max_len: int, steps: int, double_buffer: bool) -> str:
    """The optimised HLO text of `generate.decode_block` for cfg (bf16 compute, the `fast` backend)."""
    params = abstract_params(cfg, jnp.bfloat16, with_mtp=False)
    eos = jnp.zeros((0,), jnp.int32)
    start = functools.partial(G.start, cfg=cfg, sampler=Greedy(), max_len=max_len, backend="fast",
                              pad_id=bench.pad_id(cfg))
    loop, _ = jax.eval_shape(start, params, jnp.ones((1, 8), jnp.int32), jax.random.key(0), eos)
    lowered = G.decode_block.lower(params, loop, eos, cfg, Greedy(), steps=steps, backend="fast",
                                   pad_id=bench.pad_id(cfg))
    return lowered.compile(compiler_options=DOUBLE_BUFFER if double_buffer else None).as_text()


def copies(hlo: str, steps: int) -> collections.Counter:
    """{(where, shape): count} of the copy instructions outside fused computations of a block of `steps` steps:
    "every step" in the decode loop (and what it calls), else "around the loop" (bench.block_loop)."""
    around, _ = bench.block_loop(hlo, steps)
    found, computation = collections.Counter(), ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
            continue
        copy = re.search(r"= (\S+) copy\(", line)
        if copy and not computation.startswith(("fused", "wrapped")):
            where = "around the loop" if computation in around else "every step"
            found[where, re.sub(r"\{.*", "", copy.group(1))] += 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="the exact-width Flash slice of this many layers")
    ap.add_argument("--dtype", default="fp8", choices=("fp8", "bfloat16"))
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block (the engine's block size)")
    ap.add_argument("--double-buffer", action="store_true", help="compile with XLA's while-loop double buffering")
    ap.add_argument("--smoke", action="store_true", help="the toy preset on the CPU")
    args = ap.parse_args()
    cfg = preset("toy") if args.smoke else bench.bench_config("ling-3.0-flash", args.layers, args.dtype)
    # The latent caches of SGLang's workload (an 8192-token prompt, 1024 tokens out), as `ling-jax bench` sizes them.
    max_len = 64 if args.smoke else cache_len(8192 + 1024 + args.steps)
    hlo = compiled_block(cfg, max_len=max_len, steps=args.steps, double_buffer=args.double_buffer)
    print(f"{jax.devices()[0].device_kind}, {cfg.num_layers} layers, double buffering "
          f"{'on' if args.double_buffer else 'off'}")
    print("| where | shape | copies |\n|---|---|---|")
    for (where, shape), n in sorted(copies(hlo, args.steps).items()):
        print(f"| {where} | {shape} | {n} |")


if __name__ == "__main__":
    main()
