"""The FP8 GEMV over output rows (pallas_kernels/gemv/rows.py, layout fp8.ROWS), interpreted on CPU: each path against the reference that
dequantises in float32, the ROWS layout and its converter, the dispatcher's errors, and the kernels per shard under
TP2 and TP4.

Interpret mode fills every output with NaN before the kernel runs and pads reads past an array's end with NaN, so
an entry a kernel leaves unwritten, or a masked load that reads past the weight or the tokens, makes the output
non-finite and fails `rel_err` (the outputs are poisoned). Sizes stay tiny (K <= 640, N <= 100, N never a multiple
of the 64-row block) so the file runs in well under a minute.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import gemv
from pallas_kernels.common import fp8
from pallas_kernels.common.norm import GroupRMS
from pallas_kernels.gemv import kernel, reference, rows
from pallas_kernels.gemv.rows import RowsTuning
from tests.numerics import input_seed, rel_err

EPS = 1e-6
# Interpreted kernels against the reference, worst of 8 seeds over the cases below. The kernels compute the
# reference's sums, scale[n, b] · (sum over block b of x[k]·q[n, k]) in fp32, so only fp32 rounding and summation
# order differ before the output's one rounding. float32 x: measured <= 1.0e-6 (bound 1e-5). bfloat16 x: an output
# differs only where that ~1e-7 difference straddles a bf16 rounding boundary (one ulp, <= 2^-7 relative, on that
# entry), or where the norm's fp32 sum of squares, summed in another order, rounds a normed input the other way,
# which moves every output of that token: measured <= 2.3e-4 with <= 1.4 % of the entries apart (T = 16 with the
# norm in the kernel; <= 0.4 % elsewhere). The bounds hold a few such flips and no more: a weight rounded to bf16
# first is 5e-4..2e-3 off with 8-35 % of the entries apart (tests/ops/test_gemv.py).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3}
MAX_BF16_MISMATCH = 0.02


def _inputs(seed, t, k, n, dtype):
    """x [T, K] with token i at scale 0.5 + i; the IN_OUT Fp8Weight [K, N] whose 128-row blocks are at scales 1/4,
    1, 4 in turn and columns at log-normal scales (so every block has its own scale) and its ROWS conversion;
    residual [T, N]; norm (weight [K] far from ones, eps)."""
    rng = np.random.default_rng(input_seed(seed))
    blocks = np.repeat(4.0 ** (np.arange(math.ceil(k / fp8.BLOCK)) % 3 - 1), fp8.BLOCK)[:k, None]
    cols = np.exp(rng.standard_normal((1, n)))
    tokens = (0.5 + np.arange(t))[:, None]
    w = fp8.quantize(jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5 * blocks * cols, jnp.float32))
    x = jnp.asarray(rng.standard_normal((t, k)) * tokens, dtype)
    r = jnp.asarray(rng.standard_normal((t, n)) * tokens * cols, dtype)
    norm = (jnp.asarray(rng.standard_normal(k) * 0.5 + 1.0, jnp.float32), EPS)
    return x, w, fp8.convert_layout(w, fp8.ROWS), r, norm


def _mismatch_share(got, want):
    return float((np.asarray(got, np.float32) != np.asarray(want, np.float32)).mean())


def _check(y, want, dtype, shape):
    assert y.dtype == dtype and y.shape == shape
    assert rel_err(y, want) <= TOL[dtype]
    if dtype == jnp.bfloat16:
        assert _mismatch_share(y, want) <= MAX_BF16_MISMATCH


R16 = RowsTuning(block_n=16)
ROWS_CASES = {  # T, dtype, K, N, norm, residual, tuning
    # One token by FMAs, unrolled: K = 384 is three blocks; with the norm the products reuse the norm's x loads.
    "t1-f32-k384-n40-fma": (1, jnp.float32, 384, 40, False, False, R16),
    "t1-bf16-k384-n100-fma-norm-res": (1, jnp.bfloat16, 384, 100, True, True, R16),
    # K-splits: each program re-reads all of x for the norm; fp32 partials summed, the residual added, by XLA.
    "t1-bf16-k384-n40-ks3-fma-norm-res": (1, jnp.bfloat16, 384, 40, True, True, RowsTuning(block_n=16, k_splits=3)),
    # K = 208: a block of 128, then 64 + 16 columns of the second scale block; BN 32 rows.
    "t1-f32-k208-n40-bn32-fma-norm": (1, jnp.float32, 208, 40, True, False, RowsTuning(block_n=32)),
    # FMAs in a fori_loop, the narrower pieces after it.
    "t1-bf16-k208-n40-fma-loop-norm-res": (1, jnp.bfloat16, 208, 40, True, True, RowsTuning(unroll=False)),
    # Two and three blocks per loop step: K = 640 is five blocks, so one or two are left over after the loop.
    "t1-bf16-k640-n100-fma-group2-norm-res": (1, jnp.bfloat16, 640, 100, True, True,
                                              RowsTuning(unroll=False, group=2)),
    "t3-f32-k640-n40-dot-group3-res": (3, jnp.float32, 640, 40, False, True, RowsTuning(block_n=32, group=3)),
    # The first step's loads issued before the norm walks x, that step then out of the loop (one, two, three
    # blocks a step: a loop of 4, 1 and 0 steps after it, K = 640, 640, 384).
    "t1-bf16-k640-n100-fma-early-norm-res": (1, jnp.bfloat16, 640, 100, True, True,
                                             RowsTuning(unroll=False, early_loads=True)),
    "t1-bf16-k640-n40-fma-group2-early-norm": (1, jnp.bfloat16, 640, 40, True, False,
                                               RowsTuning(unroll=False, group=2, early_loads=True)),
    "t1-f32-k384-n40-ks1-fma-group3-early-norm": (1, jnp.float32, 384, 40, True, False,
                                                  RowsTuning(unroll=False, group=3, early_loads=True)),
    # One token by the padded dot (rows 1..15 masked), unrolled and looped; the norm by XLA instead.
    "t1-bf16-k256-n100-dot-res": (1, jnp.bfloat16, 256, 100, False, True,
                                  RowsTuning(num_warps=1, one_token_dot=True, unroll=True)),
    "t1-f32-k384-n100-ks3-dot-loop-norm": (1, jnp.float32, 384, 100, True, False,
                                           RowsTuning(block_n=64, k_splits=3, one_token_dot=True)),
    "t1-bf16-k256-n40-fma-xla-norm": (1, jnp.bfloat16, 256, 40, True, False, RowsTuning(norm_in_kernel=False)),
    # More tokens: the dot in a loop (the default), unrolled, K-split, the norm by XLA (default) or in the kernel.
    "t3-f32-k384-n100-norm-res": (3, jnp.float32, 384, 100, True, True, RowsTuning(block_n=64)),
    "t3-bf16-k208-n40-unrolled-norm": (3, jnp.bfloat16, 208, 40, True, False, RowsTuning(unroll=True)),
    "t3-bf16-k384-n100-ks3-kernel-norm-res": (3, jnp.bfloat16, 384, 100, True, True,
                                              RowsTuning(block_n=32, k_splits=3, norm_in_kernel=True)),
    "t16-bf16-k256-n100-norm-res": (16, jnp.bfloat16, 256, 100, True, True, RowsTuning(block_n=64)),
    "t16-f32-k256-n40-ks2-res": (16, jnp.float32, 256, 40, False, True, RowsTuning(k_splits=2)),
    "t16-bf16-k384-n40-unrolled-kernel-norm": (16, jnp.bfloat16, 384, 40, True, False,
                                               RowsTuning(unroll=True, norm_in_kernel=True)),
    # The defaults (rows.default_tuning): FMAs at T = 1 (unrolled at this N), the 64-row dot loop above.
    "t1-bf16-k384-n100-default-norm-res": (1, jnp.bfloat16, 384, 100, True, True, None),
    "t16-bf16-k384-n100-default-norm-res": (16, jnp.bfloat16, 384, 100, True, True, None),
}


@pytest.mark.parametrize("case", list(ROWS_CASES))
def test_rows_fp8(case):
    t, dtype, k, n, with_norm, with_res, tuning = ROWS_CASES[case]
    x, w, w_rows, r, norm = _inputs(200, t, k, n, dtype)
    r, norm = (r if with_res else None), (norm if with_norm else None)
    want = reference.gemv(x, w, r, norm=norm)
    _check(rows.gemv(x, w_rows, r, norm=norm, tuning=tuning), want, dtype, (t, n))
    # The scales are each row's and block's own, and the residual and the norm are there: leaving any out is far
    # outside TOL.
    proj_only = reference.gemv(x, w_rows, norm=norm)
    misscaled = fp8.Fp8Weight(w_rows.q, jnp.roll(w_rows.scale, 1, axis=(0, 1)), fp8.ROWS)
    assert rel_err(reference.gemv(x, misscaled, norm=norm), proj_only) > 0.1
    if with_res:
        assert rel_err(proj_only, want) > 0.05
    if with_norm:
        assert rel_err(reference.gemv(x, w_rows, r), want) > 0.05


def _group_rms(seed, t, k, dtype, parts=8, group=fp8.BLOCK):
    """A GroupRMS x [T, K] as KDA's decode kernel leaves it: values o·gate (fp32) and `parts` partial sums of squares
    of o per group of `group` columns, rows at very different RMS so the scaling is far from one."""
    rng = np.random.default_rng(input_seed(seed))
    g = k // group
    o = rng.standard_normal((t, g, group)) * np.exp(rng.standard_normal((t, g, 1)))
    gate = 0.5 + rng.random((t, g, group))
    sum_sq = (o * o).reshape(t, g, parts, group // parts).sum(-1)
    return GroupRMS(jnp.asarray((o * gate).reshape(t, k), jnp.float32), jnp.asarray(sum_sq, jnp.float32), EPS,
                    jnp.dtype(dtype).name)


GROUP_RMS_CASES = {  # T, dtype, K, N, residual, tuning, group
    "t1-bf16-k512-n100-res": (1, jnp.bfloat16, 512, 100, True, R16, 128),
    "t1-f32-k512-n40": (1, jnp.float32, 512, 40, False, R16, 128),
    "t1-bf16-k512-n40-ks2-res": (1, jnp.bfloat16, 512, 40, True, RowsTuning(block_n=16, k_splits=2), 128),
    "t1-bf16-k640-n40-loop-group2": (1, jnp.bfloat16, 640, 40, False, RowsTuning(unroll=False, group=2), 128),
    "t1-bf16-k512-n100-dot-res": (1, jnp.bfloat16, 512, 100, True, RowsTuning(block_n=64, one_token_dot=True), 256),
    "t1-bf16-k512-n100-default-res": (1, jnp.bfloat16, 512, 100, True, None, 128),
    # XLA scales x first: more tokens, and groups narrower than a 128-column block.
    "t3-bf16-k512-n100-default-res": (3, jnp.bfloat16, 512, 100, True, None, 128),
    "t1-f32-k512-n40-group64": (1, jnp.float32, 512, 40, False, R16, 64),
}


@pytest.mark.parametrize("case", list(GROUP_RMS_CASES))
def test_rows_group_rms(case):
    """A GroupRMS input (KDA's gated norm with its per-head RMS left to o_proj) against the reference on its applied
    x, at TOL: the prologue sums each group's partial sums in another order, which may round a group's scaled x
    the other way (bf16)."""
    t, dtype, k, n, with_res, tuning, group = GROUP_RMS_CASES[case]
    _, w, w_rows, r, _ = _inputs(260, t, k, n, dtype)
    x = _group_rms(261, t, k, dtype, group=group)
    r = r if with_res else None
    assert rows.takes_group_rms(x) == (t == 1 and group % fp8.BLOCK == 0)
    want = reference.gemv(x.apply(), w, r)
    _check(rows.gemv(x, w_rows, r, tuning=tuning), want, dtype, (t, n))
    _check(gemv.gemv(x, w_rows, r, backend="pallas"), want, dtype, (t, n))
    np.testing.assert_array_equal(np.asarray(gemv.gemv(x, w_rows, r), np.float32), np.asarray(want, np.float32))
    # The scaling is there: the values alone are far off.
    assert rel_err(reference.gemv(x.values.astype(dtype), w, r), want) > 0.1


def test_rows_group_rms_errors():
    x = _group_rms(262, 1, 256, jnp.bfloat16)
    _, _, w_rows, _, norm = _inputs(263, 1, 256, 40, jnp.bfloat16)
    with pytest.raises(ValueError, match="carries its own norm"):
        gemv.gemv(x, w_rows, norm=norm, backend="pallas")
    bad = GroupRMS(x.values, jnp.concatenate([x.sum_sq, x.sum_sq[:, :1]], axis=1), x.eps, x.dtype)  # 3 groups
    with pytest.raises(ValueError, match=r"G dividing K"):
        gemv.gemv(bad, w_rows, backend="pallas")
    with pytest.raises(ValueError, match=r"x.values.dtype"):
        gemv.gemv(GroupRMS(x.values.astype(jnp.bfloat16), x.sum_sq, x.eps, x.dtype), w_rows, backend="pallas")


def test_rows_reference_and_dispatch():
    """The reference takes a ROWS weight as the IN_OUT one it came from, bit for bit (the same dequantised weight);
    the dispatcher runs rows.py for it."""
    x, w, w_rows, r, norm = _inputs(220, 3, 256, 100, jnp.bfloat16)
    want = gemv.gemv(x, w, r, norm=norm)
    np.testing.assert_array_equal(np.asarray(gemv.gemv(x, w_rows, r, norm=norm), np.float32),
                                  np.asarray(want, np.float32))
    _check(gemv.gemv(x, w_rows, r, norm=norm, backend="pallas"), want, jnp.bfloat16, (3, 100))


def test_convert_layout_is_exact():
    """IN_OUT -> ROWS is a transpose of q and of the scale's blocks: the same dequantised weight bit for bit, the
    quantisation of the transposed weight, and back to the original exactly; multi-axis weights keep their axes
    (n_in 1: [D, H, X] -> [H, X, D]; n_in 2: [H, Dh, D] -> [D, H, Dh]). OUT_IN -> ROWS repeats each 128x128 block
    scale over its rows; ROWS is never turned into OUT_IN."""
    rng = np.random.default_rng(input_seed(230))
    w32 = jnp.asarray(rng.standard_normal((200, 24)) * np.exp(rng.standard_normal((1, 24))), jnp.float32)
    w = fp8.quantize(w32)
    w_rows = fp8.convert_layout(w, fp8.ROWS)
    assert w_rows.layout == fp8.ROWS and w_rows.shape == (24, 200) and w_rows.scale.shape == (24, 2)
    fp8.check_fp8("w_rows", w_rows, fp8.ROWS)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(w_rows)), np.asarray(fp8.dequantize(w)).T)
    direct = fp8.quantize(w32.T, fp8.ROWS)
    for a, b in ((w_rows.q, direct.q), (w_rows.scale, direct.scale)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    back = fp8.convert_layout(w_rows, fp8.IN_OUT)
    assert back.layout == fp8.IN_OUT and back.n_in == 1
    for a, b in ((back.q, w.q), (back.scale, w.scale)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert fp8.convert_layout(w, fp8.IN_OUT) is w
    for shape, n_in, order in (((256, 3, 8), 1, (1, 2, 0)), ((3, 64, 40), 2, (2, 0, 1))):
        w3 = fp8.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), fp8.IN_OUT, n_in)
        r3 = fp8.convert_layout(w3, fp8.ROWS)
        assert r3.n_in == n_in and r3.shape == tuple(shape[i] for i in order)
        fp8.check_fp8("r3", r3)
        np.testing.assert_array_equal(np.asarray(fp8.dequantize(r3)),
                                      np.transpose(np.asarray(fp8.dequantize(w3)), order))
        np.testing.assert_array_equal(np.asarray(fp8.convert_layout(r3, fp8.IN_OUT).scale), np.asarray(w3.scale))
    oi = fp8.quantize(jnp.asarray(rng.standard_normal((2, 200, 136)), jnp.float32), fp8.OUT_IN)
    oi_rows = fp8.convert_layout(oi, fp8.ROWS)
    assert oi_rows.scale.shape == (2, 200, 2)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(oi_rows)), np.asarray(fp8.dequantize(oi)))
    with pytest.raises(ValueError, match=r"convert_layout takes 'in_out' or 'out_in' to 'rows' and 'rows' to "
                                         r"'in_out'; got 'rows' -> 'out_in'"):
        fp8.convert_layout(w_rows, fp8.OUT_IN)


def test_rows_quantize_blocks():
    """ROWS blocks are one output row x 128 input columns: a column block's scale follows its own row's maximum
    (a row 1000x larger leaves its neighbours' scales alone); the dequantised weight is within E4M3's precision."""
    rng = np.random.default_rng(input_seed(231))
    w = rng.standard_normal((6, 300)).astype(np.float32)
    w[2] *= 1000.0
    q = fp8.quantize(jnp.asarray(w), fp8.ROWS)
    assert q.scale.shape == fp8.scale_shape((6, 300), fp8.ROWS) == (6, 3)
    blocks = [np.abs(w[:, i:i + 128]).max(axis=1) / fp8.FP8_MAX for i in (0, 128, 256)]
    np.testing.assert_allclose(np.asarray(q.scale), np.stack(blocks, axis=1), rtol=1e-6)
    assert rel_err(fp8.dequantize(q), w) < 2 ** -4


def test_rows_dispatch_errors():
    x, w, w_rows, r, norm = _inputs(0, 2, 256, 96, jnp.float32)
    cases = [
        # an IN_OUT-shaped q under the ROWS name: [K, N] where [N, K] is due
        (fp8.Fp8Weight(w.q, jnp.ones((256, 1), jnp.float32), fp8.ROWS),
         r"w.shape=\(256, 96\) must be \[N, K\] \(a rows weight: \[out, in\]\) with K = x.shape\[1\] = 256"),
        (fp8.Fp8Weight(w_rows.q, w_rows.scale.T, fp8.ROWS),
         r"w.scale.shape=\(2, 96\) must be \(96, 2\) for a rows weight of shape \(96, 256\)"),
        (fp8.Fp8Weight(w_rows.q.astype(jnp.bfloat16), w_rows.scale, fp8.ROWS),
         r"w.q.dtype=bfloat16 must be float8_e4m3fn"),
        (fp8.Fp8Weight(w_rows.q, w_rows.scale.astype(jnp.bfloat16), fp8.ROWS),
         r"w.scale.dtype=bfloat16 must be float32"),
        (fp8.Fp8Weight(w_rows.q.reshape(96, 2, 128), w_rows.scale, fp8.ROWS, 2),
         r"w.n_in=2 must be 1: the GEMV takes an Fp8Weight of one input axis, q \[N, K\]"),
        (fp8.Fp8Weight(w_rows.q, w_rows.scale, "cols"), r"w has FP8 layout 'cols'; this op needs 'in_out' or 'rows'"),
    ]
    for bad, match in cases:
        for backend in ("reference", "pallas"):
            with pytest.raises(ValueError, match=match):
                gemv.gemv(x, bad, backend=backend)
    with pytest.raises(ValueError, match=r"w.n_in=2 must leave an output and an input axis in the rows shape"):
        fp8.check_fp8("w", fp8.Fp8Weight(w_rows.q, jnp.ones((2,), jnp.float32), fp8.ROWS, 2))
    with pytest.raises(ValueError, match=r"greedy_head takes the lm_head w \[K, V\] in x's dtype .* not an Fp8Weight"):
        gemv.greedy_head(x, w_rows, backend="pallas")
    for tu in (RowsTuning(group=2), RowsTuning(early_loads=True)):
        with pytest.raises(ValueError, match=r"RowsTuning group=\d, early_loads=\w+ shape a loop, and this path is "
                                             r"unrolled"):
            rows.gemv(x[:1], w_rows, tuning=tu)
    with pytest.raises(ValueError, match=r"early_loads=True moves a loop's first loads ahead of the kernel's norm"):
        RowsTuning(early_loads=True, unroll=True)
    with pytest.raises(ValueError, match=r"this call has no norm in the kernel: pass early_loads=False"):
        rows.gemv(x[:1], w_rows, tuning=RowsTuning(unroll=False, early_loads=True))
    with pytest.raises(ValueError, match=r"this program's 2 block\(s\) make no step of 4: pass early_loads=False"):
        rows.gemv(x[:1], w_rows, norm=norm, tuning=RowsTuning(unroll=False, group=4, early_loads=True))
    with pytest.raises(ValueError, match=r"RowsTuning.k_splits=3 must cut K=256 into equal slices of whole "
                                         r"128-column blocks \(K-splits of this K: \[1, 2\]\)"):
        rows.gemv(x, w_rows, tuning=RowsTuning(k_splits=3))
    with pytest.raises(ValueError, match=r"the Pallas GEMV takes 1 <= T <= 16 tokens; got T=17"):
        gemv.gemv(jnp.ones((17, 256), jnp.float32), w_rows, backend="pallas")
    w72 = fp8.quantize(jnp.asarray(np.random.default_rng(input_seed(1)).standard_normal((40, 72)), jnp.float32),
                       fp8.ROWS)
    assert gemv.gemv(x[:, :72], w72).shape == (2, 40)
    with pytest.raises(ValueError, match=r"the Pallas GEMV needs K=72 \(w.shape\[1\]\) divisible by 16"):
        gemv.gemv(x[:, :72], w72, backend="pallas")
    for bad, match in [(dict(block_n=8), r"RowsTuning.block_n=8 must be a power of two >= 16"),
                       (dict(num_warps=3), r"RowsTuning.num_warps=3 must be a power of two"),
                       (dict(k_splits=0), r"RowsTuning.k_splits=0 must be an integer >= 1"),
                       (dict(one_token_dot=1), r"RowsTuning.one_token_dot=1 must be a bool"),
                       (dict(unroll="yes"), r"RowsTuning.unroll='yes' must be None, True or False"),
                       (dict(norm_in_kernel=0.5), r"RowsTuning.norm_in_kernel=0.5 must be None, True or False"),
                       (dict(group=0), r"RowsTuning.group=0 must be an integer >= 1"),
                       (dict(group=2, unroll=True), r"RowsTuning.group=2 groups the blocks of a loop step")]:
        with pytest.raises(ValueError, match=match):
            RowsTuning(**bad)


FLASH = [(2560, 32 * 641), (4096, 2560), (2560, 32 * 193), (2560, 576), (2560, 12288), (6144, 2560)]


def test_rows_default_tuning():
    """rows.default_tuning at Flash's fused shapes: K-slices of whole 128-column blocks; the dot looped above T = 1
    in 64-row blocks (MIN_PROGRAMS / 2), the unrolled dot on one warp, each within its per-thread cap."""
    for k, n in FLASH:
        for t, dot, unroll, bn, warps, target in [(16, True, False, rows.DOT_BLOCK_N, 4, kernel.MIN_PROGRAMS // 2),
                                                  (1, True, True, 16, 1, kernel.MIN_PROGRAMS)]:
            tu = rows.default_tuning(t, k, n, one_token_dot=dot and t == 1, unroll=unroll)
            k_rows = k // tu.k_splits
            assert k % tu.k_splits == 0 and k_rows % fp8.BLOCK == 0
            assert (tu.block_n, tu.num_warps, tu.unroll) == (bn, warps, unroll)
            assert -(-n // bn) * tu.k_splits >= target or tu.k_splits == kernel.fp8_splits(
                k, kernel.MIN_SPLIT_ROWS if unroll else kernel.FP8_DOT_MIN_SPLIT_ROWS)[-1]
            if unroll:
                assert bn * k_rows <= rows.MAX_UNROLLED_BYTES_PER_THREAD * 32 * warps


# The T = 1 defaults at Flash's fused shapes, each the tuning measured fastest among the FMA levers on the H200
# (results/bench_gemv_levers.json, µs; w_qg's one split measured 10.9 against these two splits' 11.0); w_in's loop
# steps over two blocks, measured on an H100 (results/bench_gemv_levers_h100.json: 23.3 against 24.6 µs).
T1_DEFAULTS = {
    # w_in, looped: 22.5 one block a step (H200); two blocks a step 23.3 against 24.6 (H100)
    (2560, 32 * 641): RowsTuning(block_n=16, k_splits=1, num_warps=4, unroll=False, group=2),
    (4096, 2560): RowsTuning(block_n=16, k_splits=4, num_warps=8, unroll=True),  # o_proj: 7.2
    (2560, 32 * 193): RowsTuning(block_n=16, k_splits=2, num_warps=4, unroll=True),  # w_qg: 11.0
    (2560, 576): RowsTuning(block_n=16, k_splits=10, num_warps=4, unroll=True),  # kv_a: 4.6
    (2560, 12288): RowsTuning(block_n=16, k_splits=2, num_warps=4, unroll=True),  # gate|up: 18.3
    (6144, 2560): RowsTuning(block_n=16, k_splits=4, num_warps=8, unroll=True),  # down: 9.0
}


def test_rows_default_tuning_at_one_token():
    """T = 1 by FMAs: looped when 16-row blocks over all of K give FMA_LOOPED_MIN_PROGRAMS programs, else
    unrolled in slices within FMA_BYTES_PER_THREAD per thread and MIN_PROGRAMS programs where the splits allow,
    8 warps from FMA_LONG_K; written out per shape, and the unrolled rule kept when asked for at w_in."""
    assert {shape: rows.default_tuning(1, *shape) for shape in T1_DEFAULTS} == T1_DEFAULTS
    for (k, n), tu in T1_DEFAULTS.items():
        assert tu.unroll == (-(-n // 16) < rows.FMA_LOOPED_MIN_PROGRAMS)
        assert (tu.num_warps == 8) == (tu.unroll and k >= rows.FMA_LONG_K)
        if tu.unroll:
            assert 16 * (k // tu.k_splits) <= rows.FMA_BYTES_PER_THREAD * 32 * tu.num_warps
    # w_in unrolled: two 1280-column slices (27.2 µs against 33.1 over all of K).
    assert rows.default_tuning(1, 2560, 32 * 641, unroll=True) == RowsTuning(block_n=16, k_splits=2, unroll=True)
    assert rows.default_tuning(1, 4096, 2560, unroll=False) == RowsTuning(block_n=16, k_splits=4, unroll=False,
                                                                          group=2)


@pytest.mark.parametrize("t", [1, 16])
def test_rows_lowers_for_cuda(monkeypatch, t):
    """Every rows path with its default at Flash size lowers to Triton: KDA's w_in with the norm (ragged at 16
    rows: 20512 = 1282 x 16), o_proj with the residual and K-splits. Interpret mode runs no lowering; compiling to
    SASS is experiments/triton_resources.py --gemv."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: gpu_info.get_gpu_info_from_version(
        gpu_info.GpuVersion.H200))
    monkeypatch.setattr(rows, "interpret_mode", lambda: False)
    sds = jax.ShapeDtypeStruct
    paths = [dict(), dict(one_token_dot=True, unroll=True)] + ([dict(one_token_dot=True)] if t == 1 else [])
    for k, n, with_norm, with_res in [(2560, 32 * 641, True, False), (4096, 2560, False, True)]:
        w = fp8.Fp8Weight(sds((n, k), fp8.FP8_DTYPE), sds((n, k // fp8.BLOCK), jnp.float32), fp8.ROWS)
        for path in paths:
            tu = rows.default_tuning(t, k, n, **path)

            def proj(x, w, r, g, tu=tu):
                return rows.gemv(x, w, r if with_res else None, norm=(g, EPS) if with_norm else None, tuning=tu)

            txt = jax.jit(proj).trace(sds((t, k), jnp.bfloat16), w, sds((t, n), jnp.bfloat16),
                                      sds((k,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
            assert txt.count('name = "gemv_rows_fwd_kernel"') == 1
            assert f"grid_x = {-(-n // tu.block_n)}" in txt and f"grid_y = {tu.k_splits}" in txt


def test_rows_group_rms_lowers_for_cuda(monkeypatch):
    """KDA's o_proj at Flash size with its GroupRMS prologue (32 heads of 128, 8 partial sums each) and the
    residual lowers to one Triton kernel with the default tuning's grid."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: gpu_info.get_gpu_info_from_version(
        gpu_info.GpuVersion.H200))
    monkeypatch.setattr(rows, "interpret_mode", lambda: False)
    sds = jax.ShapeDtypeStruct
    k, n = 4096, 2560
    w = fp8.Fp8Weight(sds((n, k), fp8.FP8_DTYPE), sds((n, k // fp8.BLOCK), jnp.float32), fp8.ROWS)
    x = GroupRMS(sds((1, k), jnp.float32), sds((1, 32, 8), jnp.float32), EPS, "bfloat16")
    txt = jax.jit(rows.gemv).trace(x, w, sds((1, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    tu = rows.default_tuning(1, k, n)
    assert txt.count('name = "gemv_rows_fwd_kernel"') == 1
    assert f"grid_x = {n // tu.block_n}" in txt and f"grid_y = {tu.k_splits}" in txt


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("tp", [2, 4])
def test_rows_per_shard(tp):
    """Under TP the rows kernel runs per shard as ling_jax.layers.linear.dense would place it: column-parallel
    (output rows split over devices, x replicated, the norm in the kernel, the residual split with the outputs) and
    row-parallel (K split in whole 128-column blocks, each device's partial sums added across devices, then the
    residual). K = 512: TP4 leaves one block per device."""
    k, n = 512, 96
    x, w, w_rows, r, norm = _inputs(240, 3, k, n, jnp.float32)
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])

    def put(a, spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    def put_w(spec):
        return fp8.Fp8Weight(put(w_rows.q, spec), put(w_rows.scale, spec), fp8.ROWS)

    def col(x, w, r, g):
        return rows.gemv(x, w, r, norm=(g, EPS))

    by_rows = P("tp", None)
    run = jax.jit(jax.shard_map(col, mesh=mesh, in_specs=(P(), fp8.Fp8Weight(by_rows, by_rows, fp8.ROWS),
                                                          P(None, "tp"), P()),
                                out_specs=P(None, "tp"), check_vma=False))
    for xs, rs in ((x[:1], r[:1]), (x, r)):
        _check(run(put(xs, P()), put_w(by_rows), put(rs, P(None, "tp")), put(norm[0], P())),
               reference.gemv(xs, w, rs, norm=norm), jnp.float32, (xs.shape[0], n))
    by_cols = P(None, "tp")
    row_par = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum(rows.gemv(x, w), "tp"), mesh=mesh,
                                    in_specs=(by_cols, fp8.Fp8Weight(by_cols, by_cols, fp8.ROWS)), out_specs=P(),
                                    check_vma=False))
    for xs, rs in ((x[:1], r[:1]), (x, r)):
        _check(row_par(put(xs, by_cols), put_w(by_cols)) + rs, reference.gemv(xs, w, rs), jnp.float32,
               (xs.shape[0], n))
