"""Probe: the router GEMV loading its weights before its own `griddepcontrol.wait` (PDL), so their HBM latency
overlaps the previous kernel.

The T = 1 MoE layer's first kernel, the router GEMV (2560 one-warp programs, 2 KB of fp32 weights each), adds
~2.6 µs to the layer's span although its 5.2 MB take 1.2 µs at 4.3 TB/s: its programs are admitted early (the
previous down kernel's PDL trigger) but wait at their entry, then fetch their weights, which do not depend on the
previous kernel. Here each program loads its weight row split first, then executes `griddepcontrol.wait` (inline
asm taking the loaded values as an operand, so it follows them), then loads x at an offset the asm returns (0, opaque
to the compiler, so the x loads cannot move above the wait) and reduces.

This only helps if XLA does not put its own wait at the kernel's entry. `--ptx DIR` (GPU) compiles the layers at
toy size with `--xla_dump_to=DIR` and counts `griddepcontrol` in every dumped file, per `.entry` where a file holds
PTX; as run (S11 3) the dump held XLA's HLO (the kernels' Triton IR in it as text) but no PTX of the Triton
kernels, so it could not tell. `--sass` (CPU) prints the kernel's memory instructions and its wait (ACQBULK) as
ptxas schedules them for sm_90.

Result (RESULTS.md, "Session 11", S11 3-4): nothing gained, 34.08, 34.12 / 34.08, 34.08 µs against the production
layer's 33.97, 34.03 / 34.07, 34.14 in the same calls; consistent with an XLA wait at the entry, not confirmed.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_gemv_prewait.py --set s11c3` and
`... --ptx /tmp/xla_dump`; `--toy`: a CPU smoke run in interpret mode (the wait is then skipped).
"""

from __future__ import annotations

import glob
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import probe_moe_fused_router as pf
import probe_moe_splitk as ps
import probe_moe_t1 as pt
from pallas_kernels.common import interpret_mode
from pallas_kernels.moe import experts as ex
from pallas_kernels.moe import router as router_mod

F32 = jnp.float32
_WAIT = "griddepcontrol.wait;\n\tmov.b32 $0, 0;"


def wait_after(v):
    """griddepcontrol.wait once v (any array) is available; -> an int32 scalar 0 that the compiler cannot see
    through (index later loads with it to keep them below the wait). Interpreted: 0, no wait."""
    if interpret_mode():
        return jnp.int32(0)
    dep = jax.lax.bitcast_convert_type(jnp.sum(v.astype(F32)), jnp.int32)[None]
    zero, = pltriton.elementwise_inline_asm(_WAIT, args=[dep], constraints="=r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.min(zero)


def gemv_prewait_kernel(x_ref, w_ref, l_ref):
    # x_ref [1, D/KS] compute dtype; w_ref [BE, D/KS] fp32 (one D-split of BE expert rows); l_ref [1, BE] fp32
    w = w_ref[...]  # before the wait: the weights do not depend on the previous kernel
    z = wait_after(w)
    x = x_ref[:, pl.ds(pl.multiple_of(z, 128), x_ref.shape[1])]  # after the wait (its address depends on the asm)
    l_ref[...] = jnp.sum(w * x.astype(F32), axis=1)[None, :]


def gemv_prewait(x, router, tu=router_mod.DECODE_TUNING):
    n, d = x.shape
    e = router.shape[0]
    ks = router_mod._split_count(d, tu.k_splits)
    dk = d // ks
    be = tu.block_e
    return pl.pallas_call(
        gemv_prewait_kernel, grid=(e // be, ks, 1),
        in_specs=[pl.BlockSpec((1, dk), lambda j, k, i: (i, k)), pl.BlockSpec((be, dk), lambda j, k, i: (j, k))],
        out_specs=pl.BlockSpec((None, 1, be), lambda j, k, i: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((ks, 1, e), F32),
        compiler_params=pltriton.CompilerParams(num_warps=tu.num_warps, num_stages=1),
        interpret=interpret_mode(), name="router_fwd_kernel_gemv_prewait",
    )(x, router)


def prewait_layer(x, lay):
    part = gemv_prewait(x, lay["router"])
    w, ids = ps.topk_call(part, lay)
    return ex.moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                **pt.LIMITS)


VARIANTS = {
    "s11c3": lambda: [
        ("dep: production layer", ps.prod_layer, pt.reference_layer),
        ("dep: GEMV weights before its wait", prewait_layer, pt.reference_layer),
        ("dep: production layer again", ps.prod_layer, pt.reference_layer),
        ("dep: GEMV weights before its wait again", prewait_layer, pt.reference_layer),
    ],
}


def ptx_report(dump_dir):
    """Compile both layers at toy size with XLA's dump on and count, per kernel in the PTX, its
    griddepcontrol.wait instructions and the global loads issued before the first."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
    x, layers = pf.toy_layers()
    for fn in (ps.prod_layer, prewait_layer):
        jax.block_until_ready(jax.jit(dependent_pair(fn))(x, layers))
    for path in sorted(glob.glob(os.path.join(dump_dir, "*"))):
        try:
            text = open(path, errors="replace").read()
        except IsADirectoryError:
            continue
        if "griddepcontrol" not in text and not path.endswith(".ptx"):
            continue
        print(f"{os.path.basename(path)[:70]}: griddepcontrol.wait x{text.count('griddepcontrol.wait')}, "
              f"launch_dependents x{text.count('launch_dependents')}", flush=True)
        for m in re.finditer(r"\.entry\s+(\w+)\((.*?)\n\}", text, re.S):
            body = m.group(2)
            first = body.find("griddepcontrol.wait")
            print(f"    {m.group(1)[:60]:60s} waits {body.count('griddepcontrol.wait')} ld.global before the first "
                  f"{body[:first].count('ld.global') if first >= 0 else '-'}", flush=True)


def dependent_pair(fn):
    def run(x, layers):
        for lay in layers:
            x = fn(x, lay)
        return x
    return run


def sass_report():
    """The pre-wait GEMV kernel compiled for sm_90 on this machine: its loads, wait and stores in SASS order."""
    from jax._src.pallas.triton import gpu_info

    import triton_resources as tr

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    sys.modules[__name__].interpret_mode = lambda: False
    sds = jax.ShapeDtypeStruct
    (name, ir_bytes, nw, ns), = tr.lowered_kernels(gemv_prewait, sds((1, pt.D), jnp.bfloat16),
                                                   sds((pt.E, pt.D), F32))
    r = tr.compile_sm90(ir_bytes, nw, ns, sass=True)
    print(f"{name}: {r['regs']} registers")
    for line in r["sass"].splitlines():
        if re.search(r"\b(LDG|STG|ACQBULK|EXIT)", line):
            print("   ", line.split(";")[0].strip())


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass_report()
    elif "--ptx" in sys.argv:
        ptx_report(sys.argv[sys.argv.index("--ptx") + 1])
    else:
        ps.run_sets("probe_gemv_prewait", VARIANTS, "s11c3")
