"""The Mosaic GPU FP8 GEMV (pallas_kernels/gemv/tma.py) against the reference that dequantises in float32: its
prepared layout, the per-token f16 scaling, K-splits, the norm prologue and the residual. On the CPU the Mosaic GPU
interpreter runs it (the widened tile reaches the tensor cores through shared memory there, from registers on the
GPU); compiled on the GPU. Tolerances: tests/ops/test_gemv_rows.py's for bfloat16 (the same fp32 sums in another
order before the one rounding)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import reference, tma
from tests.numerics import rel_err
from tests.ops.test_gemv_rows import MAX_BF16_MISMATCH, TOL, _inputs, _mismatch_share


@pytest.mark.parametrize("t, n, k_splits, stages, extras", [
    (1, 100, 1, 2, "norm+residual"),  # rows padded 100 -> 128
    (3, 64, 3, 4, "residual"),  # one block per split, fewer steps than stages
    (16, 130, 1, 4, "norm"),
    (5, 200, 1, 3, "norm+residual"),  # 128-row CTAs (two wgmmas), 8 token rows
])
def test_tma_matches_the_reference(t, n, k_splits, stages, extras):
    x, w, w_rows, r, norm = _inputs(400 + t, t, 384, n, jnp.bfloat16)
    r, norm = (r if "residual" in extras else None), (norm if "norm" in extras else None)
    want = reference.gemv(x, w, r, norm=norm)
    tuning = tma.TmaTuning(block_n=128 if n == 200 else 64, k_splits=k_splits, stages=stages)
    got = tma.gemv(x, tma.prepare(w_rows), r, norm=norm, tuning=tuning)
    assert got.shape == (t, n) and got.dtype == jnp.bfloat16
    assert rel_err(got, want) <= TOL[jnp.bfloat16] and _mismatch_share(got, want) <= MAX_BF16_MISMATCH


def test_f16_tokens_hold_the_bf16_range():
    """Tokens at 1e30, 1e-30, 1e-36 (under 2^-112: the largest scaling, 2^126) and zero: scaled exactly into
    f16's range, where a plain cast would overflow or flush."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 256)), jnp.bfloat16)
    x = x * jnp.asarray([[1e30], [1e-30], [1e-36], [0.0]], jnp.bfloat16)
    x16, unscale = tma.f16_tokens(x)
    assert x16.shape == (tma.TOKENS, 256) and x16.dtype == jnp.float16 and bool(jnp.all(x16[4:] == 0))
    assert bool(jnp.all(jnp.isfinite(x16))) and bool(jnp.all(jnp.isfinite(unscale)))
    np.testing.assert_array_equal(np.asarray(x16[:4].astype(jnp.float32) * unscale[:, None]),
                                  np.asarray(x.astype(jnp.float32)))
    assert 2.0 ** 13 <= float(jnp.max(jnp.abs(x16[0].astype(jnp.float32)))) < 2.0 ** 14


def test_tma_refuses_what_it_cannot_run():
    x, _, w_rows, _, _ = _inputs(410, 2, 384, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="k_splits must divide K/128 = 3"):
        tma.gemv(x, tma.prepare(w_rows), tuning=tma.TmaTuning(k_splits=2))
    with pytest.raises(ValueError, match="1..16 bfloat16 tokens"):
        tma.gemv(x.astype(jnp.float32), tma.prepare(w_rows))
    with pytest.raises(ValueError, match="K = x.shape.1. = 256"):
        tma.gemv(x[:, :256], tma.prepare(w_rows))
    with pytest.raises(ValueError, match="block_n=32 must be 64 or 128"):
        tma.TmaTuning(block_n=32)
