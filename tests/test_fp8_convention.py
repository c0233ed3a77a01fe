"""The release's block-FP8 convention, held exactly by both quantisers on constructed blocks.

The -fp8 release (docs/model.md §4, the DeepSeek-V3 format): E4M3 values, and per block a float32
`weight_scale_inv` = block amax / 448 that dequantises as q · scale_inv, so a block's largest magnitude lands on
E4M3's largest finite value, ±448. The host quantiser (conversion/fp8_blocks.py, [out, in] in 128x128 blocks, as
the release) returns that scale_inv; the device one (pallas_kernels/common/fp8.py `quantize`) stores the same
quantity as `Fp8Weight.scale`, per 128x128 block for OUT_IN (the experts), per 128 input rows and output column
for IN_OUT ([in, out], kernel.py's) and per output row and 128 input columns for ROWS (ling-jax's projections
[out, in]). The round-trip bound of tests/test_fp8.py holds for any large enough scale (amax / 240 passes it on
the device); these tests pin the scale itself.

Each block is built with a prescribed amax, reached at one element with + and at another with -, every other value
below 0.9 · amax; the expected scale is the float32 quotient amax / 448, bit for bit on the host. On the device XLA
turns the division by the constant 448 into a product with its float32 reciprocal, which can land one ulp from the
correctly rounded quotient (0.3 / 448 does): the device's scale is held to that ulp, and bit for bit where the
quotient is exact (448, 7 and 56 give 1, 2^-6, 2^-3). An all-zero block has scale 1 (finite, so dequantising gives
zeros, never 0 · inf).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from conversion import fp8_blocks
from pallas_kernels.common import fp8
from tests.numerics import input_seed

E4M3_MAX = 448.0
# Block amaxes: exact quotients (448 -> 1, 7 -> 2^-6, 56 -> 2^-3), inexact ones, tiny and large, and a zero block.
AMAXES = (448.0, 7.0, 56.0, 1.0, 0.3, 1e-3, 3.0e4, 0.0)


def blocked(rows: int, cols: int, br: int, bc: int, seed: int):
    """[rows, cols] float32 whose [br, bc] blocks (the last ones partial) have the amaxes AMAXES in turn -> (w, amax
    grid, positions of +amax, positions of -amax)."""
    rng = np.random.default_rng(seed)
    nbr, nbc = -(-rows // br), -(-cols // bc)
    amax = np.array([AMAXES[(i * nbc + j) % len(AMAXES)] for i in range(nbr) for j in range(nbc)],
                    np.float32).reshape(nbr, nbc)
    w = np.zeros((rows, cols), np.float32)
    plus, minus = [], []
    for i in range(nbr):
        for j in range(nbc):
            r0, r1, c0, c1 = i * br, min((i + 1) * br, rows), j * bc, min((j + 1) * bc, cols)
            a = amax[i, j]
            w[r0:r1, c0:c1] = rng.uniform(-0.9, 0.9, (r1 - r0, c1 - c0)) * a
            if a > 0:  # +amax at the block's last valid element, -amax at its middle one
                cells = [(r, c) for r in range(r0, r1) for c in range(c0, c1)]
                w[cells[-1]], w[cells[len(cells) // 2]] = a, -a
                plus.append(cells[-1])
                minus.append(cells[len(cells) // 2])
    return w, amax, plus, minus


def want_scale(amax: np.ndarray) -> np.ndarray:
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def host(w):
    q, scale_inv = fp8_blocks.quantize(w)
    return q, scale_inv, fp8_blocks.dequantize(q, scale_inv)


def device_out_in(w):
    wq = fp8.quantize(jnp.asarray(w), fp8.OUT_IN)
    return wq.q, wq.scale, fp8.dequantize(wq, jnp.float32)


EXACT = (448.0, 7.0, 56.0, 0.0)  # amaxes whose scale is exact in float32


def check_block_convention(q, scale, dequant, w, amax, plus, minus, zero_cells, ulps=0):
    q32 = np.asarray(q).astype(np.float32)
    scale, want = np.asarray(scale), want_scale(amax)
    assert np.asarray(q).dtype == np.dtype(jnp.float8_e4m3fn) and scale.dtype == np.float32
    exact = np.isin(amax, EXACT)
    np.testing.assert_array_equal(scale[exact], want[exact])
    assert (np.abs(scale - want) <= ulps * np.spacing(want)).all(), (scale, want)
    assert np.isfinite(q32).all() and (np.abs(q32) <= E4M3_MAX).all()
    assert all(q32[p] == E4M3_MAX for p in plus) and all(q32[m] == -E4M3_MAX for m in minus)
    back = np.asarray(dequant)
    assert np.isfinite(back).all()
    assert (back[zero_cells] == 0).all() and (q32[zero_cells] == 0).all()
    # Where amax / 448 is exact the block maximum dequantises to amax itself.
    exact = [p for p in plus + minus if abs(w[p]) in EXACT]
    assert exact and all(back[p] == w[p] for p in exact)


def test_spot_values_of_the_convention():
    assert fp8.FP8_MAX == E4M3_MAX == float(jnp.finfo(jnp.float8_e4m3fn).max)
    assert fp8_blocks.scale_name("model.layers.3.mlp.experts.7.up_proj.weight") == (
        "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv")
    w = np.zeros((128, 128), np.float32)
    w[5, 9], w[100, 3] = 7.0, -7.0
    for q, s, _ in (host(w), device_out_in(w)):
        assert np.asarray(s).tolist() == [[0.015625]]  # 7 / 448 = 2^-6
        q = np.asarray(q).astype(np.float32)
        assert q[5, 9] == 448.0 and q[100, 3] == -448.0
        assert (np.delete(q.ravel(), [5 * 128 + 9, 100 * 128 + 3]) == 0).all()


@pytest.mark.parametrize("shape", [(384, 1024), (200, 300)], ids=["whole blocks", "partial edge blocks"])
def test_host_quantiser_follows_the_release(shape):
    w, amax, plus, minus = blocked(*shape, 128, 128, input_seed(11))
    q, scale_inv, back = host(w)
    assert scale_inv.shape == amax.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    zero = np.repeat(np.repeat(amax == 0, 128, 0)[:shape[0]], 128, 1)[:, :shape[1]]
    check_block_convention(q, scale_inv, back, w, amax, plus, minus, zero)


@pytest.mark.parametrize("shape", [(384, 1024), (200, 300)], ids=["whole blocks", "partial edge blocks"])
def test_device_quantiser_out_in_follows_the_release(shape):
    experts = [blocked(*shape, 128, 128, input_seed(12 + e)) for e in range(2)]
    w = np.stack([x[0] for x in experts])
    wq = fp8.quantize(jnp.asarray(w), fp8.OUT_IN)
    assert wq.layout == fp8.OUT_IN and wq.scale.shape == (2, -(-shape[0] // 128), -(-shape[1] // 128))
    back = np.asarray(fp8.dequantize(wq, jnp.float32))
    for e, (we, amax, plus, minus) in enumerate(experts):
        zero = np.repeat(np.repeat(amax == 0, 128, 0)[:shape[0]], 128, 1)[:, :shape[1]]
        check_block_convention(wq.q[e], wq.scale[e], back[e], we, amax, plus, minus, zero, ulps=1)


@pytest.mark.parametrize("shape, n_in", [((384, 40), 1), ((300, 24), 1), ((3, 100, 24), 2)],
                         ids=["whole blocks", "partial edge block", "two input axes, partial"])
def test_device_quantiser_in_out_follows_the_release(shape, n_in):
    rows, cols = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
    w2, amax, plus, minus = blocked(rows, cols, 128, 1, input_seed(14))
    wq = fp8.quantize(jnp.asarray(w2.reshape(shape)), fp8.IN_OUT, n_in)
    assert wq.scale.shape == (-(-rows // 128),) + shape[n_in:]
    q2, s2 = np.asarray(wq.q).reshape(rows, cols), np.asarray(wq.scale).reshape(-1, cols)
    back = np.asarray(fp8.dequantize(wq, jnp.float32)).reshape(rows, cols)
    zero = np.repeat(amax == 0, 128, 0)[:rows]
    check_block_convention(q2, s2, back, w2, amax, plus, minus, zero, ulps=1)


@pytest.mark.parametrize("quantise", [host, device_out_in], ids=["host", "device"])
def test_an_all_zero_weight_has_a_defined_scale_and_dequantises_to_zeros(quantise):
    q, scale, back = quantise(np.zeros((130, 257), np.float32))  # partial blocks on both axes
    assert np.asarray(scale).shape == (2, 3) and (np.asarray(scale) == 1.0).all()
    assert (np.asarray(q).astype(np.float32) == 0).all()
    np.testing.assert_array_equal(np.asarray(back), np.zeros((130, 257), np.float32))


@pytest.mark.skipif(not hasattr(fp8, "ROWS"), reason="no ROWS layout in pallas_kernels/common/fp8.py")
@pytest.mark.parametrize("shape, n_in", [((40, 384), 1), ((24, 300), 1), ((24, 3, 100), 2)],
                         ids=["whole blocks", "partial edge block", "two input axes, partial"])
def test_device_quantiser_rows_follows_the_release(shape, n_in):
    rows, cols = int(np.prod(shape[:-n_in])), int(np.prod(shape[-n_in:]))
    w2, amax, plus, minus = blocked(rows, cols, 1, 128, input_seed(15))
    wq = fp8.quantize(jnp.asarray(w2.reshape(shape)), fp8.ROWS, n_in)
    assert wq.scale.shape == shape[:-n_in] + (-(-cols // 128),)
    q2, s2 = np.asarray(wq.q).reshape(rows, cols), np.asarray(wq.scale).reshape(rows, -1)
    back = np.asarray(fp8.dequantize(wq, jnp.float32)).reshape(rows, cols)
    zero = np.repeat(amax == 0, 128, 1)[:, :cols]
    check_block_convention(q2, s2, back, w2, amax, plus, minus, zero, ulps=1)
