"""MLA attention: absorbed decode against the expanded (non-absorbed) attention, prefill against a PyTorch
eager replica, the Pallas decode kernel (interpreted on CPU) against the reference, and the dispatcher's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from pallas_kernels import mla

POISON = [np.nan, 1e30]


def _decode_case(seed, *, b, t, h, length, start, r=64, p=16, dn=32, dv=32, poison=np.nan):
    """Random MLA decode inputs plus everything the expanded form needs (W_uk, W_uv, q_nope)."""
    rng = np.random.default_rng(input_seed(seed))
    c_kv = rng.standard_normal((b, length, r)).astype(np.float32)
    k_rope = rng.standard_normal((b, length, p)).astype(np.float32)
    w_uk = (rng.standard_normal((h, r, dn)) / np.sqrt(r)).astype(np.float32)
    w_uv = (rng.standard_normal((h, r, dv)) / np.sqrt(r)).astype(np.float32)
    q_nope = rng.standard_normal((b, t, h, dn)).astype(np.float32)
    q_rope = rng.standard_normal((b, t, h, p)).astype(np.float32)
    cache = np.concatenate([c_kv, k_rope], -1)
    cache[:, start + t:] = poison
    return dict(c_kv=c_kv, k_rope=k_rope, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_rope=q_rope, cache=cache)


def expanded_attention(case, start, scale):
    """Non-absorbed MLA in float64: k = [c_kv·W_uk | k_rope], v = c_kv·W_uv per head, causal from `start`."""
    f = {k: v.astype(np.float64) for k, v in case.items()}
    b, t, h, _ = f["q_nope"].shape
    n = start + t
    k_nope = np.einsum("blr,hrd->blhd", f["c_kv"][:, :n], f["w_uk"])
    v = np.einsum("blr,hrd->blhd", f["c_kv"][:, :n], f["w_uv"])
    s = np.einsum("bthd,blhd->bhtl", f["q_nope"], k_nope) + np.einsum("bthp,blp->bhtl", f["q_rope"],
                                                                        f["k_rope"][:, :n])
    s = s * scale
    visible = np.arange(n)[None, :] <= start + np.arange(t)[:, None]
    s = np.where(visible[None, None], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    return np.einsum("bhtl,blhd->bthd", pr, v)


def absorbed(case, start, scale, backend, dtype=jnp.float32, tuning=None):
    q_latent = jnp.einsum("bthd,hrd->bthr", case["q_nope"], case["w_uk"], precision="highest")
    kw = {} if tuning is None else dict(tuning=tuning)
    o = mla.mla_decode_attention(q_latent, jnp.asarray(case["q_rope"], dtype), jnp.asarray(case["cache"], dtype),
                                 jnp.int32(start), scale=scale, backend=backend, **kw)
    assert o.dtype == jnp.float32 and o.shape == q_latent.shape
    return o


@pytest.mark.parametrize("scale", [48 ** -0.5, 1.0], ids=["scale48^-0.5", "scale1"])
@pytest.mark.parametrize("poison", POISON, ids=["nan", "1e30"])
@pytest.mark.parametrize("b,t,h,length,start", [(1, 1, 4, 37, 20), (2, 6, 4, 64, 0), (1, 3, 2, 50, 47)],
                         ids=lambda v: str(v))
def test_decode_reference_vs_expanded(b, t, h, length, start, poison, scale):
    case = _decode_case(0, b=b, t=t, h=h, length=length, start=start, poison=poison)
    o = absorbed(case, start, scale, "reference")
    want = expanded_attention(case, start, scale)
    got = np.einsum("bthr,hrd->bthd", np.asarray(o, np.float64), case["w_uv"])
    assert np.isfinite(got).all()
    assert rel_err(got, want) <= 1e-5


def test_decode_reference_traced_start():
    case = _decode_case(1, b=1, t=2, h=2, length=32, start=9)
    scale = 0.1
    q_latent = jnp.einsum("bthd,hrd->bthr", case["q_nope"], case["w_uk"], precision="highest")
    f = jax.jit(lambda s: mla.mla_decode_attention(q_latent, jnp.asarray(case["q_rope"]), jnp.asarray(case["cache"]),
                                                   s, scale=scale))
    got = np.einsum("bthr,hrd->bthd", np.asarray(f(jnp.int32(9)), np.float64), case["w_uv"])
    assert rel_err(got, expanded_attention(case, 9, scale)) <= 1e-5


def torch_eager(q, k, v, scale):
    """transformers' eager_attention_forward for a causal MLA prefill, in the inputs' dtype."""
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # [B, H, T, D]
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    t = q.shape[2]
    mask = torch.triu(torch.full((t, t), torch.finfo(w.dtype).min, dtype=w.dtype), 1)
    w = torch.softmax(w + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v).transpose(1, 2)


@pytest.mark.parametrize("scale", [48 ** -0.5, 0.6], ids=["scale48^-0.5", "scale0.6"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_reference_vs_torch(dtype, scale):
    rng = np.random.default_rng(input_seed(3))
    b, t, h, dqk, dv = 2, 13, 4, 48, 32
    arrs = [rng.standard_normal((b, t, h, d)).astype(np.float32) for d in (dqk, dqk, dv)]
    tdt = getattr(torch, dtype)
    want = torch_eager(*(torch.tensor(a).to(tdt) for a in arrs), scale).float().numpy()
    got = mla.mla_prefill_attention(*(jnp.asarray(a, dtype) for a in arrs), scale=scale)
    assert got.dtype == jnp.dtype(dtype)
    # bf16: bit-exact against torch on CPU over 10 seeds (same op order); stays at one bf16 ulp (2^-8 = 3.9e-3) for
    # a GPU, whose dots order the sums differently.
    assert rel_err(got, want) <= (1e-5 if dtype == "float32" else 4e-3)


def test_dispatch_errors():
    case = _decode_case(0, b=1, t=2, h=2, length=16, start=3)
    ql = jnp.zeros((1, 2, 2, 64), jnp.float32)
    qr = jnp.asarray(case["q_rope"])
    cache = jnp.asarray(case["cache"])
    with pytest.raises(ValueError, match=r"q_latent.dtype=bfloat16 must be one of \['float32'\]"):
        mla.mla_decode_attention(ql.astype(jnp.bfloat16), qr, cache, 3, scale=1.0)
    with pytest.raises(ValueError, match=r"kv_cache.shape=\(1, 16, 79\) must be \[B, L, R \+ P\]"):
        mla.mla_decode_attention(ql, qr, cache[..., :79], 3, scale=1.0)
    with pytest.raises(ValueError, match="must be an integer scalar"):
        mla.mla_decode_attention(ql, qr, cache, jnp.zeros(2, jnp.int32), scale=1.0)
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"k.shape=\(1, 4, 2, 7\) must be \[B, L, H, Dqk\]"):
        mla.mla_prefill_attention(q, q[..., :7], q, scale=1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,t,h,length,start", [(1, 1, 4, 48, 20), (2, 6, 4, 64, 0), (1, 3, 2, 64, 61),
                                                (1, 16, 2, 256, 100), (1, 2, 4, 320, 250)], ids=lambda v: str(v))
def test_decode_pallas(b, t, h, length, start, dtype):
    """Pallas decode kernel (interpreted on CPU) vs the reference and vs the expanded attention, NaN poison."""
    case = _decode_case(2, b=b, t=t, h=h, length=length, start=start, poison=np.nan)
    scale = 48 ** -0.5
    o = absorbed(case, start, scale, "pallas", jnp.dtype(dtype))
    o_ref = absorbed(case, start, scale, "reference", jnp.dtype(dtype))
    assert np.isfinite(np.asarray(o)).all()
    assert rel_err(o, o_ref) <= 1e-5
    if dtype == "float32":
        got = np.einsum("bthr,hrd->bthd", np.asarray(o, np.float64), case["w_uv"])
        assert rel_err(got, expanded_attention(case, start, scale)) <= 1e-5


@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_decode_pallas_scale(scale):
    """The softmax scale far on either side of Ling's 192^-1/2 (nearly uniform weights, nearly one-hot ones), against
    the expanded attention in float64."""
    case = _decode_case(6, b=1, t=3, h=4, length=64, start=40)
    got = np.einsum("bthr,hrd->bthd", np.asarray(absorbed(case, 40, scale, "pallas"), np.float64), case["w_uv"])
    assert rel_err(got, expanded_attention(case, 40, scale)) <= 1e-5
    assert rel_err(expanded_attention(case, 40, 48 ** -0.5), expanded_attention(case, 40, scale)) > 0.1


# Query chunks narrower than R (block_k), forced split counts that do not divide the blocks (some splits empty when
# start is near 0), awkward T, start near 0 and at L - T, NaN poison past start + T.
_TILED = [
    (dict(block_l=16, block_k=32, num_splits=3), 3, 80, 2, "float32"),
    (dict(block_l=16, num_splits=5), 6, 96, 90, "bfloat16"),
    (dict(block_h=16, block_l=16, block_k=16, num_splits=4), 3, 112, 109, "bfloat16"),
    (dict(block_k=32, num_splits=2, num_warps=8), 6, 64, 0, "float32"),
]


@pytest.mark.parametrize("kw,t,length,start,dtype", _TILED, ids=lambda v: str(v))
def test_decode_pallas_tilings(kw, t, length, start, dtype):
    from pallas_kernels.mla.decode import MLADecodeTuning

    case = _decode_case(5, b=1, t=t, h=4, length=length, start=start, poison=np.nan)
    scale = 48 ** -0.5
    o = absorbed(case, start, scale, "pallas", jnp.dtype(dtype), tuning=MLADecodeTuning(**kw))
    o_ref = absorbed(case, start, scale, "reference", jnp.dtype(dtype))
    assert np.isfinite(np.asarray(o)).all()
    assert rel_err(o, o_ref) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_pallas_default_chunked_queries(dtype):
    """The default tuning with several block_k chunks of R (R = 256 > block_k = 128), as at Ling's R = 512:
    several cache blocks and splits, NaN poison past start + T."""
    case = _decode_case(8, b=1, t=2, h=4, length=160, start=120, r=256)
    scale = 48 ** -0.5
    o = absorbed(case, 120, scale, "pallas", jnp.dtype(dtype))
    assert np.isfinite(np.asarray(o)).all()
    assert rel_err(o, absorbed(case, 120, scale, "reference", jnp.dtype(dtype))) <= 1e-5


def test_decode_pallas_1e30_poison_traced_start():
    case = _decode_case(4, b=1, t=2, h=4, length=64, start=30, poison=1e30)
    q_latent = jnp.einsum("bthd,hrd->bthr", case["q_nope"], case["w_uk"], precision="highest")
    f = jax.jit(lambda s: mla.mla_decode_attention(q_latent, jnp.asarray(case["q_rope"]), jnp.asarray(case["cache"]),
                                                   s, scale=0.2, backend="pallas"))
    got = np.einsum("bthr,hrd->bthd", np.asarray(f(jnp.int32(30)), np.float64), case["w_uv"])
    assert rel_err(got, expanded_attention(case, 30, 0.2)) <= 1e-5


def test_num_splits_plans_one_wave(monkeypatch):
    """The default split count: programs_per_sm × SMs programs in all (one wave), never more splits than blocks."""
    from pallas_kernels.mla import decode

    monkeypatch.setattr(decode, "_n_sms", lambda: 132)
    assert decode._num_splits(32768, 32, n_other=2, per_sm=2) == 132  # T = 1: 2 row blocks × 132 = 264 programs
    assert decode._num_splits(32768, 32, n_other=12, per_sm=2) == 22  # T = 6: 12 row blocks
    assert decode._num_splits(32768, 64, n_other=2, per_sm=1) == 66
    assert decode._num_splits(1024, 32, n_other=2, per_sm=2) == 32  # capped by the 32 blocks
    assert decode._num_splits(16, 32, n_other=2, per_sm=2) == 1
    with pytest.raises(ValueError, match="programs_per_sm=0 must be >= 1"):
        decode.MLADecodeTuning(programs_per_sm=0)
    with pytest.raises(ValueError, match=r"MLADecodeTuning.block_k=None must be a power of two >= 16"):
        decode.MLADecodeTuning(block_k=None)


@pytest.mark.parametrize("per_sm,splits", [(2, 132), (1, 66)])
def test_decode_pallas_split_count_in_lowering(monkeypatch, per_sm, splits):
    """The kernel's partials get the one-wave split count: T = 1 at Ling shapes (2 row blocks of 16), L = 8192."""
    from test_moe import lower_for_cuda

    from pallas_kernels.mla import decode

    sds = jax.ShapeDtypeStruct
    monkeypatch.setattr(decode, "_n_sms", lambda: 132)
    tu = decode.MLADecodeTuning(programs_per_sm=per_sm)
    txt = lower_for_cuda(monkeypatch, [decode],
                         lambda ql, qr, c, s: decode.mla_decode_attention(ql, qr, c, s, scale=192 ** -0.5, tuning=tu),
                         sds((1, 1, 32, 512), jnp.float32), sds((1, 1, 32, 64), jnp.bfloat16),
                         sds((1, 8192, 576), jnp.bfloat16), sds((), jnp.int32))
    assert f"tensor<1x{splits}x32x512xf32>" in txt


