"""KDA chunked prefill around its conv pass (``conv.short_conv``, the first pass of ``chunk.prefill``).

The edges of the conv: T < W − 1 (the new window keeps old rows), T inside the first 16-row sub-block, T not a
multiple of the chunk, a nonzero carried window, and the conv taps that cross a sub-block and a chunk boundary.
Checked against the reference layer, and bit for bit against the same kernels on ``reference.short_conv``'s
output. Interpret mode on CPU, compiled on a GPU.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import kda
from pallas_kernels.kda import chunk, conv, reference
from pallas_kernels.kda.reference import layer_inputs
from tests.numerics import input_seed, rel_err

jax.config.update("jax_default_matmul_precision", "highest")

CASES = [
    # (T, dtype, gate): T = 2 < W − 1 (inside sub-block 0, the window rows survive into the new window), 17 (one
    # row past sub-block 0), 70 crosses a chunk boundary (the taps of chunk 1's first rows reach back into
    # chunk 0) and the conv's 16-row blocks. tests/ops/test_kda.py::test_prefill covers T = 1, 7, 64, 100, 300.
    (2, "float32", "mixed"),
    (17, "bfloat16", "strong"),
    (70, "bfloat16", "mixed"),
]


@pytest.mark.parametrize("T,dtype,gate", CASES, ids=[f"T{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_pallas_conv_prefill(T, dtype, gate):
    """The Pallas conv pass in the prefill vs the reference layer, and bit for bit vs the same kernels on the
    reference conv's output (same conv bits, same kernels); f32 and more edges of the conv alone are covered by
    test_short_conv_kernel."""
    seed = input_seed()
    args = layer_inputs(seed, 1, T, 2, 32, jnp.dtype(dtype), gate)
    qkv, f, b, z, window, state, conv_w, A_log, dt_bias, o_norm_w = args
    cfg = chunk.ChunkConfig(BV=32, conv_cfg=conv.ConvConfig(BT=16))
    y, w, S = chunk.prefill(*args, cfg=cfg)
    y_conv, w_x = jax.jit(reference.short_conv)(qkv, window, conv_w)
    y_x, S_x = chunk.core(y_conv, f, b, z, state, A_log, dt_bias, o_norm_w, cfg=cfg)
    y_r, w_r, S_r = kda.kda_prefill(*args)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))
    np.testing.assert_array_equal(np.asarray(w_x), np.asarray(w_r))
    # bf16: the kernels store q̂/k̂/v and W/U/Ã in bf16; measured max over 10 seeds on CPU 3.9e-3 (y), 2.9e-3 (S).
    tol = 1e-4 if dtype == "float32" else 1e-2
    assert rel_err(y, y_r) < tol, seed
    assert rel_err(S, S_r) < tol, seed
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_x), err_msg=f"{seed=}")
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S_x), err_msg=f"{seed=}")


def test_triton_lowering_conv():
    """The prefill lowers for sm_90 with both conv launch orders, with T < one sub-block (only the window-head
    taps) and T = 70."""
    from unittest import mock
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    h100 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100), \
            mock.patch.object(chunk, "interpret_mode", lambda: False), \
            mock.patch.object(conv, "interpret_mode", lambda: False):
        for T in (5, 70):
            a = layer_inputs(0, 1, T, 4, 128, jnp.bfloat16)
            for cfg in (chunk.ChunkConfig(), chunk.ChunkConfig(conv_cfg=conv.ConvConfig(c_fastest=True))):
                lower(lambda *x: chunk.prefill(*x, cfg=cfg), *a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_conv_kernel(dtype):
    """conv.short_conv vs the jitted reference, bit for bit (y and the new window): T < W − 1 (the window rows
    survive), T inside one block, T crossing blocks (the halo rows come from the previous block), a nonzero
    window. Against the *jitted* reference: eager op-by-op execution rounds every product and sum (no FMA
    contraction), so it differs from any compiled form in the last fp32 bit."""
    rng = np.random.default_rng(input_seed())
    H, K, W = 2, 32, 4
    ref = jax.jit(reference.short_conv)
    for T, cfg in [(1, conv.ConvConfig()), (2, conv.ConvConfig()), (5, conv.ConvConfig()),
                   (64, conv.ConvConfig()), (100, conv.ConvConfig()), (100, conv.ConvConfig(BT=8, BC=32)),
                   (100, conv.ConvConfig(BT=16, c_fastest=True))]:
        x = jnp.asarray(rng.standard_normal((2, T, 3, H, K)), dtype)
        window = jnp.asarray(rng.standard_normal((2, W - 1, 3, H, K)), dtype)
        conv_w = jnp.asarray(rng.standard_normal((W, 3, H, K)) * 0.5, jnp.float32)
        y, w = conv.short_conv(x, window, conv_w, cfg=cfg)
        y_r, w_r = ref(x, window, conv_w)
        assert y.dtype == y_r.dtype and w.dtype == w_r.dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_r), err_msg=f"{T=} {cfg}")
        np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r), err_msg=f"{T=} {cfg}")
