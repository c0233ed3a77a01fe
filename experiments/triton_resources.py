"""Registers, spill stack and shared memory of a Pallas-Triton kernel on sm_90, without a GPU.

Lowers the op for CUDA on this (CPU) machine, takes the Triton IR that Pallas put in the custom call, and compiles
it with the `triton` package of the venv (the one torch ships) for sm_90, ptxas included, then reads the cubin's
resource usage. The Triton version differs from the one inside jaxlib, so the numbers are a close proxy, not the
exact binary XLA will run; bench_mla.py's tuning variants are ones that fit by this measure (spills: STACK > 0;
shared memory above 227 KiB cannot launch; wgmma vs mma.sync tells whether Hopper's warpgroup MMA is used).

`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/triton_resources.py --t 1 --tunings "default;block_l=16"`
(about 5 s per variant on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from common import parse_tunings, short
from pallas_kernels.mla.decode import MLADecodeTuning

SMEM_LIMIT = 227 * 1024


def _unescape(s):
    """The MLIR attribute string (\\XX hex escapes) of the `ir = "..."` field -> bytes."""
    out, i = bytearray(), 0
    while s[i] != '"':
        if s[i] == "\\":
            nx = s[i + 1]
            if nx in '\\"':
                out += nx.encode()
                i += 2
            elif nx in "nt":
                out += {"n": b"\n", "t": b"\t"}[nx]
                i += 2
            else:
                out += bytes([int(s[i + 1:i + 3], 16)])
                i += 3
        else:
            out += s[i].encode()
            i += 1
    return bytes(out)


def mla_ir(tuning, t, length):
    """The MLA decode kernel's Triton IR bytecode at Ling shapes, lowered for CUDA on the CPU."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.mla import decode

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    decode.interpret_mode = lambda: False
    sds = jax.ShapeDtypeStruct
    fn = lambda ql, qr, c, s: decode.mla_decode_attention(ql, qr, c, s, scale=192 ** -0.5, tuning=tuning)  # noqa: E731
    txt = jax.jit(fn).trace(sds((1, t, 32, 512), jnp.float32), sds((1, t, 32, 64), jnp.bfloat16),
                            sds((1, length, 576), jnp.bfloat16), sds((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    grid = re.search(r"grid_x = (\d+).*?grid_y = (\d+).*?grid_z = (\d+)", txt).groups()
    return _unescape(txt[txt.index('ir = "') + 6:]), tuple(int(g) for g in grid)


def compile_sm90(ir_bytes, num_warps, num_stages):
    """Registers, spill stack, shared memory and MMA kinds of the Triton IR compiled for sm_90 by the venv's Triton."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    ctx = ir.context()
    ir.load_dialects(ctx)
    CUDABackend(target).load_dialects(ctx)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        bc = os.path.join(d, "k.mlirbc")
        Path(bc).write_bytes(ir_bytes)
        mod = ir.parse_mlir_module(bc, ctx)
        src = os.path.join(d, "k.ttir")
        Path(src).write_text(str(mod))
        k = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(k.asm["cubin"])
        res = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    ptx = k.asm["ptx"]
    regs = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return dict(regs=int(regs.group(1)), stack=int(regs.group(2)), smem=k.metadata.shared,
                wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tunings", default="default")
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--length", type=int, default=8192)
    args = ap.parse_args(argv)
    for tu in parse_tunings(MLADecodeTuning(), args.tunings):
        ir_bytes, grid = mla_ir(tu, args.t, args.length)
        r = compile_sm90(ir_bytes, tu.num_warps, tu.num_stages)
        flag = " SPILLS" if r["stack"] else ""
        flag += " SMEM>227KiB: cannot launch" if r["smem"] > SMEM_LIMIT else ""
        print(f"T={args.t} L={args.length} grid {grid}: regs {r['regs']} stack {r['stack']} B smem "
              f"{r['smem'] // 1024} KiB wgmma {r['wgmma']} mma.sync {r['mma_sync']}{flag}  <- {short(tu)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