def test_decode_pallas_rejects_unaligned_cache():
    case = _decode_case(0, b=1, t=1, h=2, length=37, start=5)
    with pytest.raises(ValueError, match="L=37 to be a multiple of 16"):
        absorbed(case, 5, 0.1, "pallas")


@pytest.mark.parametrize("t,kw", [(1, {}), (6, {}), (1, dict(block_l=64, block_k=512)), (6, dict(block_h=64)),
                                  (6, dict(block_h=32)), (1, dict(block_l=64, num_warps=8, programs_per_sm=1)),
                                  (1, dict(block_l=16, num_splits=7))],
                         ids=lambda v: str(v))
def test_decode_pallas_lowers_for_cuda(monkeypatch, t, kw):
    from test_moe import lower_for_cuda

    from pallas_kernels.mla import decode

    sds = jax.ShapeDtypeStruct
    tu = decode.MLADecodeTuning(**kw)
    txt = lower_for_cuda(monkeypatch, [decode],
                         lambda ql, qr, c, s: decode.mla_decode_attention(ql, qr, c, s, scale=192 ** -0.5, tuning=tu),
                         sds((1, t, 32, 512), jnp.float32), sds((1, t, 32, 64), jnp.bfloat16),
                         sds((1, 8192, 576), jnp.bfloat16), sds((), jnp.int32))
    assert txt.count("stablehlo.custom_call") == 1
