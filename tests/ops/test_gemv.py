"""Projections of a few tokens and the greedy lm_head: the reference against `proj` and float64 NumPy, the Pallas
kernels (interpreted on CPU, compiled on a GPU) against the reference, ties and NaN in the greedy pick, and the
dispatcher's and the tuning's error messages.

Sizes stay tiny (K <= 384, N <= 300) so the interpreted kernels run in seconds; N = 300 and 200 are not multiples of
any block width, so every kernel run has a masked last block. The RMSNorm prologue (`norm=`) and block-FP8 weights
(`fp8.Fp8Weight`) have their own cases.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from ling_jax.layers.linear import proj
from ling_jax.layers.norms import rms_norm
from pallas_kernels import gemv
from pallas_kernels.common import fp8
from pallas_kernels.gemv import kernel, reference
from pallas_kernels.gemv.kernel import GemvTuning

K, N = 128, 300
# 64-column blocks: 5 programs per split, the last one 44 columns wide; 32-row steps: 4 per program.
SMALL = GemvTuning(block_n=64, block_k=32)
# Interpreted kernels against the reference in the same dtype, worst of 8 seeds per case on CPU. float32: the same
# fp32 products summed in another order, measured <= 2.5e-7. bfloat16: bit-equal but for a rare fp32 sum that rounds
# to the neighbouring bf16 value, measured <= 3.1e-8; the bound is every entry one bf16 ulp off (<= 2^-7 relative).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _gemv_inputs(seed, t, k, n, dtype):
    rng = np.random.default_rng(input_seed(seed))
    return (_normal(rng, (t, k), dtype), _normal(rng, (k, n), dtype, k ** -0.5), _normal(rng, (t, n), dtype))


def test_reference_is_proj():
    """The reference is the model's `proj` bit for bit (so a later swap changes nothing). Against float64 NumPy on
    the same inputs (worst of 8 seeds): fp32 within summation order, measured 1.9e-7; bf16 the output's rounding,
    measured 1.7e-3, bounded by half a bf16 ulp on every entry (2^-8)."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w, r = _gemv_inputs(0, 5, K, N, dtype)
        y = reference.gemv(x, w)
        assert y.dtype == dtype
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(proj("td,dn->tn", x, w), np.float32))
        np.testing.assert_array_equal(np.asarray(reference.gemv(x, w, r), np.float32),
                                      np.asarray(r + proj("td,dn->tn", x, w), np.float32))
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert rel_err(y, want) <= (1e-6 if dtype == jnp.float32 else 2 ** -8)


GEMV_CASES = {  # T, dtype, residual, K, N, tuning
    "t1-f32": (1, jnp.float32, False, K, N, SMALL),
    "t1-bf16-res": (1, jnp.bfloat16, True, K, N, SMALL),
    "t3-f32-res": (3, jnp.float32, True, K, N, SMALL),
    "t3-bf16": (3, jnp.bfloat16, False, K, N, SMALL),
    "t16-bf16-res": (16, jnp.bfloat16, True, K, N, SMALL),
    "t16-f32": (16, jnp.float32, False, K, N, SMALL),
    # K-splits: fp32 partials summed (and the residual added) outside the kernel.
    "t1-bf16-res-ks2": (1, jnp.bfloat16, True, K, N, GemvTuning(block_n=64, block_k=32, k_splits=2)),
    "t3-f32-res-ks4": (3, jnp.float32, True, K, N, GemvTuning(block_n=128, block_k=64, k_splits=4)),
    # K = 80 is not a multiple of block_k = 64: BK drops to 16 (the largest power of two dividing 80).
    "t1-f32-k80": (1, jnp.float32, False, 80, 40, GemvTuning(block_n=32, block_k=64)),
    "t3-bf16-k80-res": (3, jnp.bfloat16, True, 80, 40, GemvTuning(block_n=32, block_k=64)),
    # The default tuning (16-column blocks at this size).
    "t1-bf16-default": (1, jnp.bfloat16, False, K, N, None),
    # One token by FMAs instead of the padded dot.
    "t1-f32-fma": (1, jnp.float32, False, K, N, GemvTuning(block_n=64, block_k=32, one_token_dot=False)),
    "t1-bf16-res-ks2-fma": (1, jnp.bfloat16, True, K, N, GemvTuning(block_n=64, block_k=32, k_splits=2,
                                                                    one_token_dot=False)),
}


@pytest.mark.parametrize("case", list(GEMV_CASES))
def test_gemv_pallas(case):
    t, dtype, with_res, k, n, tuning = GEMV_CASES[case]
    x, w, r = _gemv_inputs(10, t, k, n, dtype)
    r = r if with_res else None
    y = kernel.gemv(x, w, r, tuning=tuning)
    want = reference.gemv(x, w, r)
    assert y.dtype == dtype and y.shape == (t, n)
    assert rel_err(y, want) <= TOL[dtype]
    if with_res:  # the residual is there (a kernel that dropped it would be this far off)
        assert rel_err(reference.gemv(x, w), want) > 0.1


