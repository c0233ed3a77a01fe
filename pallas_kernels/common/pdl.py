"""Programmatic dependent launch (PDL, sm_90+) from inside a Pallas-Triton program.

XLA (jax 0.11.2) launches every Triton kernel with programmatic stream serialization and puts
`griddepcontrol.wait` at the entry of each kernel it compiles: the next kernel may be admitted to the GPU before
this one ends, but executes nothing before this one has completed and flushed its memory. By default the next
kernel is admitted only when every program of this one has exited. `launch_dependents()` at the start of a
program admits it as soon as every program of this one has started, so its launch and block distribution overlap
this kernel's tail. It is only a scheduling hint: correctness never depends on it (the successor's entry wait
still orders every read), and it is a no-op when a kernel is launched without PDL.
Measured on the H200 (RESULTS.md, "MoE, session 5"): worth it before a short successor (the XLA combine after the
experts' down kernel); harmful before a wide one (gate/up admitted during the top-k: its waiting programs cost
more than the launch they hide).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common.interpret import interpret_mode

_ASM = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"


def launch_dependents():
    """Let the kernel that follows this one be admitted now (call first in the program; no-op interpreted)."""
    if interpret_mode():
        return
    pid = pl.program_id(0)
    echoed, = pltriton.elementwise_inline_asm(
        _ASM, args=[pid[None]], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])

    # The asm is pure to the compiler: a (never taken) branch on its result keeps it, at the program's start.
    @pl.when(jnp.min(echoed) != pid)
    def _():
        pltriton.debug_barrier()
