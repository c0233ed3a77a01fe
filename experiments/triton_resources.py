"""Registers, spill stack and shared memory of a Pallas-Triton kernel on sm_90, without a GPU.

Lowers the op for CUDA on this (CPU) machine, takes the Triton IR that Pallas put in the custom call, and compiles
it with the `triton` package of the venv (the one torch ships) for sm_90, ptxas included, then reads the cubin's
resource usage. The Triton version differs from the one inside jaxlib, so the numbers are a close proxy, not the
exact binary XLA will run; bench_mla.py's tuning variants are ones that fit by this measure (spills: STACK > 0;
shared memory above 227 KiB cannot launch; wgmma vs mma.sync tells whether Hopper's warpgroup MMA is used).

`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/triton_resources.py --t 1 --tunings "default;block_l=16"`
(about 5 s per variant on 2 CPU cores).

`--mla-prefill`: the MLA prefill kernel's shared memory in bf16 and float32 beside `prefill.smem_bytes`
(`--tunings` adds variants to the tiling it picks itself).

`--gemv`: the FP8 GEMV levers of bench_gemv.py (`fp8_levers`) at Flash's fused shapes (`LEVER_SHAPES`, with their
norm and residual), with SASS instructions per weight a thread streams: over the whole program (loops counted at
their trip counts: a loop body is the span a backward branch closes) and in the main loop's body alone, plus the
16-byte loads (LDG.128 and cp.async LDGSTS) a thread issues before its first barrier or MMA. `--shapes`, `--ts` and
`--levers` pick a subset: `... triton_resources.py --gemv --ts 1 --shapes kda_in --levers before,d_rows_fma`.
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


def compile_sm90(ir_bytes, num_warps, num_stages, sass=False):
    """Registers, spill stack, shared memory and MMA kinds of the Triton IR compiled for sm_90 by the venv's Triton
    (+ "sass": the cuobjdump SASS text, when asked)."""
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
        text = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout if sass else None
    ptx = k.asm["ptx"]
    regs = re.search(r"REG:(\d+) STACK:(\d+)", res)
    out = dict(regs=int(regs.group(1)), stack=int(regs.group(2)), smem=k.metadata.shared,
               wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))
    if sass:
        out["sass"] = text
    return out


def lowered_kernels(fn, *shapes):
    """[(name, Triton IR bytes, num_warps, num_stages, grid)] of the Pallas-Triton calls in jit(fn) lowered for
    CUDA on this machine (the caller points gpu_info at the target GPU and turns interpret mode off first)."""
    txt = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    out = []
    for m in re.finditer(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32, ", txt):
        rest = txt[m.end():]
        rest = rest[rest.index('ir = "') + 6:]
        out.append((re.search(r'name = "(\w+)"', rest).group(1), _unescape(rest),
                    int(re.search(r"num_warps = (\d+)", rest).group(1)),
                    int(re.search(r"num_stages = (\d+)", rest).group(1)), tuple(int(g) for g in m.groups())))
    return out


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_profile(text):
    """(instructions [(address, text)] without NOPs, loops [(first, last) address] closed by backward branches)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_SASS_LINE.match, text.splitlines())
           if m and not m.group(2).strip().startswith("NOP")]
    loops = []
    for a, op in ins:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    return ins, loops


def loads_up_front(ins):
    """16-byte global loads (LDG.E.128, LDGSTS.128) before the first barrier or MMA: the bytes a thread has in
    flight before it must wait."""
    n = 0
    for _, op in ins:
        if re.match(r"(BAR|HMMA|WARPSYNC|DEPBAR)", op.split(" ", 1)[-1] if op.startswith("@") else op):
            break
        n += bool(re.search(r"(LDG\.E\.128|LDGSTS\.E(\.BYPASS)?\.128)", op))
    return n