GROUP_RMS_CASES = {  # T, dtype, K, tuning, group, applied in the prologue
    # One token, plain weights: the K-steps (32 rows) inside each 64-column group, by the dot or by FMAs, K-split.
    "t1-bf16-dot": (1, jnp.bfloat16, 256, SMALL, 64, True),
    "t1-f32-fma-ks2": (1, jnp.float32, 256, GemvTuning(block_n=64, block_k=32, k_splits=2, one_token_dot=False), 64,
                       True),
    "t1-bf16-default": (1, jnp.bfloat16, 256, None, 128, True),
    # XLA scales x first: more tokens, or K-steps wider than a group.
    "t3-bf16": (3, jnp.bfloat16, 256, SMALL, 64, False),
    "t1-bf16-group16": (1, jnp.bfloat16, 256, SMALL, 16, False),
}


@pytest.mark.parametrize("case", list(GROUP_RMS_CASES))
def test_gemv_pallas_group_rms(case):
    """A GroupRMS input (KDA's gated norm with each head's RMS scale still to apply) through kernel.py's plain-weight
    path against the reference on its applied x, within TOL (the prologue sums a group's partial sums of squares in
    another order, which may round that group's scaled x the other way in bf16)."""
    from pallas_kernels.common.norm import GroupRMS

    t, dtype, k, tuning, group, in_prologue = GROUP_RMS_CASES[case]
    rng = np.random.default_rng(input_seed(30))
    g = k // group
    o = rng.standard_normal((t, g, group)) * np.exp(rng.standard_normal((t, g, 1)))
    x = GroupRMS(jnp.asarray((o * (0.5 + rng.random(o.shape))).reshape(t, k), jnp.float32),
                 jnp.asarray((o * o).reshape(t, g, 4, group // 4).sum(-1), jnp.float32), 1e-6, jnp.dtype(dtype).name)
    w, r = _normal(rng, (k, N), dtype, k ** -0.5), _normal(rng, (t, N), dtype)
    assert kernel.takes_group_rms(x, w, tuning) == in_prologue
    want = reference.gemv(x.apply(), w, r)
    for y in (kernel.gemv(x, w, r, tuning=tuning), gemv.gemv(x, w, r, backend="pallas")):
        assert y.dtype == dtype and y.shape == (t, N)
        assert rel_err(y, want) <= TOL[dtype]
    assert rel_err(reference.gemv(x.values.astype(dtype), w, r), want) > 0.1


def test_gemv_dispatch_pallas_matches_reference():
    x, w, r = _gemv_inputs(20, 2, K, N, jnp.bfloat16)
    y = gemv.gemv(x, w, r, backend="pallas")
    assert rel_err(y, gemv.gemv(x, w, r)) <= TOL[jnp.bfloat16]


# Greedy head on integer-valued inputs: every logit is an exact small integer in fp32 whatever the summation order,
# so planted ties are exact ties in the kernel and the reference alike, and rounding to bf16 (multiples of 4-8
# above 512) makes further exact ties among the largest logits.
def _greedy_int_inputs(seed, t, dtype):
    rng = np.random.default_rng(input_seed(seed))
    x = rng.integers(-3, 4, (t, K)).astype(np.float32)
    w = rng.integers(-3, 4, (K, N)).astype(np.float32)
    sign = lambda v: np.where(v >= 0, 1.0, -1.0)  # noqa: E731
    # Column pairs reaching the largest possible logit 3·Σ|x| of one token: lowest index must win.
    w[:, 5] = w[:, 200] = 3 * sign(x[0])  # token 0: blocks 0 and 3 of 64 columns
    if t > 1:
        w[:, N - 1] = 3 * sign(x[1])  # token 1: a unique maximum, the last column of the partial last block
    if t > 2:
        w[:, 127] = w[:, 128] = 3 * sign(x[2])  # token 2: the two sides of the block 1 / block 2 boundary
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


GREEDY_CASES = {  # T, dtype, logits_dtype, tuning
    "t1-f32": (1, jnp.float32, None, SMALL),
    "t3-f32": (3, jnp.float32, None, SMALL),
    "t3-bf16": (3, jnp.bfloat16, None, SMALL),
    "t16-bf16": (16, jnp.bfloat16, None, SMALL),
    "t16-bf16-fp32-logits": (16, jnp.bfloat16, jnp.float32, SMALL),
    "t3-bf16-default": (3, jnp.bfloat16, None, None),  # GREEDY_TUNING: 128-column blocks
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_head_ties(case):
    t, dtype, logits_dtype, tuning = GREEDY_CASES[case]
    x, w = _greedy_int_inputs(30, t, dtype)
    logits = np.asarray(reference.greedy_logits(x, w, logits_dtype))
    # The planted ties are ties, and the largest logits of their tokens.
    assert logits[0, 5] == logits[0, 200] == logits[0].max()
    if t > 2:
        assert logits[2, 127] == logits[2, 128] == logits[2].max()
    want = np.argmax(logits, axis=1)  # NumPy's argmax: the first maximum
    ids_ref, max_ref = reference.greedy_head(x, w, logits_dtype)
    np.testing.assert_array_equal(np.asarray(ids_ref), want)
    ids, max_logit = kernel.greedy_head(x, w, logits_dtype, tuning=tuning)
    assert ids.dtype == jnp.int32 and max_logit.dtype == jnp.float32 and ids.shape == max_logit.shape == (t,)
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_array_equal(np.asarray(max_logit), logits[np.arange(t), want])
    assert want[0] == 5 and (t < 2 or want[1] == N - 1) and (t < 3 or want[2] == 127)
    if t == 16 and logits_dtype is None:  # bf16 rounding made ties beyond the planted ones, and they were met
        n_max = (logits == logits.max(axis=1, keepdims=True)).sum(axis=1)
        assert (n_max[3:] > 1).any()


@pytest.mark.parametrize("t,dtype", [(1, jnp.float32), (4, jnp.bfloat16)])
def test_greedy_head_random(t, dtype):
    """Random normal inputs (no integer structure): the kernel's pick is jnp.argmax of the reference logits and its
    maximum the reference's (fp32 logits: within summation order; bf16 logits: within one bf16 ulp, 2^-8, where
    the fp32 sums round apart)."""
    x, w, _ = _gemv_inputs(40, t, K, N, dtype)
    ids_ref, max_ref = gemv.greedy_head(x, w)
    np.testing.assert_array_equal(np.asarray(ids_ref), np.argmax(np.asarray(reference.greedy_logits(x, w)), axis=1))
    ids, max_logit = gemv.greedy_head(x, w, backend="pallas")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    rtol = 1e-6 if dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(max_logit), np.asarray(max_ref), rtol=rtol)


def test_greedy_head_nan():
    """A NaN logit counts as the largest, the first NaN wins (jnp.argmax); the NaN columns are in blocks 1 and 3."""
    x, w, _ = _gemv_inputs(50, 3, K, N, jnp.float32)
    w = w.at[:, 250].set(jnp.nan).at[:, 90].set(jnp.nan)
    ids_ref, max_ref = reference.greedy_head(x, w)
    np.testing.assert_array_equal(np.asarray(ids_ref), [90, 90, 90])
    ids, max_logit = kernel.greedy_head(x, w, tuning=SMALL)
    np.testing.assert_array_equal(np.asarray(ids), [90, 90, 90])
    assert np.isnan(np.asarray(max_logit)).all() and np.isnan(np.asarray(max_ref)).all()


# RMSNorm prologue: K = 256 in 32-row steps (8 per program, 4 per K-split at k_splits = 2), N = 200 (the last
# 64-column block 8 wide). Tokens at different scales, so every token has its own rsqrt (a kernel that shared one, or
# normed by a K-split's slice alone, would be far off), and a norm weight far from ones.
NK, NN = 256, 200
NORM_EPS = 1e-6
# Worst of 8 seeds over the cases below. float32: summation order in the sum of squares and the products, measured
# <= 3.4e-7. bfloat16: measured <= 1.3e-4, from single outputs one bf16 value apart where an fp32 sum (of squares,
# or of products) rounds the other way; the bound is every output one bf16 ulp off (2^-7) with room for the normed
# inputs' own such flips.
NORM_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# A norm that skipped one of rms_norm's two bf16 roundings is only ~3e-3 off (inside NORM_TOL) but changes over half
# of the bf16 outputs; the kernel's differ from the reference's in at most 0.17% (worst of 8 seeds).
NORM_MAX_BF16_MISMATCH = 0.02


def _mismatch_share(got, want):
    return float((np.asarray(got, np.float32) != np.asarray(want, np.float32)).mean())


def _norm_inputs(seed, t, dtype, weight_dtype, eps=NORM_EPS):
    """x [T, NK] with token i at scale 0.5 + i, w [NK, NN], residual [T, NN], norm (weight [NK], eps)."""
    rng = np.random.default_rng(input_seed(seed))
    x = _normal(rng, (t, NK), jnp.float32) * jnp.asarray(0.5 + np.arange(t), jnp.float32)[:, None]
    weight = _normal(rng, (NK,), jnp.float32, 0.5) + 1.0
    return (x.astype(dtype), _normal(rng, (NK, NN), dtype, NK ** -0.5), _normal(rng, (t, NN), dtype),
            (weight.astype(weight_dtype), eps))


def test_reference_norm_is_rms_norm():
    """The reference's norm is ling_jax's `rms_norm` bit for bit, then `proj` (a norm weight in another dtype too)."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w, r, norm = _norm_inputs(1, 3, dtype, jnp.float32)
        want = proj("td,dn->tn", rms_norm(x, *norm), w)
        np.testing.assert_array_equal(np.asarray(reference.gemv(x, w, norm=norm), np.float32),
                                      np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.asarray(reference.gemv(x, w, r, norm=norm), np.float32),
                                      np.asarray(r + want, np.float32))


@pytest.mark.parametrize("with_res", [False, True], ids=["", "res"])
@pytest.mark.parametrize("k_splits", [1, 2], ids=["ks1", "ks2"])
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gemv_pallas_norm(dtype, t, k_splits, with_res):
    # bf16 inputs take a float32 norm weight at T = 3 (rounded to bf16 in the kernel), their own dtype otherwise.
    weight_dtype = jnp.float32 if t == 3 else dtype
    x, w, r, norm = _norm_inputs(60, t, dtype, weight_dtype)
    r = r if with_res else None
    tuning = GemvTuning(block_n=64, block_k=32, k_splits=k_splits)
    y = kernel.gemv(x, w, r, norm=norm, tuning=tuning)
    want = reference.gemv(x, w, r, norm=norm)
    assert y.dtype == dtype and y.shape == (t, NN)
    assert rel_err(y, want) <= NORM_TOL[dtype]
    if dtype == jnp.bfloat16:
        assert _mismatch_share(y, want) <= NORM_MAX_BF16_MISMATCH
    # The norm is there (a kernel that skipped it, or its weight, would be this far off).
    assert rel_err(reference.gemv(x, w, r), want) > 0.1
    assert rel_err(reference.gemv(x, w, r, norm=(jnp.ones(NK, dtype), NORM_EPS)), want) > 0.1


def test_gemv_pallas_norm_eps():
    """An eps as large as the tokens' mean square: a kernel that dropped it would be far off."""
    x, w, r, norm = _norm_inputs(61, 3, jnp.float32, jnp.float32, eps=1.0)
    y = kernel.gemv(x, w, r, norm=norm, tuning=GemvTuning(block_n=64, block_k=32, k_splits=2))
    want = reference.gemv(x, w, r, norm=norm)
    assert rel_err(y, want) <= NORM_TOL[jnp.float32]
    assert rel_err(reference.gemv(x, w, r, norm=(norm[0], NORM_EPS)), want) > 0.1


def test_gemv_dispatch_pallas_norm_matches_reference():
    x, w, r, norm = _norm_inputs(62, 2, jnp.bfloat16, jnp.float32)
    y = gemv.gemv(x, w, r, norm=norm, backend="pallas")
    assert rel_err(y, gemv.gemv(x, w, r, norm=norm)) <= NORM_TOL[jnp.bfloat16]


def _plant_maxima(x, w, norm, columns):
    """w with column columns[i] set to 0.5·sign of token i's normed input: that token's logit there is
    0.5·Σ|normed x| (~100 at NK = 256), against O(1) in the other columns, so the top logit stands far above the
    rest; a column listed twice for a token is an exact tie (identical columns give identical sums)."""
    xn = np.asarray(reference.rms_norm(x, *norm), np.float32)
    w = np.asarray(w, np.float32).copy()
    for token, cols in enumerate(columns):
        for c in cols:
            w[:, c] = 0.5 * np.where(xn[token] >= 0, 1.0, -1.0)
    return jnp.asarray(w, x.dtype)


@pytest.mark.parametrize("t,dtype", [(1, jnp.float32), (3, jnp.bfloat16), (16, jnp.bfloat16), (16, jnp.float32)])
def test_greedy_head_norm(t, dtype):
    """Planted maxima well above the other logits: the kernel's pick is the planted column, as the reference's, and
    its maximum the reference's (fp32 logits: within summation order; bf16 logits: within one bf16 ulp, 2^-7, where
    the fp32 sums round apart). The maximum depends on each token's rsqrt, which the pick alone would not test."""
    x, w, _, norm = _norm_inputs(70, t, dtype, jnp.float32)
    planted = [(17 * i + 3) % NN for i in range(t)]
    w = _plant_maxima(x, w, norm, [[c] for c in planted])
    ids_ref, max_ref = reference.greedy_head(x, w, norm=norm)
    np.testing.assert_array_equal(np.asarray(ids_ref), planted)
    ids, max_logit = kernel.greedy_head(x, w, norm=norm, tuning=SMALL)
    np.testing.assert_array_equal(np.asarray(ids), planted)
    rtol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(np.asarray(max_logit), np.asarray(max_ref), rtol=rtol)
    _, max_unnormed = reference.greedy_head(x, w)
    assert not np.allclose(np.asarray(max_unnormed), np.asarray(max_ref), rtol=0.1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_greedy_head_norm_ties(dtype):
    """Exact ties after the norm, each between identical columns: the lowest index wins (jnp.argmax). Token 0: blocks
    0 and 3 (the partial last block) of SMALL's 64 columns; token 1: a unique maximum in the last column; token 2:
    the two sides of the block 1 / block 2 boundary. The default tuning (128-column blocks) through the dispatcher
    too."""
    x, w, _, norm = _norm_inputs(80, 3, dtype, jnp.float32)
    w = _plant_maxima(x, w, norm, [[5, 195], [NN - 1], [127, 128]])
    logits = np.asarray(reference.greedy_logits(x, w, norm=norm))
    assert logits[0, 5] == logits[0, 195] == logits[0].max() and logits[2, 127] == logits[2, 128] == logits[2].max()
    want = [5, NN - 1, 127]
    np.testing.assert_array_equal(np.asarray(reference.greedy_head(x, w, norm=norm)[0]), want)
    np.testing.assert_array_equal(np.asarray(kernel.greedy_head(x, w, norm=norm, tuning=SMALL)[0]), want)
    np.testing.assert_array_equal(np.asarray(gemv.greedy_head(x, w, norm=norm, backend="pallas")[0]), want)


def test_default_tuning_splits_flash_shapes():
    """The default tuning of every Flash projection is a valid split of K with enough programs (or the most splits
    MIN_SPLIT_ROWS allows)."""
    for k, n in [(2560, 4096), (4096, 2560), (2560, 576), (2560, 32 * 192), (2560, 157184), (K, N)]:
        tu = kernel.default_tuning(1, k, n)
        ks = tu.k_splits
        assert k % ks == 0 and (k // ks) % 16 == 0
        programs = -(-n // tu.block_n) * ks
        assert programs >= kernel.MIN_PROGRAMS or k // (2 * ks) < kernel.MIN_SPLIT_ROWS or (k // (2 * ks)) % 16


def test_tuning_errors():
    with pytest.raises(ValueError, match=r"GemvTuning.block_n=24 must be a power of two >= 16"):
        GemvTuning(block_n=24)
    with pytest.raises(ValueError, match=r"GemvTuning.block_k=8 must be a power of two >= 16"):
        GemvTuning(block_k=8)
    with pytest.raises(ValueError, match=r"GemvTuning.num_warps=3 must be a power of two"):
        GemvTuning(num_warps=3)
    with pytest.raises(ValueError, match=r"GemvTuning.k_splits=0 must be an integer >= 1"):
        GemvTuning(k_splits=0)
    with pytest.raises(ValueError, match=r"GemvTuning.num_stages=0 must be an integer >= 1"):
        GemvTuning(num_stages=0)
    x, w, _ = _gemv_inputs(0, 1, K, N, jnp.float32)
    with pytest.raises(ValueError, match=r"GemvTuning.k_splits=3 must split K=128 into equal slices"):
        kernel.gemv(x, w, tuning=GemvTuning(k_splits=3))
    with pytest.raises(ValueError, match=r"GemvTuning.k_splits=16 must split K=128 into equal slices of a multiple"):
        kernel.gemv(x, w, tuning=GemvTuning(k_splits=16))
    with pytest.raises(ValueError, match=r"GemvTuning.k_splits=2: greedy_head keeps its logits in registers"):
        kernel.greedy_head(x, w, tuning=GemvTuning(k_splits=2))


def test_dispatch_errors():
    x, w, r = _gemv_inputs(0, 2, K, N, jnp.float32)
    with pytest.raises(ValueError, match=r"x.shape=\(128,\) must be \[T, K\]"):
        gemv.gemv(x[0], w)
    with pytest.raises(ValueError, match=r"x.dtype=float16 must be one of \['float32', 'bfloat16'\]"):
        gemv.gemv(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match=r"w.shape=\(128, 4, 75\) must be \[K, N\] \(a \[D, H, Dh\] projection: "
                                         r"reshape it to \[D, H·Dh\]"):
        gemv.gemv(x, w.reshape(K, 4, 75))
    with pytest.raises(ValueError, match=r"w.shape=\(300, 128\) must be \[K, N\] \(\[in, out\]\) with K = x.shape\[1\] "
                                         r"= 128 \(torch's \[out, in\] layout: .* pass w.T\)"):
        gemv.gemv(x, w.T)
    with pytest.raises(ValueError, match=r"w.shape=\(64, 300\) must be \[K, N\] \(\[in, out\]\) with K = "
                                         r"x.shape\[1\] = 128$"):
        gemv.gemv(x, w[:64])
    with pytest.raises(ValueError, match=r"w.dtype=bfloat16 must be one of \['float32'\]"):
        gemv.gemv(x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"residual.shape=\(2, 299\) must be \[T, N\] = \(2, 300\)"):
        gemv.gemv(x, w, r[:, 1:])
    with pytest.raises(ValueError, match=r"residual.dtype=bfloat16 must be one of \['float32'\]"):
        gemv.gemv(x, w, r.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="backend='triton' must be one of"):
        gemv.gemv(x, w, backend="triton")
    with pytest.raises(ValueError, match=r"w.shape=\(300, 128\) must be \[K, V\]"):
        gemv.greedy_head(x, w.T)
    with pytest.raises(ValueError, match=r"logits_dtype='float8' must be None \(x's dtype\) or one of"):
        gemv.greedy_head(x, w, logits_dtype="float8")
    with pytest.raises(ValueError, match=r"logits_dtype=<class 'jax.numpy.float16'> must be None"):
        gemv.greedy_head(x, w, logits_dtype=jnp.float16)
    g = jnp.asarray(np.linspace(0.5, 1.5, K), jnp.float32)
    for fn in (gemv.gemv, gemv.greedy_head):
        with pytest.raises(ValueError, match=r"norm \(a \w+\) must be None or a \(weight \[K\], eps\) pair"):
            fn(x, w, norm=g)
        with pytest.raises(ValueError, match=r"norm weight.shape=\(127,\) must be \[K\] = \(128,\)"):
            fn(x, w, norm=(g[1:], 1e-6))
        with pytest.raises(ValueError, match=r"norm weight.dtype=int32 must be a float dtype"):
            fn(x, w, norm=(g.astype(jnp.int32), 1e-6))
        for eps in (0.0, -1e-6, float("nan"), 1, jnp.float32(1e-6)):
            with pytest.raises(ValueError, match=r"norm eps=.* must be a positive finite Python float"):
                fn(x, w, norm=(g, eps))
    # The Pallas limits are errors (the reference takes these sizes).
    x17, w17, _ = _gemv_inputs(0, 17, K, N, jnp.float32)
    assert gemv.gemv(x17, w17).shape == (17, N)
    for fn in (gemv.gemv, gemv.greedy_head):
        with pytest.raises(ValueError, match=r"the Pallas GEMV takes 1 <= T <= 16 tokens; got T=17"):
            fn(x17, w17, backend="pallas")
    x72, w72, _ = _gemv_inputs(0, 1, 72, 40, jnp.float32)
    assert gemv.gemv(x72, w72).shape == (1, 40)
    with pytest.raises(ValueError, match=r"the Pallas GEMV needs K=72 \(w.shape\[0\]\) divisible by 16"):
        gemv.gemv(x72, w72, backend="pallas")


# Block-FP8 weights (IN_OUT: q [K, N] E4M3, scale [ceil(K/128), N] fp32). The weight's 128-row blocks are at scales
# 1/4, 1, 4 in turn and its columns at log-normal scales, so every block and column has its own scale: a kernel that
# took a neighbouring block's or column's scale row would be far off (checked below).


def _fp8_inputs(seed, t, k, n, dtype):
    """x [T, K] with token i at scale 0.5 + i, w an Fp8Weight [K, N], residual [T, N] at the outputs' scales, norm
    (weight [K], eps)."""
    rng = np.random.default_rng(input_seed(seed))
    rows = np.repeat(4.0 ** (np.arange(math.ceil(k / fp8.BLOCK)) % 3 - 1), fp8.BLOCK)[:k, None]
    cols = np.exp(rng.standard_normal((1, n)))
    tokens = (0.5 + np.arange(t))[:, None]
    w = fp8.quantize(jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5 * rows * cols, jnp.float32))
    x = jnp.asarray(rng.standard_normal((t, k)) * tokens, dtype)
    r = jnp.asarray(rng.standard_normal((t, n)) * tokens * cols, dtype)
    weight = jnp.asarray(rng.standard_normal(k) * 0.5 + 1.0, jnp.float32)
    return x, w, r, (weight, NORM_EPS)


def _misscaled(w):
    """w with every block taking its neighbour's scale, along K and along N."""
    return fp8.Fp8Weight(w.q, jnp.roll(w.scale, 1, axis=(0, 1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reference_fp8_keeps_float32_weight(dtype):
    """The reference dequantises in float32 as NumPy does (q·scale, a float32 multiply, never rounded to x's dtype)
    and multiplies x widened to float32: float64 NumPy on that weight (worst of 8 seeds: fp32 within summation order,
    measured 3.0e-7; bf16 the output's one rounding, measured 2.0e-3, bounded by half a bf16 ulp on every entry,
    2^-8). With norm and residual it is the fp32 product of the normed input, rounded once, plus the residual, bit
    for bit. A weight rounded to bf16 first (what XLA's prefill GEMMs take) changes >= 37 % of the bf16 outputs
    (8 seeds), far outside FP8_MAX_BF16_MISMATCH. K = 384: three scale blocks."""
    k, n = 384, 96
    x, w, r, norm = _fp8_inputs(90, 5, k, n, dtype)
    scale = np.repeat(np.asarray(w.scale), fp8.BLOCK, axis=0)[:k]
    w_np = np.asarray(w.q).astype(np.float32) * scale
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(w, jnp.float32)), w_np)
    y = reference.gemv(x, w)
    assert y.dtype == dtype and y.shape == (5, n)
    assert rel_err(y, np.asarray(x, np.float64) @ w_np.astype(np.float64)) <= (1e-6 if dtype == jnp.float32
                                                                                else 2 ** -8)
    y_f32_input = reference.gemv(reference.rms_norm(x, *norm).astype(jnp.float32), jnp.asarray(w_np))
    np.testing.assert_array_equal(np.asarray(reference.gemv(x, w, r, norm=norm), np.float32),
                                  np.asarray(r + y_f32_input.astype(dtype), np.float32))
    if dtype == jnp.bfloat16:
        assert _mismatch_share(reference.gemv(x, fp8.dequantize(w, dtype)), y) > 0.2


FP8_CASES = {  # T, dtype, K, N, norm, residual, tuning (N = 96 is ragged at 64-column blocks)
    # One token by FMAs in 32-row chunks (K = 128: one step; K-splits of 128 rows: one step each).
    "t1-f32-k128-n64-fma": (1, jnp.float32, 128, 64, False, False,
                            GemvTuning(block_n=64, block_k=128, one_token_dot=False)),
    "t1-f32-k384-n96-ks3-fma-norm": (1, jnp.float32, 384, 96, True, False,
                                     GemvTuning(block_n=64, block_k=128, k_splits=3, one_token_dot=False)),
    # BK 256: two scale blocks per step, each with its own scale row; 32 columns: 8-byte vectors.
    "t1-bf16-k256-n64-bk256-fma-res": (1, jnp.bfloat16, 256, 64, False, True,
                                       GemvTuning(block_n=32, block_k=256, one_token_dot=False)),
    # BK 64: a 128-row scale block over two steps; the second 192-row K-split starts inside scale block 1.
    "t1-bf16-k384-n96-ks2-fma-norm-res": (1, jnp.bfloat16, 384, 96, True, True,
                                          GemvTuning(block_n=64, block_k=64, k_splits=2, one_token_dot=False)),
    # K = 80 < 128: one scale row, 16-row steps (the largest power of two dividing 80), 16-row chunks.
    "t1-bf16-k80-n40-fma": (1, jnp.bfloat16, 80, 40, False, False,
                            GemvTuning(block_n=32, block_k=64, one_token_dot=False)),
    # One token by the hand-pipelined dot (two steps: the loop runs once, then the last step).
    "t1-bf16-k256-n96-res-dot": (1, jnp.bfloat16, 256, 96, False, True, GemvTuning(block_n=64, block_k=128)),
    # More tokens: the dot, fp32 x by the full-precision dot.
    "t3-f32-k256-n96-bk256-norm-res": (3, jnp.float32, 256, 96, True, True, GemvTuning(block_n=64, block_k=256)),
    "t3-bf16-k384-n96-ks2-norm": (3, jnp.bfloat16, 384, 96, True, False,
                                  GemvTuning(block_n=64, block_k=64, k_splits=2)),
    "t3-bf16-k80-n40": (3, jnp.bfloat16, 80, 40, False, False, GemvTuning(block_n=32, block_k=64)),
    # K-splits of one step: the hand-pipelined loop runs no iteration, only the last step.
    "t16-bf16-k384-n64-ks3-res": (16, jnp.bfloat16, 384, 64, False, True,
                                  GemvTuning(block_n=32, block_k=128, k_splits=3)),
    "t16-f32-k384-n96-ks2-norm-res": (16, jnp.float32, 384, 96, True, True,
                                      GemvTuning(block_n=64, block_k=64, k_splits=2)),
    "t16-bf16-k256-n96-norm-res": (16, jnp.bfloat16, 256, 96, True, True, GemvTuning(block_n=64, block_k=128)),
    # The defaults (kernel._fp8_default_tuning): FMAs at T = 1, the dot above; three 128-row steps.
    "t1-bf16-k384-n96-default-norm-res": (1, jnp.bfloat16, 384, 96, True, True, None),
    "t3-bf16-k384-n96-default-res": (3, jnp.bfloat16, 384, 96, False, True, None),
}
# Interpreted kernels against the reference, worst of 8 seeds over FP8_CASES. The kernel computes the reference's
# sums, scale[b, n] · (sum over block b of x[k]·q[k, n]) in fp32, so only fp32 rounding and summation order differ
# before the output's one rounding. float32 x: measured <= 3.4e-7 (bound 1e-5, the file's TOL). bfloat16 x: an
# output differs from the reference only where that ~1e-7 relative difference straddles a bf16 rounding boundary
# (one bf16 ulp, <= 2^-7 relative, on that entry), or where the norm's fp32 sum of squares rounds a normed input the
# other way; measured <= 1.2e-5 with <= 0.1 % of the entries one ulp apart. The bounds, 1e-3 and 1 % of the
# entries, hold a few such flips and no more: the old numerics (the dequantised weight rounded to bf16) were
# 5e-4..2e-3 off with 8-35 % of the entries apart (measured on these cases).
FP8_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3}
FP8_MAX_BF16_MISMATCH = 0.01


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_gemv_pallas_fp8(case):
    t, dtype, k, n, with_norm, with_res, tuning = FP8_CASES[case]
    x, w, r, norm = _fp8_inputs(100, t, k, n, dtype)
    r, norm = (r if with_res else None), (norm if with_norm else None)
    y = kernel.gemv(x, w, r, norm=norm, tuning=tuning)
    want = reference.gemv(x, w, r, norm=norm)
    assert y.dtype == dtype and y.shape == (t, n)
    assert rel_err(y, want) <= FP8_TOL[dtype]
    if dtype == jnp.bfloat16:
        assert _mismatch_share(y, want) <= FP8_MAX_BF16_MISMATCH
    # The scales are there, each block's and column's own (the projection alone, without the residual), and so are
    # the residual and the norm: leaving any out is far outside FP8_TOL (the one token's residual at scale 0.5 is
    # under 10 % of the output at K = 384).
    proj_only = reference.gemv(x, w, norm=norm)
    assert rel_err(reference.gemv(x, _misscaled(w), norm=norm), proj_only) > 0.1
    assert rel_err(reference.gemv(x, w.q.astype(dtype), norm=norm), proj_only) > 0.1
    if with_res:
        assert rel_err(proj_only, want) > 0.05
    if with_norm:
        assert rel_err(reference.gemv(x, w, r), want) > 0.05


def test_gemv_dispatch_pallas_fp8_matches_reference():
    x, w, r, norm = _fp8_inputs(101, 2, 256, 96, jnp.bfloat16)
    y = gemv.gemv(x, w, r, norm=norm, backend="pallas")
    assert y.dtype == jnp.bfloat16
    want = gemv.gemv(x, w, r, norm=norm)
    assert rel_err(y, want) <= FP8_TOL[jnp.bfloat16] and _mismatch_share(y, want) <= FP8_MAX_BF16_MISMATCH


def test_default_tuning_fp8():
    """FP8 defaults (kernel._fp8_default_tuning): 128-row steps in whole scale blocks, 4 warps, FMAs for one token,
    128 or 64 columns, K-splits of at least MIN_SPLIT_ROWS rows at T = 1 (FP8_DOT_MIN_SPLIT_ROWS above) giving
    MIN_PROGRAMS programs (MIN_PROGRAMS / 2 above), or the most such splits; plain weights keep theirs."""
    for k, n in [(2560, 4096), (4096, 2560), (2560, 576), (2560, 32 * 193), (2560, 32 * 641)]:
        for t in (1, 4):
            tu = kernel.default_tuning(t, k, n, 1)
            ks, rows = tu.k_splits, k // tu.k_splits
            assert k % ks == 0 and rows % fp8.BLOCK == 0 and tu.block_k == fp8.BLOCK and tu.block_n in (64, 128)
            assert tu.num_warps == 4 and not tu.one_token_dot
            min_rows, target = ((kernel.MIN_SPLIT_ROWS, kernel.MIN_PROGRAMS) if t == 1
                                else (kernel.FP8_DOT_MIN_SPLIT_ROWS, kernel.MIN_PROGRAMS // 2))
            assert rows >= min_rows
            assert -(-n // tu.block_n) * ks >= target or ks == kernel.fp8_splits(k, min_rows)[-1]
        assert kernel.default_tuning(1, k, n) == kernel.default_tuning(1, k, n, 4)
    # K = 2560 is 20 scale blocks: 5 and 10 are splits too, where a power of two past 4 would cut a block.
    assert kernel.fp8_splits(2560) == [1, 2, 4, 5, 10] and kernel.fp8_splits(80) == [1]
    # KDA's w_in: 161 blocks of 128 columns, 4 splits (644 programs) at T = 1, 2 (322) above.
    fp8_w_in = GemvTuning(block_n=128, block_k=128, k_splits=4, one_token_dot=False)
    assert kernel.default_tuning(1, 2560, 32 * 641, 1) == fp8_w_in
    assert kernel.default_tuning(4, 2560, 32 * 641, 1) == dataclasses.replace(fp8_w_in, k_splits=2)
    assert kernel.default_tuning(1, 2560, 32 * 641).block_n == 64


@pytest.mark.parametrize("t", [1, 4])
def test_fp8_lowers_for_cuda(monkeypatch, t):
    """The FP8 kernels with their defaults (FMAs at T = 1, the hand-pipelined dot above) lower to Triton at Flash
    size: KDA's w_in with the norm (ragged: 20512 columns), o_proj with the residual. Interpret mode runs neither
    lowering; compiling it to SASS is experiments/triton_resources.py's job."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: gpu_info.get_gpu_info_from_version(
        gpu_info.GpuVersion.H200))
    monkeypatch.setattr(kernel, "interpret_mode", lambda: False)
    sds = jax.ShapeDtypeStruct
    for k, n, with_norm, with_res in [(2560, 32 * 641, True, False), (4096, 2560, False, True)]:
        w = fp8.Fp8Weight(sds((k, n), fp8.FP8_DTYPE), sds((k // fp8.BLOCK, n), jnp.float32))

        def proj(x, w, r, g):
            return kernel.gemv(x, w, r if with_res else None, norm=(g, 1e-6) if with_norm else None)

        txt = jax.jit(proj).trace(sds((t, k), jnp.bfloat16), w, sds((t, n), jnp.bfloat16),
                                  sds((k,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        tu = kernel.default_tuning(t, k, n, 1)
        assert txt.count('name = "gemv_fwd_kernel"') == 1
        assert f"grid_x = {-(-n // tu.block_n)}" in txt and f"grid_y = {tu.k_splits}" in txt


def test_fp8_dispatch_errors():
    x, w, r, _ = _fp8_inputs(0, 2, 256, 96, jnp.float32)
    cases = [
        (fp8.Fp8Weight(w.q.astype(jnp.bfloat16), w.scale), r"w.q.dtype=bfloat16 must be float8_e4m3fn"),
        (fp8.Fp8Weight(w.q, w.scale.astype(jnp.bfloat16)), r"w.scale.dtype=bfloat16 must be float32"),
        (fp8.Fp8Weight(w.q, w.scale[:1]), r"w.scale.shape=\(1, 96\) must be \(2, 96\) for a in_out weight of shape "
                                          r"\(256, 96\) \(128-wide blocks\)"),
        (fp8.Fp8Weight(w.q, jnp.ones((256, 96), jnp.float32)), r"w.scale.shape=\(256, 96\) must be \(2, 96\)"),
        (fp8.Fp8Weight(w.q, jnp.ones((2, 1), jnp.float32), fp8.OUT_IN),
         r"w has FP8 layout 'out_in'; this op needs 'in_out'"),
        (fp8.Fp8Weight(w.q, jnp.ones((192,), jnp.float32), fp8.IN_OUT, 2), r"w.n_in=2 must be 1: the GEMV takes"),
        # torch's [out, in]: a plain shape error, no `w.T` hint (an Fp8Weight has no .T)
        (fp8.quantize(w.q.T.astype(jnp.float32)), r"w.shape=\(96, 256\) must be \[K, N\] \(\[in, out\]\) with K = "
                                                  r"x.shape\[1\] = 256$"),
    ]
    for bad, match in cases:
        for backend in ("reference", "pallas"):
            with pytest.raises(ValueError, match=match):
                gemv.gemv(x, bad, backend=backend)
    with pytest.raises(ValueError, match=r"residual.dtype=bfloat16 must be one of \['float32'\]"):
        gemv.gemv(x, w, r.astype(jnp.bfloat16))
    for backend in ("reference", "pallas"):
        with pytest.raises(ValueError, match=r"greedy_head takes the lm_head w \[K, V\] in x's dtype .* not an "
                                             r"Fp8Weight"):
            gemv.greedy_head(x, w, backend=backend)
