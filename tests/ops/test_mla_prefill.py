"""MLA prefill attention from any start: the reference against a float64 NumPy causal softmax and, at start 0 and
L = T, bit for bit against the PyTorch eager replica; the Pallas flash kernel (interpreted on CPU) against the
reference; its Triton lowering at Ling's sizes; and the dispatcher's errors.

Shapes are small so interpret mode stays quick: Dqk 48 = 32 + 16 (split into power-of-two pieces like Ling's
192 = 128 + 64, which one case runs too) and Dv 32, with 16-wide tiles so a prompt of 24-80 tokens spans several
query blocks, full key blocks and diagonal ones. Key and value rows at and past start + T are NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from pallas_kernels import mla
from pallas_kernels.mla.prefill import MLAPrefillTuning, pow2_pieces

D_QK, D_V = 48, 32
SCALE = D_QK ** -0.5
SMALL = dict(block_q=16, block_k=16)

# (b, t, h, length, start, tuning fields): several query blocks over full and diagonal key blocks (one-shot); T not
# a multiple of BQ and L not of BK, BQ < BK; a chunk (L > start + T) with BQ = BK and with BQ > BK; T = 1 (the
# default tiling, shrunk to 16-wide); B = 2; the default tiling with one 128-row query block past T = 80; one-shot
# prompts shorter than one key block (the rows padded to a block).
CASES = [
    (1, 64, 2, 64, 0, SMALL),
    (1, 37, 3, 37, 0, dict(block_q=16, block_k=32)),
    (1, 24, 2, 80, 40, SMALL),
    (1, 20, 2, 72, 33, dict(block_q=32, block_k=16)),
    (1, 1, 4, 64, 50, {}),
    (2, 40, 2, 64, 17, SMALL),
    (1, 80, 2, 80, 0, {}),
    (1, 22, 2, 22, 0, {}),
    (1, 5, 2, 5, 0, {}),
]
CASE_IDS = ["oneshot", "T37-bq16-bk32", "chunk", "chunk-bq32-bk16", "T1", "B2", "default-tiling",
            "short-prompt-below-a-block", "T5-one-shot"]

# Kernel vs reference, relative L2 error, measured max over these cases and seeds 0-9. float32: the roundings are
# exact and the dots full precision, so only the summation order differs: 4.5e-7; 2e-6. bfloat16: each probability
# is rounded once before ·V as in the reference, but unnormalised (prefill.py's docstring), and both round the
# output: 3.4e-3; 7e-3 (2x). Against the float64 oracle the float32 kernel measured 2.7e-7; 1e-6.
TOL = {"float32": 2e-6, "bfloat16": 7e-3}
TOL_ORACLE = 1e-6


def _inputs(seed, b, t, h, length, start, *, dqk=D_QK, dv=D_V, dtype="float32"):
    """q, k, v as numpy float32 holding values exact in `dtype`, with NaN in the key/value rows >= start + T."""
    rng = np.random.default_rng(input_seed(seed))
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((b, t, h, dqk), (b, length, h, dqk), (b, length, h, dv)))
    k[:, start + t:] = np.nan
    v[:, start + t:] = np.nan
    return tuple(np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, k, v))


def np_causal_attention(q, k, v, start, scale):
    """float64 causal softmax over the keys 0 .. start+T-1 only (the rows past them are never touched)."""
    t = q.shape[1]
    n = start + t
    q, k, v = (a.astype(np.float64) for a in (q, k[:, :n], v[:, :n]))
    s = np.einsum("bthd,blhd->bhtl", q, k) * scale
    visible = np.arange(n)[None, :] <= start + np.arange(t)[:, None]
    s = np.where(visible[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhtl,blhd->bthd", p, v)


def _attend(arrs, start, dtype, backend, scale=SCALE, **kw):
    q, k, v = (jnp.asarray(a, dtype) for a in arrs)
    o = mla.mla_prefill_attention(q, k, v, jnp.int32(start), scale=scale, backend=backend, **kw)
    assert o.dtype == jnp.dtype(dtype) and o.shape == (*q.shape[:3], v.shape[3])
    return o


@pytest.mark.parametrize("scale", [SCALE, 1.0], ids=["scale48^-0.5", "scale1"])
@pytest.mark.parametrize("b,t,h,length,start", [(2, 13, 4, 13, 0), (1, 24, 2, 80, 40), (1, 1, 3, 9, 8)],
                         ids=["oneshot", "chunk", "T1"])
def test_reference_vs_numpy(b, t, h, length, start, scale):
    """The reference (float32) against the float64 oracle; NaN rows past start + T must not leak. Measured max
    7.5e-7 over these cases and seeds 0-9 (at scale 1, the larger scores); 2e-6."""
    arrs = _inputs(0, b, t, h, length, start)
    got = _attend(arrs, start, "float32", "reference", scale)
    assert rel_err(got, np_causal_attention(*arrs, start, scale)) <= 2e-6


def test_reference_bf16_vs_numpy():
    """bf16 reference against the float64 oracle on the same bf16 inputs: the eager roundings (scores twice,
    probabilities, output) measured max 5.5e-3 over seeds 0-9; 1.1e-2 (2x)."""
    arrs = _inputs(1, 1, 24, 2, 80, 40, dtype="bfloat16")
    got = _attend(arrs, 40, "bfloat16", "reference")
    assert rel_err(got, np_causal_attention(*arrs, 40, SCALE)) <= 1.1e-2


def test_reference_oneshot_is_eager_bit_for_bit():
    """start 0 and L = T, start omitted (as the layer calls it): the PyTorch eager replica's bits in bf16 (same op
    order on CPU); the NaN-guarding where selects every row and changes nothing."""
    from test_mla import torch_eager

    q, k, v = _inputs(3, 2, 13, 4, 13, 0, dtype="bfloat16")
    got = mla.mla_prefill_attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), scale=SCALE)
    want = torch_eager(*(torch.tensor(a).to(torch.bfloat16) for a in (q, k, v)), SCALE).float().numpy()
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,t,h,length,start,kw", CASES, ids=CASE_IDS)
def test_pallas_vs_reference(b, t, h, length, start, kw, dtype):
    arrs = _inputs(2, b, t, h, length, start, dtype=dtype)
    o = _attend(arrs, start, dtype, "pallas", tuning=MLAPrefillTuning(**kw))
    assert rel_err(o, _attend(arrs, start, dtype, "reference")) <= TOL[dtype]
    if dtype == "float32":
        assert rel_err(o, np_causal_attention(*arrs, start, SCALE)) <= TOL_ORACLE


@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_pallas_scale(scale):
    """The scale far on either side of 48^-1/2 (nearly uniform weights, nearly one-hot ones), chunk case, against
    the float64 oracle; the two scales give clearly different outputs."""
    arrs = _inputs(4, 1, 24, 2, 80, 40)
    got = _attend(arrs, 40, "float32", "pallas", scale, tuning=MLAPrefillTuning(**SMALL))
    assert rel_err(got, np_causal_attention(*arrs, 40, scale)) <= TOL_ORACLE
    assert rel_err(np_causal_attention(*arrs, 40, SCALE), np_causal_attention(*arrs, 40, scale)) > 0.1


@pytest.mark.parametrize("scale", [SCALE, 0.3], ids=["scale48^-0.5", "scale0.3"])
def test_pallas_rounds_scores_as_the_reference(scale):
    """bf16 with scores 3x larger, where rounding them to bf16 moves the probabilities: the kernel's roundings are
    the reference's. Measured max 2.9e-3 over seeds 0-9; without the score rounding 7.3e-3 or more, without the
    rounding after the scale 5.1e-3 or more (seeds 0-4); 4e-3 (1.4x). (Scales that are powers of two would not
    tell: their product rounds exactly.)"""
    q, k, v = _inputs(7, 1, 24, 2, 80, 40, dtype="bfloat16")
    arrs = (np.asarray(jnp.asarray(3 * q, jnp.bfloat16).astype(jnp.float32)), k, v)
    o = _attend(arrs, 40, "bfloat16", "pallas", scale, tuning=MLAPrefillTuning(**SMALL))
    assert rel_err(o, _attend(arrs, 40, "bfloat16", "reference", scale)) <= 4e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_traced_start(dtype):
    """start traced under jit (the loop bounds come from the device scalar): two starts through one jitted
    function."""
    tu = MLAPrefillTuning(**SMALL)
    f = jax.jit(lambda q, k, v, s: mla.mla_prefill_attention(q, k, v, s, scale=SCALE, backend="pallas", tuning=tu))
    for start in (40, 13):
        arrs = _inputs(5, 1, 24, 2, 80, start, dtype=dtype)
        got = f(*(jnp.asarray(a, dtype) for a in arrs), jnp.int32(start))
        assert rel_err(got, _attend(arrs, start, dtype, "reference")) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_ling_head_dims(dtype):
    """Ling's Dqk 192 (128 + 64) and Dv 128 at a small chunk."""
    arrs = _inputs(6, 1, 16, 2, 48, 24, dqk=192, dv=128, dtype=dtype)
    o = _attend(arrs, 24, dtype, "pallas", 192 ** -0.5, tuning=MLAPrefillTuning(**SMALL))
    assert rel_err(o, _attend(arrs, 24, dtype, "reference", 192 ** -0.5)) <= TOL[dtype]