def gemv_ir(layout, tuning, t, k, n, with_norm, with_res):
    """(name, Triton IR bytes, num_warps, num_stages, grid) of the FP8 GEMV kernel (kernel.py for IN_OUT, rows.py
    for ROWS) with `tuning` at [T, K] x [K, N], lowered for CUDA on the CPU."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.common import fp8
    from pallas_kernels.gemv import kernel, rows

    gpu_info.get_gpu_info = lambda *a, **kw: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    kernel.interpret_mode = rows.interpret_mode = lambda: False
    sds, nb = jax.ShapeDtypeStruct, -(-k // fp8.BLOCK)
    if layout == fp8.ROWS:
        mod, w = rows, fp8.Fp8Weight(sds((n, k), fp8.FP8_DTYPE), sds((n, nb), jnp.float32), fp8.ROWS)
    else:
        mod, w = kernel, fp8.Fp8Weight(sds((k, n), fp8.FP8_DTYPE), sds((nb, n), jnp.float32))

    def fn(x, w, r, g):
        return mod.gemv(x, w, r if with_res else None, norm=(g, 1e-6) if with_norm else None, tuning=tuning)

    return next(kk for kk in lowered_kernels(fn, sds((t, k), jnp.bfloat16), w, sds((t, n), jnp.bfloat16),
                                             sds((k,), jnp.bfloat16)) if kk[0].startswith("gemv"))


def gemv_trips(layout, tuning, t, k, with_norm):
    """(weights a thread streams per program, columns per main-loop step, the trip counts of the program's loops in
    order) of an FP8 GEMV tuning: what turns SASS counts into instructions per weight."""
    from pallas_kernels.common import fp8

    k_rows = k // tuning.k_splits
    per_thread = tuning.block_n * k_rows / (32 * tuning.num_warps)
    dot = t > 1 or tuning.one_token_dot
    if layout == fp8.ROWS:
        unroll = (not dot) if tuning.unroll is None else tuning.unroll
        return per_thread, fp8.BLOCK * tuning.group, [] if unroll else [k_rows // (fp8.BLOCK * tuning.group)]
    bk = min(tuning.block_k, k_rows & -k_rows)
    steps = k_rows // bk
    main = steps - 1 if dot else steps
    return per_thread, bk, ([k // bk] if with_norm else []) + [main]


def gemv_sass_row(layout, tuning, t, k, n, with_norm, with_res):
    """Registers, spills, shared memory and SASS instructions per weight of one FP8 GEMV variant on sm_90."""
    name, ir_bytes, warps, stages, grid = gemv_ir(layout, tuning, t, k, n, with_norm, with_res)
    r = compile_sm90(ir_bytes, warps, stages, sass=True)
    ins, loops = sass_profile(r.pop("sass"))
    per_thread, step_cols, trips = gemv_trips(layout, tuning, t, k, with_norm)
    bodies = [sum(lo <= a <= hi for a, _ in ins) for lo, hi in loops]
    row = dict(r, grid=grid[:2], sass=len(ins), loads_up_front=loads_up_front(ins))
    if len(bodies) <= len(trips):  # a loop missing is an early one (the norm's) unrolled: its code is all there
        trips = trips[len(trips) - len(bodies):]
        row["per_weight"] = round((len(ins) + sum(b * (n_it - 1) for b, n_it in zip(bodies, trips))) / per_thread, 2)
        if bodies:
            row["loop_per_weight"] = round(bodies[-1] / (tuning.block_n * step_cols / (32 * warps)), 2)
    return row


def gemv_main(args):
    """--gemv: one line per shape, T and lever (module docstring)."""
    from bench_gemv import LEVER_SHAPES, TMA, W8A8, fp8_levers

    names = args.levers.split(",") if args.levers else None
    for shape, k, n, with_res, with_norm in LEVER_SHAPES:
        if args.shapes and shape not in args.shapes.split(","):
            continue
        for t in map(int, args.ts.split(",")):
            for lever, layout, tu in fp8_levers(t, k, n, norm=with_norm):
                if (names and lever not in names) or lever == W8A8 or layout == TMA:  # w8a8.py, Mosaic GPU: not here
                    continue
                r = gemv_sass_row(layout, tu, t, k, n, with_norm, with_res)
                flag = " SPILLS" if r["stack"] else ""
                print(f"{shape:11s} T={t:<2d} {lever:12s} grid {r['grid']} regs {r['regs']} stack {r['stack']} B smem "
                      f"{r['smem'] // 1024} KiB  SASS/weight {r.get('per_weight', '?')} (loop "
                      f"{r.get('loop_per_weight', '-')})  16B loads before first wait {r['loads_up_front']}  "
                      f"mma.sync {r['mma_sync']}{flag}  <- {short(tu)}", flush=True)


def mla_prefill_main(args):
    """--mla-prefill: the MLA prefill kernel at Ling's widths (T = L = --length, Dqk 192, Dv 128) per dtype, with
    the tiling it picks itself (`prefill.fitting_tuning`) and the --tunings given: the compile's shared memory beside
    `prefill.smem_bytes` (exact in bf16, an upper bound in float32)."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.mla import prefill

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    prefill.interpret_mode = lambda: False
    sds = jax.ShapeDtypeStruct
    for dtype in ("bfloat16", "float32"):
        chosen = prefill.fitting_tuning(dtype, 192, 128)
        for tu in [None] + ([] if args.tunings == "default" else parse_tunings(prefill.MLAPrefillTuning(),
                                                                                 args.tunings)):
            [(_, ir, warps, stages, grid)] = lowered_kernels(
                lambda q, k, v, s, tu=tu: prefill.mla_prefill_attention(q, k, v, s, scale=192 ** -0.5, tuning=tu),
                sds((1, args.length, 2, 192), dtype), sds((1, args.length, 2, 192), dtype),
                sds((1, args.length, 2, 128), dtype), sds((), jnp.int32))
            r = compile_sm90(ir, warps, stages)
            est = prefill.smem_bytes(tu or chosen, dtype, 192, 128)
            print(f"mla_prefill {dtype} smem {r['smem']} B estimate {est} B regs {r['regs']} stack {r['stack']} B "
                  f"<- {'fitting ' if tu is None else ''}{short(tu or chosen)}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tunings", default="default")
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--gemv", action="store_true", help="the FP8 GEMV levers instead (module docstring)")
    ap.add_argument("--shapes", default=None, help="--gemv: a subset of bench_gemv.LEVER_SHAPES")
    ap.add_argument("--ts", default="1,4,16", help="--gemv: the token counts")
    ap.add_argument("--levers", default=None, help="--gemv: a subset of the levers (bench_gemv.fp8_levers)")
    ap.add_argument("--mla-prefill", action="store_true",
                    help="the MLA prefill kernel's shared memory per dtype against prefill.smem_bytes")
    args = ap.parse_args(argv)
    if args.gemv:
        return gemv_main(args)
    if args.mla_prefill:
        return mla_prefill_main(args)
    for tu in parse_tunings(MLADecodeTuning(), args.tunings):
        ir_bytes, grid = mla_ir(tu, args.t, args.length)
        r = compile_sm90(ir_bytes, tu.num_warps, tu.num_stages)
        flag = " SPILLS" if r["stack"] else ""
        flag += " SMEM>227KiB: cannot launch" if r["smem"] > SMEM_LIMIT else ""
        print(f"T={args.t} L={args.length} grid {grid}: regs {r['regs']} stack {r['stack']} B smem "
              f"{r['smem'] // 1024} KiB wgmma {r['wgmma']} mma.sync {r['mma_sync']}{flag}  <- {short(tu)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
