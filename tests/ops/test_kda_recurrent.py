"""KDA decode / verify tilings (RecurrentConfig) other than the defaults: BV = 8 (the smallest tile) and BV == V
(the gated norm fused into the kernel).

Each against the pure-jnp reference (fp32, 1e-5) at awkward sizes (T = 7, small H and K). Interpret mode on CPU;
the last test lowers every tiling for sm_90 (and experiments/bench_kda.py's check_default runs them compiled).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import kda
from pallas_kernels.kda import recurrent
from pallas_kernels.kda.reference import layer_inputs, pack
from tests.numerics import input_seed, rel_err

RC = recurrent.RecurrentConfig


def packed_inputs(*a, **kw):
    """layer_inputs with the parts packed as the fused projection writes them (decode and verify's x)."""
    args = layer_inputs(*a, **kw)
    return (pack(*args[:4]), *args[4:])

VERIFY_TILINGS = [
    # (B, T, H, K, cfg)
    (2, 7, 2, 16, RC(BV=8, num_warps=1)),   # two V tiles
    (1, 5, 2, 32, RC(BV=32, num_warps=4)),  # BV == V: norm fused
]


@pytest.mark.parametrize("B,T,H,K,cfg", VERIFY_TILINGS,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-BV{c[4].BV}" for c in VERIFY_TILINGS])
def test_verify_tiling(B, T, H, K, cfg):
    seed = input_seed()
    args = packed_inputs(seed, B, T, H, K)
    y_r, rows_r, states_r = kda.kda_verify(*args)
    y, rows, states = recurrent.verify(*args, cfg=cfg)
    assert rel_err(y, y_r) < 1e-5, seed
    assert rel_err(states, states_r) < 1e-5, seed
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(rows_r))


def test_decode_bv8():
    cfg = RC(BV=8, num_warps=1)
    seed = input_seed()
    args = packed_inputs(seed, 2, 1, 3, 16)
    y_r, w_r, S_r = kda.kda_decode(*args)
    y, w, S = jax.jit(lambda *a: recurrent.decode(*a, cfg=cfg), donate_argnums=2)(*args[:2], jnp.array(args[2]),
                                                                                   *args[3:])
    assert rel_err(y, y_r) < 1e-5, seed
    assert rel_err(S, S_r) < 1e-5, seed
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deferred_norm(mode, dtype):
    """defer_norm: with V split over programs y comes back as the GroupRMS whose apply() is the plain y bit for bit
    (the same fusion, moved), the other outputs unchanged; with BV == V (the norm fused) a plain y either way."""
    from pallas_kernels.common.norm import GroupRMS

    seed = input_seed()
    t = 1 if mode == "decode" else 3
    args = packed_inputs(seed, 1, t, 2, 32, dtype=dtype)
    run = getattr(recurrent, mode)
    for cfg in (RC(BV=8, num_warps=1), RC(BV=32, num_warps=4)):
        y, *rest = run(*args, cfg=cfg)
        y_d, *rest_d = run(*args, cfg=cfg, defer_norm=True)
        assert isinstance(y_d, GroupRMS) == (cfg.BV < 32)
        if cfg.BV < 32:
            assert y_d.sum_sq.shape == (1, t, 2, 32 // cfg.BV) and y_d.group == 32
        got = y_d.apply() if isinstance(y_d, GroupRMS) else y_d
        assert got.dtype == y.dtype and got.shape == y.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(y, np.float32))
        for a, b in zip(rest, rest_d):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_validation():
    with pytest.raises(ValueError, match="BV=4 must be a power of two >= 8"):
        RC(BV=4)
    with pytest.raises(ValueError, match="num_warps=3 must be a power of two"):
        RC(num_warps=3)


def test_tilings_lower_for_sm90():
    from unittest import mock
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    h100 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100), \
            mock.patch.object(recurrent, "interpret_mode", lambda: False):
        a1 = packed_inputs(0, 1, 1, 4, 128, jnp.bfloat16)
        a7 = packed_inputs(0, 1, 7, 4, 128, jnp.bfloat16)
        lower(lambda *a: recurrent.decode(*a, cfg=RC(BV=8, num_warps=1)), *a1)
        for cfg in (RC(BV=8, num_warps=1), RC(BV=16, num_warps=2), RC(BV=128, num_warps=8)):
            lower(lambda *a: recurrent.verify(*a, cfg=cfg), *a7)
