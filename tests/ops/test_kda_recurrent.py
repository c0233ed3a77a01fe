"""KDA decode / verify tuning variants (RecurrentConfig): BV = 8, unrolled token loop, hoisted,
vectorised or XLA prologue.

Each variant against the pure-jnp reference (fp32, 1e-5) and, for verify, commit design A against design B
bit for bit, at awkward sizes (T = 7, small H and K). Interpret mode on CPU; the last test lowers every
variant for sm_90 (and experiments/bench_kda.py's check_default runs them all compiled on a GPU).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import kda
from pallas_kernels.kda import recurrent
from tests.numerics import rel_err
from tests.ops.test_kda import fresh_seed, layer_inputs

RC = recurrent.RecurrentConfig
VERIFY_VARIANTS = [
    # (B, T, H, K, cfg)
    (2, 7, 2, 16, RC(BV=8, num_warps=1, prologue="xla")),
    (1, 5, 2, 32, RC(BV=32, num_warps=4, prologue="xla", unroll=True)),   # BV == V: norm fused
    (1, 7, 2, 16, RC(BV=8, num_warps=1, prologue="vec")),                 # T = 7 padded to 8, two V tiles
    (1, 3, 2, 16, RC(BV=8, num_warps=1, prologue="hoist", unroll=True)),  # front half for all T, then the steps
]


@pytest.mark.parametrize("B,T,H,K,cfg", VERIFY_VARIANTS, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-BV{c[4].BV}-"
                                                               f"{c[4].prologue}-u{int(c[4].unroll)}"
                                                               for c in VERIFY_VARIANTS])
def test_verify_variant(B, T, H, K, cfg):
    seed = fresh_seed()
    args = layer_inputs(seed, B, T, H, K)
    y_r, st_r = kda.kda_verify(*args)
    y_a, st_a = recurrent.verify(*args, store="states", cfg=cfg)
    y_b, st_b = recurrent.verify(*args, store="inputs", cfg=cfg)
    assert rel_err(y_a, y_r) < 1e-5, seed
    assert rel_err(st_a.states, st_r.states) < 1e-5, seed
    np.testing.assert_array_equal(np.asarray(y_a), np.asarray(y_b))
    np.testing.assert_array_equal(np.asarray(st_a.conv_rows), np.asarray(st_r.conv_rows))
    np.testing.assert_array_equal(np.asarray(st_b.conv_rows), np.asarray(st_r.conv_rows))
    n = jnp.asarray(np.random.default_rng(seed).integers(1, T + 1, B), jnp.int32)
    # Commit B replays with the same tiling as the verify that staged it: bit-identical to A's stored state.
    Sb = recurrent.replay(st_b.state0, st_b.k, st_b.v, st_b.g, st_b.beta, n, cfg=cfg)
    _, Sa = kda.kda_commit(st_a, n)
    np.testing.assert_array_equal(np.asarray(Sa), np.asarray(Sb))


def test_decode_bv8():
    cfg = RC(BV=8, num_warps=1)
    seed = fresh_seed()
    args = layer_inputs(seed, 2, 1, 3, 16)
    y_r, w_r, S_r = kda.kda_decode(*args)
    y, w, S = jax.jit(lambda *a: recurrent.decode(*a, cfg=cfg), donate_argnums=5)(*args[:5], jnp.array(args[5]),
                                                                                   *args[6:])
    assert rel_err(y, y_r) < 1e-5, seed
    assert rel_err(S, S_r) < 1e-5, seed
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))


def test_config_validation():
    with pytest.raises(ValueError, match="BV=4 must be a power of two >= 8"):
        RC(BV=4)
    with pytest.raises(ValueError, match="prologue=.triton. must be .kernel., .hoist., .vec. or .xla."):
        RC(prologue="triton")
    args = layer_inputs(0, 1, 1, 2, 16)
    with pytest.raises(ValueError, match="applies to verify only"):
        recurrent.decode(*args, cfg=RC(prologue="vec"))


def test_variants_lower_for_sm90():
    from unittest import mock
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    h100 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100), \
            mock.patch.object(recurrent, "interpret_mode", lambda: False):
        a1 = layer_inputs(0, 1, 1, 4, 128, jnp.bfloat16)
        a7 = layer_inputs(0, 1, 7, 4, 128, jnp.bfloat16)
        lower(lambda *a: recurrent.decode(*a, cfg=RC(BV=8, num_warps=1)), *a1)
        for cfg in (RC(BV=8, num_warps=1, prologue="xla"), RC(BV=128, num_warps=8, prologue="xla", unroll=True),
                    RC(BV=16, num_warps=2, unroll=True), RC(BV=16, num_warps=2, prologue="hoist"),
                    RC(BV=8, num_warps=1, prologue="vec")):
            for store in ("states", "inputs"):
                lower(lambda *a: recurrent.verify(*a, store=store, cfg=cfg), *a7)
