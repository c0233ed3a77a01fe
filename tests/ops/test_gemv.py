"""Projections of a few tokens and the greedy lm_head: the reference against `proj` and float64 NumPy, the Pallas
kernels (interpreted on CPU, compiled on a GPU) against the reference, ties and NaN in the greedy pick, and the
dispatcher's and the tuning's error messages.

Sizes stay tiny (K <= 256, N <= 300) so the interpreted kernels run in seconds; N = 300 and 200 are not multiples of
any block width, so every kernel run has a masked last block. The RMSNorm prologue (`norm=`) has its own cases.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from ling_jax.layers.linear import proj
from ling_jax.layers.norms import rms_norm
from pallas_kernels import gemv
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