def test_pow2_pieces():
    assert pow2_pieces(192) == ((0, 128), (128, 64))
    assert pow2_pieces(48) == ((0, 32), (32, 16))
    assert pow2_pieces(128) == ((0, 128),)


@pytest.mark.parametrize("t,length,kw", [(8192, 8192, {}), (2048, 32768, {}), (1, 64, {}), (13, 13, {}),
                                         (8192, 8192, dict(block_q=64, block_k=128, num_warps=4, num_stages=2))],
                         ids=["oneshot8k", "chunk2k-32k", "T1", "T13", "bq64-bk128"])
def test_pallas_lowers_for_cuda(monkeypatch, t, length, kw):
    """The Triton lowering at Ling's sizes (H 32, Dqk 192, Dv 128, bf16) with a traced start."""
    from test_moe import lower_for_cuda

    from pallas_kernels.mla import prefill

    sds = jax.ShapeDtypeStruct
    tu = MLAPrefillTuning(**kw)
    txt = lower_for_cuda(monkeypatch, [prefill],
                         lambda q, k, v, s: prefill.mla_prefill_attention(q, k, v, s, scale=192 ** -0.5, tuning=tu),
                         sds((1, t, 32, 192), jnp.bfloat16), sds((1, length, 32, 192), jnp.bfloat16),
                         sds((1, length, 32, 128), jnp.bfloat16), sds((), jnp.int32))
    assert txt.count("stablehlo.custom_call") == 1


