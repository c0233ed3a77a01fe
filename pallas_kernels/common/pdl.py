"""Programmatic dependent launch (PDL, CUDA sm_90+) from inside a Pallas-Triton program.

XLA (jax 0.11.2) compiles its kernels for sm_90 with a `griddepcontrol.wait` at their entry and launches them with
programmatic stream serialization: such a kernel may be admitted to the GPU before its predecessor ends but executes
nothing before the predecessor has completed and flushed its memory (XLA's InsertPDLPass). By default a successor
is admitted only when every program of its predecessor has exited. `launch_dependents()` at the start of a program
admits it as soon as every program of this kernel has started, so the successor's launch and block distribution
overlap this kernel's tail. It is only a scheduling hint: the successor's entry wait still orders every read, and a
successor launched without PDL (cuBLAS, collectives, copies) waits for this kernel as always. Emitted only for CUDA
GPUs of compute capability 9.0 and up (the PTX instruction does not exist before Hopper; ROCm has none); a no-op
interpreted.
Worth it before a short successor (after the MoE experts' down kernel: T = 1 layer 37.52-37.63 -> 36.92-37.18 µs on
the H200), harmful before a wide one (in the router's top-k, which admits the gate/up programs to wait: +1.2 µs;
experiments/RESULTS.md, "MoE").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax._src.pallas.triton import gpu_info

from pallas_kernels.common.interpret import interpret_mode

_ASM = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"


def supports_pdl() -> bool:
    """Whether the Pallas-Triton target (the one pallas_call lowers for) is a CUDA GPU of compute capability >= 9.0."""
    try:
        arch = gpu_info.get_gpu_info().arch_name  # "9.0" for CUDA; "gfx..." for ROCm
        return float(arch) >= 9.0
    except ValueError:  # no GPU, or a ROCm arch name
        return False


def launch_dependents():
    """Let the kernel that follows this one be admitted now (call first in the program; no-op interpreted and where
    the target has no PDL)."""
    if interpret_mode() or not supports_pdl():
        return
    pid = pl.program_id(0)
    echoed, = pltriton.elementwise_inline_asm(
        _ASM, args=[pid[None]], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])

    # The asm is pure to the compiler: a (never taken) branch on its result keeps it, at the program's start.
    @pl.when(jnp.min(echoed) != pid)
    def _():
        pltriton.debug_barrier()
