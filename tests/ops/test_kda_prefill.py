"""KDA chunked prefill with the conv + SiLU fused into the intra kernel (``ChunkConfig.conv="fused"``) or as a
standalone Pallas pass (``conv="pallas"``, ``conv.short_conv``).

The edges of the fused conv: T < W − 1 (the new window keeps old rows), T inside the first 16-row sub-block,
T not a multiple of the chunk, a nonzero carried window, and the conv taps that cross a sub-block and a chunk
boundary. Checked against the reference layer and against the unfused path (``conv="xla"``), which runs the
same kernels on ``reference.short_conv``'s output. Interpret mode on CPU, compiled on a GPU.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import kda
from pallas_kernels.kda import chunk, conv, reference
from tests.numerics import rel_err
from tests.ops.test_kda import fresh_seed, layer_inputs

jax.config.update("jax_default_matmul_precision", "highest")

CASES = [
    # (T, dtype, gate, split_o): T = 2 < W − 1 (inside sub-block 0, the window rows survive into the new
    # window), 67 and 70 cross a chunk boundary (the taps of chunk 1's first rows reach back into chunk 0).
    # T = 1 (a single row), 17 (one row past sub-block 0) and 100 (a partial second chunk) with split_o off.
    # tests/ops/test_kda.py::test_prefill covers the default (XLA conv) path at T = 1, 7, 64, 100, 300.
    (1, "float32", "strong", False),
    (2, "float32", "mixed", False),
    (17, "bfloat16", "strong", False),
    (100, "float32", "mixed", False),
    (67, "float32", "strong", True),
    (70, "bfloat16", "mixed", True),
]


@pytest.mark.parametrize("T,dtype,gate,split_o", CASES, ids=[f"T{c[0]}-{c[1]}-{c[2]}-split{int(c[3])}" for c in CASES])
def test_fused_conv_prefill(T, dtype, gate, split_o):
    """Fused conv (and the h / o split) vs the reference and vs the XLA-conv, unsplit path."""
    seed = fresh_seed()
    args = layer_inputs(seed, 1, T, 2, 32, jnp.dtype(dtype), gate)
    y, w, S = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=16 if split_o else 32, conv="fused", split_o=split_o))
    y_x, w_x, S_x = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=32, conv="xla"))
    y_r, w_r, S_r = kda.kda_prefill(*args)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))
    np.testing.assert_array_equal(np.asarray(w_x), np.asarray(w_r))
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert rel_err(y, y_r) < tol, seed
    assert rel_err(S, S_r) < tol, seed
    # Same arithmetic: the two paths agree far more tightly than with the reference (bf16: a conv output
    # rounding flip where XLA fuses the taps differently; split_o stores S and Ũ in bf16, which the compiled
    # dots round to anyway but interpret mode's fp32 dots do not).
    tol_x = 1e-5 if dtype == "float32" else 5e-3
    assert rel_err(y, y_x) < tol_x, seed
    assert rel_err(S, S_x) < tol_x, seed


def test_triton_lowering_conv_modes():
    """The conv modes and split_o lower for sm_90, with T < one sub-block (only the window-head taps) and T = 70."""
    from unittest import mock
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    h100 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100), \
            mock.patch.object(chunk, "interpret_mode", lambda: False), \
            mock.patch.object(conv, "interpret_mode", lambda: False):
        for T in (5, 70):
            a = layer_inputs(0, 1, T, 4, 128, jnp.bfloat16)
            for cfg in (chunk.ChunkConfig(conv="fused"), chunk.ChunkConfig(conv="xla"),
                        chunk.ChunkConfig(conv="pallas", conv_cfg=conv.ConvConfig(c_fastest=True)),
                        chunk.ChunkConfig(conv="pallas"), chunk.ChunkConfig(BV=32, conv="fused", split_o=True)):
                lower(lambda *x: chunk.prefill(*x, cfg=cfg), *a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_conv_kernel(dtype):
    """conv.short_conv vs the jitted reference, bit for bit (y and the new window): T < W − 1 (the window rows
    survive), T inside one block, T crossing blocks (the halo rows come from the previous block), a nonzero
    window. Against the *jitted* reference: eager op-by-op execution rounds every product and sum (no FMA
    contraction), so it differs from any compiled form in the last fp32 bit."""
    rng = np.random.default_rng(fresh_seed())
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


def test_pallas_conv_prefill(T=70, dtype="bfloat16"):
    """conv="pallas" vs the reference layer, and bit for bit vs conv="xla" (same conv bits, same kernels); T = 70
    crosses a chunk and the conv's 16-row blocks. f32 and the edge T are covered by test_short_conv_kernel."""
    seed = fresh_seed()
    args = layer_inputs(seed, 1, T, 2, 32, jnp.dtype(dtype))
    y, w, S = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=32, conv="pallas", conv_cfg=conv.ConvConfig(BT=16)))
    y_x, w_x, S_x = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=32, conv="xla"))
    y_r, w_r, S_r = kda.kda_prefill(*args)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert rel_err(y, y_r) < tol, seed
    assert rel_err(S, S_r) < tol, seed
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_x), err_msg=f"{seed=}")
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S_x), err_msg=f"{seed=}")
