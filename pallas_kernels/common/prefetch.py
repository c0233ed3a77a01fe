"""Asynchronous L2 prefetch from inside a Pallas-Triton program (CUDA sm_90+: `cp.async.bulk.prefetch.L2`).

`prefetch_l2(ref, start, n_bytes)` asks the memory system to bring `n_bytes` of `ref` (flat, from element `start`)
into L2: no registers, no shared memory, nothing to consume. One thread of the program issues it (the TMA unit
splits the range into lines), so a program hands a large range to the memory system for a few instructions, where a
prefetch by loads keeps warps and registers busy until the data is back. A launch that issues prefetches lasts about
until their bytes have landed, and one program's prefetches moved 0.3-0.5 TB/s on the H200, so spread a large range
over many programs and issue it from a launch whose duration is set by latency anyway (the MoE router's top-k).

The lines are inserted with the `evict_normal` policy: `evict_last` measured the same (MoE layer 35.80 µs against
35.83-35.92) and would leave the lines marked to stay in L2 after their use. It is a hint: the data may still come
from HBM, and the result never depends on it.
Emitted only for CUDA GPUs of compute capability 9.0 and up (as `pdl.launch_dependents`); a no-op interpreted.

Constraints (PTX): the address must be 16-byte aligned and the size a multiple of 16; `prefetch_l2` checks the
static size, and the caller the alignment of `start` (a row start of a [.., D] bf16 array with D % 8 == 0 is).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import effects
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.lib.mlir.dialects import arith as arith_dialect
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering

from pallas_kernels.common.interpret import interpret_mode
from pallas_kernels.common.pdl import supports_pdl

MAX_BYTES_PER_INSTRUCTION = 1 << 19  # ptxas takes sizes up to 2^20 - 16; larger ranges are issued in pieces


class PrefetchEffect(effects.Effect):
    """Keeps the (result-less) prefetch in the kernel's jaxpr; it orders nothing."""


prefetch_effect = PrefetchEffect()
pallas_core.kernel_local_effects.add_type(PrefetchEffect)
effects.control_flow_allowed_effects.add_type(PrefetchEffect)

l2_prefetch_p = jax_core.Primitive("l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _l2_prefetch_abstract_eval(ref_aval, start_aval, *, n_bytes):
    del ref_aval, start_aval, n_bytes
    return (), {prefetch_effect}


def _asm(n_bytes: int) -> str:
    # Thread 0 of the program only: the operand is uniform, and every thread issuing it would repeat the request.
    lines = ["{", ".reg .pred p;", ".reg .b32 t;", ".reg .b64 pol;", "mov.u32 t, %tid.x;",
             "setp.eq.u32 p, t, 0;", "createpolicy.fractional.L2::evict_normal.b64 pol, 1.0;"]
    for off in range(0, n_bytes, MAX_BYTES_PER_INSTRUCTION):
        size = min(MAX_BYTES_PER_INSTRUCTION, n_bytes - off)
        lines.append(f"@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1+{off}], {size}, pol;")
    lines += ["mov.u32 $0, 0;", "}"]
    return "\n\t".join(lines)


def emit_asm_at(ctx: lowering.LoweringRuleContext, ptr, start, asm: str):
    """In a Triton lowering rule of a (ref, start) primitive: emit `asm` (side effects, no result used) with $1 the
    64-bit address of the ref's flat element `start` ($0: a dummy 32-bit output the asm must set)."""
    i64 = ir.IntegerType.get_signless(64)
    start = lowering._ensure_ir_value(start, ctx.avals_in[1])
    if ir.IntegerType(start.type).width < 64:
        start = arith_dialect.extsi(i64, start)
    itemsize = jnp.dtype(ctx.avals_in[0].dtype).itemsize
    offset = arith_dialect.muli(start, arith_dialect.constant(i64, ir.IntegerAttr.get(i64, itemsize)))
    addr = arith_dialect.addi(tt_dialect.ptr_to_int(i64, ptr), offset)
    tt_dialect.elementwise_inline_asm([ir.IntegerType.get_signless(32)], asm, constraints="=r,l", pure=False,
                                      packed_element=1, args=[addr])


@lowering.register_lowering(l2_prefetch_p)
def _l2_prefetch_lowering(ctx: lowering.LoweringRuleContext, ptr, start, *, n_bytes):
    emit_asm_at(ctx, ptr, start, _asm(n_bytes))
    return []


def prefetch_l2(ref, start, n_bytes: int) -> None:
    """Prefetch ref's flat elements [start, start + n_bytes / itemsize) into L2 (a hint; a no-op interpreted or
    where the target has no `cp.async.bulk`). `ref`: a whole array ref (pl.no_block_spec), not a view."""
    n_bytes = int(n_bytes)
    if n_bytes <= 0 or n_bytes % 16:
        raise ValueError(f"prefetch_l2: n_bytes={n_bytes} must be a positive multiple of 16 (PTX cp.async.bulk)")
    if getattr(ref, "transforms", ()):
        raise ValueError("prefetch_l2 takes a whole array ref, not a view (`ref.at[...]`); pass an element offset")
    if interpret_mode() or not supports_pdl():  # same arch gate as PDL: CUDA compute capability >= 9.0
        return
    l2_prefetch_p.bind(ref, jnp.asarray(start, jnp.int32), n_bytes=n_bytes)