def test_fitting_tuning_and_its_errors():
    from pallas_kernels.mla import prefill

    assert prefill.fitting_tuning("bfloat16", 192, 128) == MLAPrefillTuning()
    assert prefill.fitting_tuning("float32", 192, 128) == MLAPrefillTuning(block_k=32)
    assert prefill.fitting_tuning("float32", 4096, 4096) is None
    q = jnp.ones((1, 128, 1, 192), jnp.float32) * 0.5  # 128 queries and keys: the tiles are not capped
    kv = jnp.ones((1, 128, 1, 192), jnp.float32) * 0.5
    with pytest.raises(ValueError, match=r"needs 393216 bytes of shared memory for Dqk=192, Dv=192 in float32, over "
                                         r"the 232448 a program may take: use MLAPrefillTuning\(block_q=128, "
                                         r"block_k=16,"):
        mla.mla_prefill_attention(q, kv, kv, scale=1.0, backend="pallas", tuning=MLAPrefillTuning(block_k=64))
    short = jnp.ones((1, 16, 1, 192), jnp.float32) * 0.5  # 16 queries and keys: tiles capped to 16 x 16 fit
    assert mla.mla_prefill_attention(short, short, short, scale=1.0, backend="pallas",
                                     tuning=MLAPrefillTuning(block_k=64)).shape == (1, 16, 1, 192)
    wide = jnp.ones((1, 16, 1, 4096), jnp.float32)
    with pytest.raises(ValueError, match=r"cannot tile Dqk=4096, Dv=4096 in float32 within 232448 bytes"):
        mla.mla_prefill_attention(wide, wide, wide, scale=1.0, backend="pallas")


def test_dispatch_errors():
    q = jnp.ones((1, 4, 2, 16)) * 0.5
    kv = jnp.ones((1, 6, 2, 16)) * 0.5
    with pytest.raises(ValueError, match=r"k.shape=\(1, 3, 2, 16\) must have L >= T = 4"):
        mla.mla_prefill_attention(q, kv[:, :3], kv[:, :3], scale=1.0)
    with pytest.raises(ValueError, match=r"k.shape=\(1, 6, 3, 16\) must be \[B, L, H, Dqk\] = \(1, 6, 2, 16\)"):
        mla.mla_prefill_attention(q, jnp.ones((1, 6, 3, 16)), kv, scale=1.0)
    with pytest.raises(ValueError, match=r"v.shape=\(1, 5, 2, 16\) must be \[B, L, H, Dv\] = \(1, 6, 2, 16\)"):
        mla.mla_prefill_attention(q, kv, kv[:, :5], scale=1.0)
    with pytest.raises(ValueError, match=r"k.dtype=bfloat16 must be one of \['float32'\]"):
        mla.mla_prefill_attention(q, kv.astype(jnp.bfloat16), kv, scale=1.0)
    for bad in (jnp.float32(1), 1.0, jnp.zeros(1, jnp.int32)):
        with pytest.raises(ValueError, match="must be an integer scalar"):
            mla.mla_prefill_attention(q, kv, kv, bad, scale=1.0)
    with pytest.raises(ValueError, match=r"start=3 must be in \[0, L - T\] = \[0, 2\]"):
        mla.mla_prefill_attention(q, kv, kv, 3, scale=1.0)
    with pytest.raises(ValueError, match="tuning= tunes the Pallas kernel"):
        mla.mla_prefill_attention(q, kv, kv, scale=1.0, tuning=MLAPrefillTuning())
    with pytest.raises(TypeError, match="tuning must be a pallas_kernels.mla.prefill.MLAPrefillTuning"):
        mla.mla_prefill_attention(q, kv, kv, scale=1.0, backend="pallas", tuning=dict(block_q=16))
    with pytest.raises(ValueError, match="needs Dqk to be a multiple of 16.*Dqk=40"):
        mla.mla_prefill_attention(jnp.ones((1, 4, 2, 40)), jnp.ones((1, 4, 2, 40)), kv[:, :4], scale=1.0,
                                  backend="pallas")
    with pytest.raises(ValueError, match=r"MLAPrefillTuning.block_q=24 must be a power of two >= 16"):
        MLAPrefillTuning(block_q=24)
    with pytest.raises(ValueError, match=r"MLAPrefillTuning.num_stages=0 must be an integer >= 1"):
        MLAPrefillTuning(num_stages=0)
