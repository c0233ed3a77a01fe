"""MoE router and experts: the reference against independent NumPy loops, the Pallas kernels (interpreted on
CPU, compiled on a GPU) against the reference, and the dispatcher's error messages."""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from pallas_kernels import moe
from pallas_kernels.common import fp8
from pallas_kernels.moe import reference



ROUTE_KW = dict(n_group=8, topk_group=4, top_k=8, routed_scaling_factor=2.5)


def np_route(x, router, bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True):
    """Token-by-token NumPy router with explicit lower-index tie breaking (stable sort of the negated key)."""
    logits = x.astype(np.float64) @ router.astype(np.float64).T  # router [E, D]
    s = 1.0 / (1.0 + np.exp(-logits))
    choice = s + bias.astype(np.float64)
    n, e = choice.shape
    gsz = e // n_group
    ws, ids = [], []
    for row_s, row in zip(s, choice):
        groups = row.reshape(n_group, gsz)
        gscore = np.array([np.sort(g)[-2:].sum() for g in groups])
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        masked = np.full(e, -np.inf)
        for g in keep:
            masked[g * gsz:(g + 1) * gsz] = row[g * gsz:(g + 1) * gsz]
        sel = np.argsort(-masked, kind="stable")[:top_k]
        w = row_s[sel]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ws.append(w * routed_scaling_factor)
        ids.append(sel)
    return np.array(ws), np.array(ids)


def _router_inputs(seed, n, d=256, e=512, ties=False):
    rng = np.random.default_rng(input_seed(seed))
    x = rng.standard_normal((n, d)).astype(np.float32)
    router = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)  # [E, D]
    bias = (0.01 * rng.standard_normal(e)).astype(np.float32)
    if ties:
        # Exact ties: duplicated router rows and biases, inside a group and across groups, plus whole groups
        # duplicated so that group scores tie too.
        gsz = e // ROUTE_KW["n_group"]
        for a, b in [(3, 5), (7, 200), (64, 65), (130, 400)]:
            router[b] = router[a]
            bias[b] = bias[a]
        router[2 * gsz:3 * gsz] = router[5 * gsz:6 * gsz]
        bias[2 * gsz:3 * gsz] = bias[5 * gsz:6 * gsz]
        # Near tie: a duplicated row whose bias is larger by a few fp32 ulps of the biased score (~1).
        router[11] = router[10]
        bias[11] = bias[10] + np.float32(3e-7)
        # Make the duplicated experts strong so the ties decide the top-8.
        x[:, :] += 3.0 * np.sign(router[3] + router[64] + router[10])[None, :]
    return x, router, bias


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_route_reference(ties):
    x, router, bias = _router_inputs(0, 64, ties=ties)
    w, ids = moe.route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), **ROUTE_KW)
    w_np, ids_np = np_route(x, router, bias, **ROUTE_KW)
    np.testing.assert_array_equal(np.asarray(ids), ids_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-5, atol=1e-6)
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32


def test_route_hand_table():
    # E = 8 in 4 groups of 2; keep 2 groups; top 3. choice = s + bias with logits 0 (s = 0.5) and hand biases.
    bias = np.array([0.1, 0.0, 0.3, 0.2, 0.0, 0.0, 0.3, 0.2], np.float32)
    x = np.zeros((1, 4), np.float32)
    router = np.zeros((8, 4), np.float32)  # [E, D]
    w, ids = moe.route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), n_group=4, topk_group=2, top_k=3,
                       routed_scaling_factor=2.5)
    # Group scores: g0 = 1.1, g1 = 1.5, g2 = 1.0, g3 = 1.5 -> groups 1 and 3 (tie at 1.5: both kept).
    # Choice in kept groups: e2 0.8, e3 0.7, e6 0.8, e7 0.7 -> e2, e6 (tie at 0.8), then e3 beats e7 (lower index).
    np.testing.assert_array_equal(np.asarray(ids), [[2, 6, 3]])
    np.testing.assert_allclose(np.asarray(w), [[2.5 / 3] * 3], rtol=1e-6)
    _, ids_nonorm = moe.route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), n_group=4, topk_group=1,
                              top_k=2, routed_scaling_factor=1.0, norm_topk_prob=False)
    # Group tie 1 vs 3 at 1.5 -> group 1 (lower index).
    np.testing.assert_array_equal(np.asarray(ids_nonorm), [[2, 3]])


def np_mlp(x, wg, wu, wd, limit):
    """Expert matrices [out, in] (torch's layout): gate/up [I, D], down [D, I]."""
    g, u = x @ wg.T, x @ wu.T
    sg = g / (1 + np.exp(-g))
    if limit:
        sg, u = np.minimum(sg, limit), np.clip(u, -limit, limit)
    return (sg * u) @ wd.T


def np_moe(x, weights, ids, we_gate, we_up, we_down, ws=None, *, limit=0.0, shared_limit=0.0):
    x, weights = x.astype(np.float64), weights.astype(np.float64)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            y[n] += weights[n, k] * np_mlp(x[n], we_gate[e], we_up[e], we_down[e], limit)
    if ws is not None:
        y += np_mlp(x, *ws, shared_limit)
    return y


def _expert_inputs(seed, n, *, d=128, i=64, e=16, k=4, i_s=64, dtype=jnp.float32, repeat=True, big=False):
    rng = np.random.default_rng(input_seed(seed))
    # Scale so that |g|, |u| reach a few units: the clamps at 4/5/7 engage with `big`.
    amp = 3.0 if big else 1.0
    x = (amp * rng.standard_normal((n, d))).astype(np.float32)
    wscale = 1.0 / np.sqrt(d)
    # Every expert matrix [out, in]: gate/up [.., I, D], down [.., D, I]; shared [Is, D], [D, Is].
    we_gate = (wscale * rng.standard_normal((e, i, d))).astype(np.float32)
    we_up = (wscale * rng.standard_normal((e, i, d))).astype(np.float32)
    we_down = (rng.standard_normal((e, d, i)) / np.sqrt(i)).astype(np.float32)
    ws = tuple(a.astype(np.float32) for a in (wscale * rng.standard_normal((i_s, d)),
                                               wscale * rng.standard_normal((i_s, d)),
                                               rng.standard_normal((d, i_s)) / np.sqrt(i_s)))
    if repeat:
        # Tokens share experts: draw from a pool smaller than n·k so most experts repeat across tokens.
        pool = rng.choice(e, size=min(e, k + 2), replace=False)
        ids = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(n)])
    else:
        ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)])
    weights = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    args = (cast(x), jnp.asarray(weights), jnp.asarray(ids, jnp.int32), cast(we_gate), cast(we_up), cast(we_down))
    np_args = (x, weights, ids, we_gate, we_up, we_down)
    if dtype == jnp.bfloat16:
        np_args = tuple(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) if a.dtype == np.float32
                        and j != 1 else a for j, a in enumerate(np_args))
        ws = tuple(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in ws)
    return args, tuple(cast(a) for a in ws), np_args, ws


# Ling's limits (routed 4, shared 5 or 7) and a pair far below them, the routed one the tighter.
LIMITS = {"noclamp": (0.0, 0.0), "clamp": (4.0, 5.0), "clamp0.5-2": (0.5, 2.0)}


@pytest.mark.parametrize("limits", list(LIMITS))
@pytest.mark.parametrize("n", [1, 3, 16])
def test_experts_reference_f32(n, limits):
    limit, shared_limit = LIMITS[limits]
    args, ws, np_args, np_ws = _expert_inputs(n, n, big=limit > 0)
    y = moe.moe_experts(*args, *ws, limit=limit, shared_limit=shared_limit)
    want = np_moe(*np_args, np_ws, limit=limit, shared_limit=shared_limit)
    assert y.dtype == jnp.float32
    assert rel_err(y, want) <= 1e-5
    if limit:  # each clamp engages: dropping either one moves the result
        assert rel_err(np_moe(*np_args, np_ws, shared_limit=shared_limit), want) > 1e-2
        assert rel_err(np_moe(*np_args, np_ws, limit=limit), want) > 1e-3


def test_experts_reference_clamp_engages():
    args, ws, _, _ = _expert_inputs(7, 4, big=True)
    y0 = moe.moe_experts(*args, *ws)
    y1 = moe.moe_experts(*args, *ws, limit=1.0, shared_limit=1.0)
    assert float(jnp.max(jnp.abs(y0 - y1))) > 1e-2


def test_experts_reference_paths_agree():
    for dtype in (jnp.float32, jnp.bfloat16):
        args, ws, _, _ = _expert_inputs(3, 40, dtype=dtype, big=True)
        a = reference.moe_experts(*args, *ws, limit=4.0, shared_limit=5.0, path="gather")
        b = reference.moe_experts(*args, *ws, limit=4.0, shared_limit=5.0, path="sorted")
        # bf16: the two paths round the same products in another order; measured max 6.5e-5 over 10 seeds (3x).
        assert rel_err(a, b) <= (1e-6 if dtype == jnp.float32 else 2e-4)


def test_experts_reference_bf16():
    args, ws, np_args, np_ws = _expert_inputs(5, 6, dtype=jnp.bfloat16, big=True)
    y = moe.moe_experts(*args, *ws, limit=4.0, shared_limit=5.0)
    want = np_moe(*np_args, np_ws, limit=4.0, shared_limit=5.0)
    assert y.dtype == jnp.bfloat16
    # bf16 activations and outputs against float64 on the same bf16 weights: measured max 4.5e-3 over 60 seeds
    # on CPU (2.2x).
    assert rel_err(y, want) <= 1e-2


def test_experts_no_shared():
    args, _, np_args, _ = _expert_inputs(2, 2)
    y = moe.moe_experts(*args)
    assert rel_err(y, np_moe(*np_args)) <= 1e-5


def test_dispatch_errors():
    args, ws, _, _ = _expert_inputs(0, 2)
    x, w, ids, wg, wu, wd = args
    with pytest.raises(ValueError, match=r"x.shape=\(128,\) must be \[N, D\]"):
        moe.moe_experts(x[0], w, ids, wg, wu, wd)
    with pytest.raises(ValueError, match=r"we_down.shape=\(16, 64, 128\) must be \[E, D, I\] = \(16, 128, 64\) "
                                         r"\(torch's \[out, in\]\); it looks like the \[.., I, D\] down layout"):
        moe.moe_experts(x, w, ids, wg, wu, jnp.swapaxes(wd, 1, 2))
    with pytest.raises(ValueError, match=r"we_down.shape=\(16, 128, 32\) must be \[E, D, I\] = \(16, 128, 64\)$"):
        moe.moe_experts(x, w, ids, wg, wu, wd[:, :, :32])
    with pytest.raises(ValueError, match=r"we_down.shape=\(8, 64, 128\) must be \[E, D, I\] = \(16, 128, 64\)$"):
        moe.moe_experts(x, w, ids, wg, wu, jnp.swapaxes(wd, 1, 2)[:8])  # swapped, but E is wrong too: no hint
    with pytest.raises(ValueError, match=r"we_down.shape=\(64, 128\) must be \[E, D, I\] = \(16, 128, 64\)$"):
        moe.moe_experts(x, w, ids, wg, wu, wd[0].T)  # one expert, transposed: the E axis is missing, no hint
    with pytest.raises(ValueError, match=r"ws_down.shape=\(64, 128\) must be \[D, Is\] = \(128, 64\) .*swap"):
        moe.moe_experts(x, w, ids, wg, wu, wd, ws[0], ws[1], ws[2].T)
    with pytest.raises(ValueError, match="all three or none"):
        moe.moe_experts(x, w, ids, wg, wu, wd, ws[0])
    with pytest.raises(ValueError, match="backend='triton' must be one of"):
        moe.moe_experts(x, w, ids, wg, wu, wd, backend="triton")
    with pytest.raises(ValueError, match=r"we_gate.dtype=bfloat16 must be one of \['float32'\]"):
        moe.moe_experts(x, w, ids, wg.astype(jnp.bfloat16), wu, wd)
    router = jnp.zeros((512, 128), jnp.float32)  # [E, D]
    with pytest.raises(ValueError, match=r"router.dtype=float16 must be one of \['float32', 'bfloat16'\]"):
        moe.route(x, router.astype(jnp.float16), jnp.zeros(512), **ROUTE_KW)
    with pytest.raises(ValueError, match="n_group=7 must divide"):
        moe.route(x, router, jnp.zeros(512), **{**ROUTE_KW, "n_group": 7})
    # A [D, E] router (the layout before): the message names the shape, the layout and the fix.
    with pytest.raises(ValueError, match=r"router.shape=\(128, 512\) must be \[E, D\] .* D = x.shape\[1\] = 128 "
                                         r"\(a \[D, E\] router from before: pass router.T\)"):
        moe.route(x, router.T, jnp.zeros(512), **ROUTE_KW)
    with pytest.raises(ValueError, match=r"router.shape=\(512, 64\) must be \[E, D\]"):
        moe.route(x, router[:, :64], jnp.zeros(512), **ROUTE_KW)


ROUTE_VARIANTS = {
    # Fewer, larger groups keeping one, top 4, no renormalisation, unit scale: with norm_topk_prob off the weights
    # are the raw sigmoid scores, so a kernel that renormalised anyway (or dropped the scale) is caught.
    "g4-keep1-top4-raw": dict(n_group=4, topk_group=1, top_k=4, routed_scaling_factor=1.0, norm_topk_prob=False),
    # One group (no group restriction), top 2, a scale far below Ling's 2.5, renormalised.
    "g1-top2-scale0.3": dict(n_group=1, topk_group=1, top_k=2, routed_scaling_factor=0.3),
    "g8-keep4-top8-raw": dict(ROUTE_KW, norm_topk_prob=False),
}


@pytest.mark.parametrize("variant", list(ROUTE_VARIANTS))
@pytest.mark.parametrize("n", [1, 7])
def test_route_variants(n, variant):
    """Every routing scalar away from Ling's values: the reference against the NumPy loops and the Pallas router
    (interpreted on CPU) against the reference, ids exactly, random inputs and ties."""
    kw = ROUTE_VARIANTS[variant]
    for ties in (False, True):
        x, router, bias = _router_inputs(500, n, ties=ties)
        args = (jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias))
        w_ref, ids_ref = moe.route(*args, **kw)
        w_np, ids_np = np_route(x, router, bias, **kw)
        np.testing.assert_array_equal(np.asarray(ids_ref), ids_np)
        np.testing.assert_allclose(np.asarray(w_ref), w_np, rtol=1e-5, atol=1e-6)
        w, ids = moe.route(*args, **kw, backend="pallas")
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
    # The chosen variant differs visibly from the default routing's weights (not a no-op change of arguments).
    if not kw.get("norm_topk_prob", True):
        w_norm, _ = moe.route(*args, **dict(kw, norm_topk_prob=True))
        assert rel_err(w_ref, w_norm) > 0.1


@pytest.mark.parametrize("n", [1, 7, 40])
def test_route_pallas(n):
    """Pallas router (interpreted on CPU) selects exactly the reference's experts, over many inputs and ties."""
    for seed in range(6):
        x, router, bias = _router_inputs(100 + seed, n, ties=seed % 2 == 1)
        args = (jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias))
        w, ids = moe.route(*args, **ROUTE_KW, backend="pallas")
        w_ref, ids_ref = moe.route(*args, **ROUTE_KW)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
        assert ids.dtype == jnp.int32 and w.dtype == jnp.float32


@pytest.mark.parametrize("router_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_route_norm_prologue(n, dtype, router_dtype):
    """The router norming its input (the block's post-attention RMSNorm, in the GEMV's prologue on Pallas): the
    normed x it returns is `rms_norm`'s (float32 <= 1e-6; bf16 within one rounding, 4e-3, since a GPU's rsqrt may
    differ from XLA's in the last bit) and the routing is the reference's on that x, ids exactly, at T = 1 (FMA
    programs), 7 (per-token programs) and 40 (the dot), an fp32 and a bf16 router."""
    from pallas_kernels.gemv.reference import rms_norm

    tol = 1e-6 if dtype == jnp.float32 else 4e-3
    for seed in range(3):
        x, router, bias = _router_inputs(700 + seed, n)
        rng = np.random.default_rng(input_seed(710 + seed))
        # An unnormalised block input (RMS ~6, offset rows) and a norm weight away from one.
        h = jnp.asarray(6.0 * x + rng.standard_normal((n, 1)), dtype)
        weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape[1]), dtype)
        norm = (weight, 1e-6)
        args = (h, jnp.asarray(router, router_dtype), jnp.asarray(bias))
        w, ids, xn = moe.route(*args, **ROUTE_KW, backend="pallas", norm=norm)
        w_ref, ids_ref, xn_ref = moe.route(*args, **ROUTE_KW, norm=norm)
        want = rms_norm(h, *norm)
        assert xn.dtype == dtype and xn.shape == h.shape
        np.testing.assert_array_equal(np.asarray(xn_ref), np.asarray(want))
        assert rel_err(xn, want) <= tol, rel_err(xn, want)
        assert rel_err(want, h) > 0.5  # the norm moved x
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
        w_plain, ids_plain = moe.route(want, *args[1:], **ROUTE_KW)
        np.testing.assert_array_equal(np.asarray(ids_ref), np.asarray(ids_plain))


def test_route_norm_refusals():
    x, router, bias = (jnp.asarray(a) for a in _router_inputs(720, 1))
    d = x.shape[1]
    bad = (((jnp.ones(d + 1), 1e-6), r"norm\[0\]\.shape"), ((jnp.ones(d, jnp.int32), 1e-6), r"norm\[0\]\.dtype"),
           ((jnp.ones(d), 0.0), "eps"), ((jnp.ones(d),), "pair"))
    for norm, msg in bad:
        with pytest.raises(ValueError, match=msg):
            moe.route(x, router, bias, **ROUTE_KW, backend="pallas", norm=norm)


@pytest.mark.parametrize("n,block_e", [(1, None), (1, 16), (7, None), (40, None)])
def test_route_bf16_router_is_its_fp32_copy(n, block_e):
    """A bf16-stored router (the BF16 release's `mlp.gate.weight`, kept as stored) gives exactly what its fp32
    copy gives: the kernels widen each weight tile before the same products in the same order, so ids and weights
    are bit-identical (reference backend likewise), and the ids are the reference's, random inputs and near ties.
    T = 1 by the defaults and with 16-row programs, 7 tokens (per-token programs), 40 (the dot)."""
    from pallas_kernels.moe import router as router_mod

    tu = None if block_e is None else router_mod.RouterTuning(block_e=block_e, block_k=64, num_warps=1)
    for seed in range(4):
        x, router, bias = _router_inputs(300 + seed, n, ties=seed % 2 == 1)
        r16 = jnp.asarray(router, jnp.bfloat16)
        assert float(jnp.max(jnp.abs(r16.astype(jnp.float32) - router))) > 0  # the rounding moved values
        x, bias = jnp.asarray(x), jnp.asarray(bias)
        w16, i16 = router_mod.route(x, r16, bias, **ROUTE_KW, tuning=tu)
        w32, i32 = router_mod.route(x, r16.astype(jnp.float32), bias, **ROUTE_KW, tuning=tu)
        np.testing.assert_array_equal(np.asarray(i16), np.asarray(i32))
        np.testing.assert_array_equal(np.asarray(w16), np.asarray(w32))
        w_ref, ids_ref = moe.route(x, r16, bias, **ROUTE_KW)
        w_ref32, ids_ref32 = moe.route(x, r16.astype(jnp.float32), bias, **ROUTE_KW)
        np.testing.assert_array_equal(np.asarray(ids_ref), np.asarray(ids_ref32))
        np.testing.assert_array_equal(np.asarray(w_ref), np.asarray(w_ref32))
        np.testing.assert_array_equal(np.asarray(i16), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w16), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(ids_ref), np_route(np.asarray(x), np.asarray(r16, np.float32),
                                                                     np.asarray(bias), **ROUTE_KW)[1])


@pytest.mark.parametrize("be", [1, 2, 16])
def test_route_pallas_t1_blocks(be):
    """The T = 1 GEMV with 1, 2 and 16 rows per program selects the reference's experts, random inputs and near
    ties, with BK 512 > D (one chunk) and BK 32."""
    from pallas_kernels.moe import router as router_mod

    for seed in range(4):
        x, router, bias = _router_inputs(200 + seed, 1, ties=seed % 2 == 1)
        args = (jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias))
        tu = router_mod.RouterTuning(block_e=be, block_k=(512, 32)[seed // 2], num_warps=1)
        w, ids = router_mod.route(*args, **ROUTE_KW, tuning=tu)
        w_ref, ids_ref = moe.route(*args, **ROUTE_KW)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,d,ks,used,multi", [(1, 240, 5, 5, None), (1, 240, 4, 3, None), (1, 256, 5, 4, None),
                                                (5, 240, 16, 15, "dot"), (5, 256, 4, 4, "dot"),
                                                (40, 256, 1, 1, "dot"), (40, 256, 4, 4, "dot"),
                                                (5, 240, 5, 5, "per_token"), (5, 240, 3, 3, "per_token_blocks")])
def test_route_pallas_k_splits(n, d, ks, used, multi):
    """D-splits: the partial logits of `used` splits (the largest count <= KS dividing D into multiples of 16)
    summed by the top-k kernel select the reference's experts, random inputs and near ties, T = 1 and N > 1
    (the dot over 1 and 3 blocks of 16 tokens; one token per program, VERIFY_TUNING's blocks and 4-row ones)."""
    from pallas_kernels.moe import router as router_mod

    assert router_mod._split_count(d, ks) == used
    if multi in (None, "per_token"):
        base = router_mod.DECODE_TUNING if multi is None else router_mod.VERIFY_TUNING
    elif multi == "per_token_blocks":
        base = dataclasses.replace(router_mod.VERIFY_TUNING, block_e=4, block_k=32)
    else:
        base = router_mod.RouterTuning()
    for seed in range(2):
        x, router, bias = _router_inputs(300 + seed, n, d=d, ties=seed == 1)
        args = (jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias))
        tu = dataclasses.replace(base, k_splits=ks)
        w, ids = router_mod.route(*args, **ROUTE_KW, tuning=tu)
        w_ref, ids_ref = moe.route(*args, **ROUTE_KW)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)


def test_router_tuning_errors():
    from pallas_kernels.moe import router as router_mod
    from pallas_kernels.moe.router import RouterTuning

    with pytest.raises(ValueError, match=r"RouterTuning.block_k=48 must be a power of two"):
        RouterTuning(block_k=48)
    with pytest.raises(ValueError, match=r"RouterTuning.block_n=8 must be a power of two >= 16"):
        RouterTuning(block_n=8)
    with pytest.raises(ValueError, match=r"RouterTuning.num_stages=0 must be >= 1"):
        RouterTuning(num_stages=0)
    with pytest.raises(ValueError, match=r"RouterTuning.k_splits=0 must be >= 1"):
        RouterTuning(k_splits=0)
    with pytest.raises(ValueError, match=r"RouterTuning.multi_token='tokens' must be 'dot' or 'per_token'"):
        RouterTuning(multi_token="tokens")
    with pytest.raises(ValueError,
                       match=r"RouterTuning.prefetch_chunk_bytes=100 must be a non-negative multiple of 16 bytes"):
        RouterTuning(prefetch_chunk_bytes=100)
    x, router, bias = (jnp.asarray(a) for a in _router_inputs(0, 3))
    with pytest.raises(ValueError, match=r"RouterTuning.block_k=8 at N=3 tokens with the tensor-core dot: it needs"):
        router_mod.route(x, router, bias, **ROUTE_KW, tuning=RouterTuning(block_k=8))
    with pytest.raises(ValueError, match=r"prefetch\[1\] is list; it must be an array"):
        moe.route(x, router, bias, **ROUTE_KW, backend="pallas", prefetch=(router, [1, 2]))
    with pytest.raises(ValueError, match=r"prefetch\[0\] shape \(3,\) bfloat16 is not a multiple of 16 bytes"):
        moe.route(x, router, bias, **ROUTE_KW, backend="pallas", prefetch=(jnp.ones(3, jnp.bfloat16),))
    from pallas_kernels.common.prefetch import prefetch_l2

    with pytest.raises(ValueError, match=r"prefetch_l2: n_bytes=100 must be a positive multiple of 16"):
        prefetch_l2(None, 0, 100)


@pytest.mark.parametrize("n", [1, 5])
def test_route_pallas_prefetch_keeps_results(n):
    """The top-k launch's L2 prefetch programs (RouterTuning.prefetch_chunk_bytes) change no result: T = 1 and
    N > 1 (the prefetch-only programs map onto the last token's blocks), chunks that divide the arrays, ragged last
    chunks, chunks larger than an array and an empty array; via the dispatcher too (T = 1 prefetches by default)."""
    from pallas_kernels.moe import router as router_mod

    keys = jax.random.split(jax.random.key(5), 3)
    arrays = (jax.random.normal(keys[0], (40, 256), jnp.bfloat16), jax.random.normal(keys[1], (3, 104), jnp.bfloat16),
              jax.random.normal(keys[2], (7, 8), jnp.float32))  # 20480, 624 and 224 bytes
    base = router_mod.DECODE_TUNING if n == 1 else router_mod.VERIFY_TUNING
    for seed in range(2):
        x, router, bias = (jnp.asarray(a) for a in _router_inputs(400 + seed, n, ties=seed == 1))
        w_ref, ids_ref = moe.route(x, router, bias, **ROUTE_KW)
        plain = router_mod.route(x, router, bias, **ROUTE_KW, tuning=dataclasses.replace(base, prefetch_chunk_bytes=0))
        for chunk in (1024, 160, 120 * 1024):
            tu = dataclasses.replace(base, prefetch_chunk_bytes=chunk)
            w, ids = router_mod.route(x, router, bias, **ROUTE_KW, tuning=tu, prefetch=arrays)
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(plain[1]))
            np.testing.assert_array_equal(np.asarray(w), np.asarray(plain[0]))
        np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(ids_ref))
        w, ids = moe.route(x, router, bias, **ROUTE_KW, backend="pallas", prefetch=arrays + (jnp.zeros((0, 8)),))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gpu", ["H200", "A100"])
def test_route_prefetch_lowers_for_cuda(monkeypatch, gpu):
    """Through the dispatcher at Flash size and T = 1, the top-k launch gets one program per 120 KiB chunk of the
    shared expert (3 x 32) and the bulk L2 prefetch instruction with the evict_normal policy; before Hopper (no
    cp.async.bulk) the programs stay and prefetch nothing."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.common import prefetch
    from pallas_kernels.moe import router as router_mod

    jax.clear_caches()  # the prefetch is decided when the kernel is traced: no trace cached for another GPU here
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    fn = lambda x, r, b, *sh: moe.route(x, r, b, **ROUTE_KW, backend="pallas", prefetch=sh)  # noqa: E731
    txt = lower_for_cuda(monkeypatch, [router_mod, prefetch], fn, sds((1, 2560), bf), sds((512, 2560), jnp.float32),
                         sds((512,), jnp.float32), *[sds((768, 2560), bf)] * 3, gpu=getattr(gpu_info.GpuVersion, gpu))
    topk = txt.split("stablehlo.custom_call")[2]
    assert re.search(r'name = "([^"]+)"', topk).group(1) == "router_fwd_kernel_topk"
    assert "grid_x = 97" in topk
    assert ("createpolicy.fractional.L2::evict_normal" in topk) == (gpu == "H200")
    assert ("cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1+0], 122880, pol;" in topk) == (gpu == "H200")


@pytest.mark.parametrize("n,grid", [(2, 98), (17, 17)])
def test_route_prefetch_by_token_count(monkeypatch, n, grid):
    """At 2 <= N <= 16 (router.VERIFY_TUNING) the top-k launch prefetches the shared expert too: N top-k programs
    + 96 prefetch programs; past 16 tokens (WIDE_TUNING) none."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.common import prefetch
    from pallas_kernels.moe import router as router_mod

    jax.clear_caches()
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    fn = lambda x, r, b, *sh: moe.route(x, r, b, **ROUTE_KW, backend="pallas", prefetch=sh)  # noqa: E731
    txt = lower_for_cuda(monkeypatch, [router_mod, prefetch], fn, sds((n, 2560), bf), sds((512, 2560), jnp.float32),
                         sds((512,), jnp.float32), *[sds((768, 2560), bf)] * 3, gpu=gpu_info.GpuVersion.H200)
    topk = [c for c in txt.split("stablehlo.custom_call")[1:]
            if re.search(r'name = "([^"]+)"', c).group(1) == "router_fwd_kernel_topk"][0]
    assert f"grid_x = {grid}" in topk
    assert ("cp.async.bulk.prefetch.L2" in topk) == (n <= router_mod.PER_TOKEN_MAX)


def test_prefetch_chunks_and_asm():
    """Chunking of the prefetched arrays (elements per chunk, chunks, bytes of the last one) and the emitted PTX:
    ranges above one instruction's 2^20 - 16 byte limit are issued in 512 KiB pieces from the same address."""
    from pallas_kernels.common.prefetch import _asm
    from pallas_kernels.moe.router import _prefetch_chunks

    arrays = (jnp.zeros((3, 104), jnp.bfloat16), jnp.zeros((768, 2560), jnp.bfloat16), jnp.zeros((7, 8), jnp.float32))
    assert _prefetch_chunks(arrays, 160) == ((80, 4, 144), (80, 24576, 160), (40, 2, 64))
    assert _prefetch_chunks(arrays[1:2], 120 * 1024) == ((61440, 32, 122880),)
    assert _prefetch_chunks(arrays[:1], 4096) == ((312, 1, 624),)  # one chunk smaller than chunk_bytes
    asm = _asm((1 << 20) + 48)
    assert re.findall(r"\[\$1\+(\d+)\], (\d+), pol;", asm) == [("0", "524288"), ("524288", "524288"),
                                                                   ("1048576", "48")]
    assert "L2::evict_normal" in asm and "setp.eq.u32 p, t, 0;" in asm


def test_route_pallas_bf16_input_and_hand_table():
    x, router, bias = _router_inputs(7, 9, ties=True)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(router), jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(moe.route(*args, **ROUTE_KW, backend="pallas")[1]),
                                  np.asarray(moe.route(*args, **ROUTE_KW)[1]))
    bias = jnp.asarray([0.1, 0.0, 0.3, 0.2, 0.0, 0.0, 0.3, 0.2], jnp.float32)
    _, ids = moe.route(jnp.zeros((1, 16)), jnp.zeros((8, 16)), bias, n_group=4, topk_group=2, top_k=4,
                       routed_scaling_factor=2.5, backend="pallas")
    np.testing.assert_array_equal(np.asarray(ids), [[2, 6, 3, 7]])


def test_route_pallas_exact_ties():
    """Many exact ties (scores on a coarse grid): equal experts in and across groups, equal group scores, equal
    top-2 members; T = 1 GEMV programs of 1 to 32 rows (tokens 0 and 1 alone) and the batched dot. Selection must
    match lax.top_k's lower-index order exactly."""
    from pallas_kernels.moe import router as router_mod

    rng = np.random.default_rng(input_seed(11))
    d, e, n = 64, 512, 12
    x = rng.standard_normal((n, d)).astype(np.float32)
    # Few distinct router rows and biases on a coarse grid: most scores collide exactly.
    rows4 = rng.standard_normal((4, d)).astype(np.float32) / 8
    router = rows4[rng.integers(0, 4, e)]  # [E, D]
    bias = (rng.integers(0, 3, e) * 0.25).astype(np.float32)
    bias[64:128] = bias[0:64]  # group 1 = group 0: equal group scores
    router[64:128] = router[0:64]
    x[0] = 0.0  # token 0: every logit 0, only the bias grid decides
    args = (jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias))
    w_ref, ids_ref = moe.route(*args, **ROUTE_KW)
    np.testing.assert_array_equal(np.asarray(ids_ref), np_route(x, router, bias, **ROUTE_KW)[1])
    # The defaults by T (None), T = 1 programs with awkward blocks (BE 1, 4 or 32, BK below or above D, one warp
    # top-k); these tunings' batched rows take the dot GEMV (multi_token="dot": BE >= 16, else an error).
    RT = router_mod.RouterTuning
    for tu in (None, RT(block_e=1, block_k=16), RT(block_e=4, block_k=1024),
               RT(block_e=32, block_k=16, topk_warps=1), RT(block_e=128, block_k=32, block_n=32)):
        for rows in (slice(None), slice(0, 1), slice(1, 2)):
            if rows == slice(None) and tu is not None and tu.block_e < 16:
                msg = rf"block_e={tu.block_e} \(E=512: {tu.block_e} expert rows per program\) at N={n} tokens"
                with pytest.raises(ValueError, match=msg + ": the tensor-core dot needs >= 16"):
                    router_mod.route(args[0][rows], *args[1:], **ROUTE_KW, tuning=tu)
                continue
            w, ids = router_mod.route(args[0][rows], *args[1:], **ROUTE_KW, tuning=tu)
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref[rows]))
            np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref[rows]), rtol=1e-5, atol=1e-6)


# The fused kernels against the reference in bf16 (see test_experts_pallas for the measurement).
BF16_EXPERTS_TOL = 2e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("limits", [(0.0, 0.0), (4.0, 5.0)], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("n", [1, 2, 3, 6, 16])
def test_experts_pallas(n, limits, dtype):
    """Fused experts kernel (interpreted on CPU) vs the reference; tokens share experts (each read once)."""
    dtype = jnp.dtype(dtype)
    args, ws, _, _ = _expert_inputs(10 + n, n, k=8, e=32, dtype=dtype, big=limits[0] > 0)
    kw = dict(limit=limits[0], shared_limit=limits[1])
    y = moe.moe_experts(*args, *ws, **kw, backend="pallas")
    y_ref = moe.moe_experts(*args, *ws, **kw)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert np.isfinite(np.asarray(y, np.float32)).all()
    # bf16: mostly bit-exact in interpret mode; a near-tie in a bf16 rounding of h or y flips one ulp now and then
    # (T = 2, 3): measured max 5.3e-4 over 60 seeds on CPU (BF16_EXPERTS_TOL is 3.8x).
    assert rel_err(y, y_ref) <= (1e-5 if dtype == jnp.float32 else BF16_EXPERTS_TOL)


@pytest.mark.parametrize("n", [1, 3])
def test_experts_pallas_far_scalars(n):
    """The fused kernel at scalars far from Ling's: top 2 of 16 experts, clamps far below Ling's (routed 0.5, shared
    2), against the NumPy loops; T = 1 (the decode kernels) and T = 3."""
    args, ws, np_args, np_ws = _expert_inputs(60 + n, n, k=2, big=True)
    kw = dict(limit=0.5, shared_limit=2.0)
    y = moe.moe_experts(*args, *ws, **kw, backend="pallas")
    assert rel_err(y, np_moe(*np_args, np_ws, **kw)) <= 1e-5


# Small blocks so every loop runs several chunks at the test sizes (D = 128, I = 64): BK = 32, BKI = 16.
_SMALL = dict(block_k=32, block_ki=16)
_TUNINGS = {  # every gate/up product form, rows per program and down shape
    "bi16": dict(_SMALL),  # T = 1: 16-row gate/up programs (the field defaults)
    "bi2": dict(_SMALL, block_i=2, warps_gate_up=1),  # T = 1: the decode default's shape
    "dot": dict(_SMALL, block_i=32, block_d=16),  # T > 1, x·Wᵀ
    "dot_w": dict(_SMALL, dot_gate_up="dot_w"),  # T > 1, W·xᵀ: the weight tile as the left operand
    "down_bd1": dict(_SMALL, block_d=1, warps_down=1),  # T = 1 down: the decode default's shape, 4 chunks
    "down_bd4": dict(_SMALL, block_d=4, warps_down=1),  # T = 1 down, 4 features per program
    "fma_tokens": dict(_SMALL, verify_gate_up="fma_tokens", block_i=2, warps_gate_up=1),  # T > 1, per-token FMAs
    # T = 1 down as (slot, 16 features) programs over all of I (4 chunks), the partials combined by XLA
    "down_slots": dict(_SMALL, block_d=16, warps_down=4, down_t1="slots"),
    "down_slots_reduce": dict(_SMALL, block_d=4, warps_down=1, down_t1="slots", t1_products="reduce"),
    # ... and each feature block's last program combining
    "down_slots_last": dict(_SMALL, block_d=16, warps_down=4, down_t1="slots_last"),
    # ... after the T > 1 dot gate/up (h with 16 token rows, the down reading the first)
    "down_slots_dot": dict(_SMALL, block_i=16, block_d=16, warps_down=4, down_t1="slots", t1_gate_up="dot"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,tu", [(1, "bi16"), (1, "bi2"), (1, "down_bd1"), (1, "down_bd4"), (1, "down_slots"),
                                  (1, "down_slots_reduce"), (1, "down_slots_last"), (1, "down_slots_dot"),
                                  (3, "dot"), (3, "dot_w"),
                                  (16, "dot"), (2, "fma_tokens"), (5, "fma_tokens")])
def test_experts_pallas_tunings(n, tu, dtype):
    """ExpertsTuning variants (product form, rows per program, multi-chunk loops) vs the reference, clamps on."""
    from pallas_kernels.moe.experts import ExpertsTuning, moe_experts_fused

    dtype = jnp.dtype(dtype)
    args, ws, _, _ = _expert_inputs(30 + n, n, k=8, e=32, dtype=dtype, big=True)
    y = moe_experts_fused(*args, *ws, limit=4.0, shared_limit=5.0, tuning=ExpertsTuning(**_TUNINGS[tu]))
    y_ref = moe.moe_experts(*args, *ws, limit=4.0, shared_limit=5.0)
    assert y.dtype == dtype
    # bf16: bit-exact over 10 seeds in interpret mode; the bound of the same kernels in test_experts_pallas.
    assert rel_err(y, y_ref) <= (1e-5 if dtype == jnp.float32 else BF16_EXPERTS_TOL)


@pytest.mark.parametrize("n,tu", [(1, "bi16"), (1, "bi2"), (1, "down_bd1"), (1, "down_slots"),
                                  (1, "down_slots_last"), (3, "dot"), (3, "fma_tokens")])
def test_experts_pallas_repeated_ids_in_a_token(n, tu):
    """The router never repeats an expert within a token, but moe_experts accepts any ids in [0, E): a repeat must
    count twice (gate/up writes h once, for the expert's first slot; the down kernel reads it from there and gives
    the token every weight that lists the expert). Tokens that did not pick an expert stay finite (masked rows)."""
    from pallas_kernels.moe.experts import ExpertsTuning, moe_experts_fused

    args, ws, _, _ = _expert_inputs(40 + n, n, k=8, e=32, big=True)
    ids = args[2].at[0, 5].set(args[2][0, 1]).at[0, 7].set(args[2][0, 1])  # slot 1's expert three times
    args = (*args[:2], ids, *args[3:])
    y = moe_experts_fused(*args, *ws, limit=4.0, shared_limit=5.0, tuning=ExpertsTuning(**_TUNINGS[tu]))
    assert np.isfinite(np.asarray(y)).all()
    assert rel_err(y, moe.moe_experts(*args, *ws, limit=4.0, shared_limit=5.0)) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3])
def test_experts_residual(n, dtype):
    """`residual` is added last in the compute dtype (at T = 1 in the down kernel's epilogue, at T > 1 after the
    combine): the values of adding it outside, with and without the shared expert."""
    dtype = jnp.dtype(dtype)
    args, ws, _, _ = _expert_inputs(50 + n, n, k=8, e=32, dtype=dtype, big=True)
    r = jnp.asarray(3.0 * np.random.default_rng(input_seed(7)).standard_normal((n, 128)), dtype)
    kw = dict(limit=4.0, shared_limit=5.0)
    for backend in ("reference", "pallas"):
        for shared in (ws, ()):
            y = moe.moe_experts(*args, *shared, **kw, backend=backend)
            y_r = moe.moe_experts(*args, *shared, **kw, backend=backend, residual=r)
            assert y_r.dtype == dtype
            if dtype == jnp.float32:  # one fp32 add, in or out of the kernel
                np.testing.assert_array_equal(np.asarray(y_r), np.asarray(r + y))
            else:  # XLA may keep r + y's operands unrounded when it fuses them: one bf16 rounding apart at most
                # (equal on CPU over 10 seeds, 60 at N = 3; the bound is for fusions elsewhere)
                assert rel_err(y_r, r + y) <= 4e-3
    y_ref = moe.moe_experts(*args, *ws, **kw, residual=r)
    assert rel_err(moe.moe_experts(*args, *ws, **kw, backend="pallas", residual=r), y_ref) <= (
        1e-5 if dtype == jnp.float32 else BF16_EXPERTS_TOL)  # measured max 3.3e-4 over 60 seeds


def test_experts_residual_errors():
    args, ws, _, _ = _expert_inputs(0, 2)
    with pytest.raises(ValueError, match=r"residual.shape=\(1, 128\) must be \[N, D\] = \(2, 128\)"):
        moe.moe_experts(*args, *ws, residual=args[0][:1])
    with pytest.raises(ValueError, match=r"residual.dtype=bfloat16 must be one of \['float32'\]"):
        moe.moe_experts(*args, *ws, residual=args[0].astype(jnp.bfloat16))


def test_experts_pallas_no_shared_and_distinct():
    args, _, _, _ = _expert_inputs(4, 5, k=8, e=64, repeat=False)
    assert rel_err(moe.moe_experts(*args, backend="pallas"), moe.moe_experts(*args)) <= 1e-5
    args, _, _, _ = _expert_inputs(5, 1, k=8, e=64)
    assert rel_err(moe.moe_experts(*args, backend="pallas"), moe.moe_experts(*args)) <= 1e-5
    from pallas_kernels.moe.experts import ExpertsTuning, moe_experts_fused

    y = moe_experts_fused(*args, None, None, None, limit=0.0, shared_limit=0.0,
                          tuning=ExpertsTuning(**_TUNINGS["down_bd4"]))
    assert rel_err(y, moe.moe_experts(*args)) <= 1e-5


def test_pallas_rejects_unsupported_shapes():
    args, ws, _, _ = _expert_inputs(0, 2, k=3)
    with pytest.raises(ValueError, match="power-of-two top_k, got K=3"):
        moe.moe_experts(*args, *ws, backend="pallas")


def test_experts_tuning_errors():
    from pallas_kernels.moe.experts import DECODE_TUNING, ExpertsTuning, moe_experts_fused

    with pytest.raises(ValueError, match="dot_gate_up='fma' must be 'dot_x' or 'dot_w'"):
        ExpertsTuning(dot_gate_up="fma")
    with pytest.raises(ValueError, match=r"verify_gate_up='fma' must be one of \('dot', 'fma_tokens'\)"):
        ExpertsTuning(verify_gate_up="fma")
    with pytest.raises(ValueError, match=r"block_d=3 must be a power of two$"):
        ExpertsTuning(block_d=3)
    with pytest.raises(ValueError, match=r"block_ki=8 must be a power of two >= 16"):
        ExpertsTuning(block_ki=8)
    with pytest.raises(ValueError, match=r"routed_eviction='evict_next' must be one of"):
        ExpertsTuning(routed_eviction="evict_next")
    args, ws, _, _ = _expert_inputs(0, 3)
    with pytest.raises(ValueError, match=r"block_i=2 with gate/up mode 'dot_x' at T=4.*use VERIFY_TUNING"):
        moe_experts_fused(*_expert_inputs(0, 4)[0], *ws, limit=0.0, shared_limit=0.0, tuning=DECODE_TUNING)
    with pytest.raises(ValueError, match=r"block_d=1 at T=3: the T > 1 down kernel's tensor-core dots need >= 16"):
        moe_experts_fused(*args, *ws, limit=0.0, shared_limit=0.0,
                          tuning=dataclasses.replace(DECODE_TUNING, verify_gate_up="fma_tokens"))
    from pallas_kernels.moe import down

    d, i, k = 64, 32, 8  # the down launch alone, given no counters, or the wrong number, for its last programs
    h, wd = jnp.ones((k + 1, 1, i), jnp.float32), jnp.ones((4, d, i), jnp.float32)
    slots_last = dataclasses.replace(DECODE_TUNING, block_d=16, down_t1="slots_last")
    for count in (None, jnp.zeros((2,), jnp.int32)):
        with pytest.raises(ValueError, match=r"down_t1='slots_last' needs the zeroed int32 counters \[4\]"):
            down.down_and_combine(h, jnp.zeros((1, k), jnp.int32), jnp.ones((1, k)), wd, wd[0], n=1,
                                  tuning=slots_last, count=count)


def lower_for_cuda(monkeypatch, modules, fn, *avals, gpu=None):
    """Lower fn for CUDA on this CPU machine (for the H200, or `gpu`, a GpuVersion): the Pallas -> Triton lowering
    runs (catching what interpret mode accepts but Triton does not, e.g. chained ref indexers) without a GPU.
    Returns the StableHLO text."""
    from jax._src.pallas.triton import gpu_info

    gpu = gpu or gpu_info.GpuVersion.H200
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu))
    for m in modules:
        monkeypatch.setattr(m, "interpret_mode", lambda: False)
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n,tu", [(1, None), (1, "bi16"), (1, "down_bd4"), (1, "down_slots"), (1, "down_slots_last"),
                                  (2, None), (3, None), (4, None), (3, "dot_w"), (9, "fma_tokens")])
def test_pallas_lowers_for_cuda(monkeypatch, n, tu):
    """Every product form lowers to Triton at Flash size (None: the defaults by T, experts.default_tuning)."""
    from pallas_kernels.common import pdl
    from pallas_kernels.moe import down as down_mod, experts as experts_mod, router as router_mod

    d, e, i = 2560, 512, 768
    bf, f32 = jnp.bfloat16, jnp.float32
    sds = jax.ShapeDtypeStruct

    def layer(x, r, b, wg, wu, wd, sg, su, sd):
        w, ids = router_mod.route(x, r, b, **ROUTE_KW)
        return experts_mod.moe_experts_fused(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0,
                                             tuning=tu and experts_mod.ExpertsTuning(**_TUNINGS[tu]))

    # Expert matrices [out, in]: gate/up [.., I, D], down [.., D, I].
    modules = [router_mod, experts_mod, down_mod, pdl]
    txt = lower_for_cuda(monkeypatch, modules, layer, sds((n, d), bf), sds((e, d), f32), sds((e,), f32),
                         sds((e, i, d), bf), sds((e, i, d), bf), sds((e, d, i), bf), sds((i, d), bf), sds((i, d), bf),
                         sds((d, i), bf))
    calls = {re.search(r'name = "([^"]+)"', c).group(1): c for c in txt.split("stablehlo.custom_call")[1:]}
    down = "experts_fwd_kernel_down" if n > 1 else {"down_slots": "experts_fwd_kernel_down_slots",
                                                     "down_slots_last": "experts_fwd_kernel_down_slots_last"}.get(
        tu, "experts_fwd_kernel_down_t1")
    assert sorted(calls) == sorted(["router_fwd_kernel_gemv", "router_fwd_kernel_topk", "experts_fwd_kernel_gate_up",
                                    down])
    if tu in ("down_slots", "down_slots_last"):  # 8 routed slots + the shared one, 16 features each
        assert "grid_x = 9" in calls[down] and f"grid_y = {d // 16}" in calls[down]
    if tu == "down_slots_last":  # the last program of each feature block combines: no XLA add or reduce left
        assert "stablehlo.add" not in txt and "stablehlo.reduce" not in txt
    if tu is None:  # the defaults by T: 2-row gate/up programs up to T = 3 (FMAs), 16-row ones from T = 4 (dots);
        # at T = 1 one down program per output feature
        assert f"grid_y = {i // (2 if n <= 3 else 16)}" in calls["experts_fwd_kernel_gate_up"]
        if n == 1:
            assert f"grid_x = {d}" in calls[down]


@pytest.mark.parametrize("shared,residual", [(True, True), (False, True), (False, False)])
def test_down_t1_optional_inputs_lower_for_cuda(monkeypatch, shared, residual):
    """The T = 1 down kernel with and without the shared expert and the residual (its optional refs) lowers at
    Flash size, and the residual is added inside it: no XLA add is left in the lowered program."""
    from pallas_kernels.common import pdl
    from pallas_kernels.moe import down as down_mod, experts as experts_mod

    d, e, i = 2560, 512, 768
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct

    def experts(x, w, ids, wg, wu, wd, sg, su, sd, r):
        ws = (sg, su, sd) if shared else (None, None, None)
        return experts_mod.moe_experts_fused(x, w, ids, wg, wu, wd, *ws, limit=4.0, shared_limit=5.0,
                                             residual=r if residual else None)

    txt = lower_for_cuda(monkeypatch, [experts_mod, down_mod, pdl], experts, sds((1, d), bf),
                         sds((1, 8), jnp.float32), sds((1, 8), jnp.int32), *[sds((e, i, d), bf)] * 2,
                         sds((e, d, i), bf), *[sds((i, d), bf)] * 2, sds((d, i), bf), sds((1, d), bf))
    names = [re.search(r'name = "([^"]+)"', c).group(1) for c in txt.split("stablehlo.custom_call")[1:]]
    assert names == ["experts_fwd_kernel_gate_up", "experts_fwd_kernel_down_t1"]
    assert "stablehlo.add" not in txt


def test_router_variants_lower_for_cuda(monkeypatch):
    from pallas_kernels.moe import router as router_mod

    sds = jax.ShapeDtypeStruct
    # T = 1 awkward blocks and splits (the defaults by T run in test_pallas_lowers_for_cuda); the N > 1 paths: the
    # dot (3 and 40 tokens: WIDE_TUNING's N), one-token programs.
    RT = router_mod.RouterTuning
    for n, tu in ((1, RT(block_e=2, block_k=512, num_warps=1)), (1, RT(block_e=8)),
                  (1, RT(topk_warps=1, block_e=64, block_k=16)), (1, RT(block_e=1, block_k=1024, k_splits=10)),
                  (1, RT(k_splits=4)), (3, RT()), (3, RT(k_splits=5)), (40, None), (6, router_mod.VERIFY_TUNING),
                  (6, RT(multi_token="per_token", block_e=4))):
        fn = lambda x, r, b, tu=tu: router_mod.route(x, r, b, **ROUTE_KW, tuning=tu)  # noqa: E731
        for router_dtype in (jnp.float32, jnp.bfloat16):  # as the checkpoint stores it
            txt = lower_for_cuda(monkeypatch, [router_mod], fn, sds((n, 2560), jnp.bfloat16),
                                 sds((512, 2560), router_dtype), sds((512,), jnp.float32))
            assert txt.count("stablehlo.custom_call") == 2
    # T = 1 defaults by the router's dtype: DECODE_TUNING's one row per GEMV program (512 x 5 programs) for fp32,
    # DECODE_TUNING_BF16's two rows (256 x 5) for bf16.
    for router_dtype, rows in ((jnp.float32, 512), (jnp.bfloat16, 256)):
        fn = lambda x, r, b: router_mod.route(x, r, b, **ROUTE_KW)  # noqa: E731
        txt = lower_for_cuda(monkeypatch, [router_mod], fn, sds((1, 2560), jnp.bfloat16),
                             sds((512, 2560), router_dtype), sds((512,), jnp.float32))
        gemv = txt.split("stablehlo.custom_call")[1]
        assert re.search(r'name = "([^"]+)"', gemv).group(1) == "router_fwd_kernel_gemv"
        assert f"grid_x = {rows}" in gemv and "grid_y = 5" in gemv


@pytest.mark.parametrize("down,gpu", [(True, "H200"), (False, "H200"), (True, "A100")])
def test_early_launch_lowers_for_cuda(monkeypatch, down, gpu):
    """The PDL trigger (pallas_kernels/common/pdl.py) is in the T = 1 down kernel when asked for, never in gate/up,
    and nowhere before Hopper (no griddepcontrol instruction there)."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.common import pdl
    from pallas_kernels.moe import down as down_mod, experts as experts_mod

    jax.clear_caches()  # the trigger is decided when a kernel is traced: no trace cached for another GPU here
    d, e, i = 256, 16, 64
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct
    tu = dataclasses.replace(experts_mod.DECODE_TUNING, early_launch_down=down)

    def experts(x, w, ids, wg, wu, wd, sg, su, sd):
        return experts_mod.moe_experts_fused(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0,
                                             tuning=tu)

    txt = lower_for_cuda(monkeypatch, [experts_mod, down_mod, pdl], experts, sds((1, d), bf),
                         sds((1, 8), jnp.float32), sds((1, 8), jnp.int32), *[sds((e, i, d), bf)] * 2,
                         sds((e, d, i), bf), *[sds((i, d), bf)] * 2, sds((d, i), bf),
                         gpu=getattr(gpu_info.GpuVersion, gpu))
    # Each custom call's text up to the next one: its own name comes first (later names are operands' locations).
    calls = txt.split("stablehlo.custom_call")[1:]
    has = {re.search(r'name = "([^"]+)"', c).group(1): "griddepcontrol.launch_dependents" in c for c in calls}
    hopper = gpu != "A100"
    assert has == {"experts_fwd_kernel_gate_up": False, "experts_fwd_kernel_down_t1": down and hopper}


def _kernel_loads(jaxpr, kernel=None):
    """(pallas_call name, eviction policy) of every explicit `pltriton.load` in a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        name = eqn.params["name"] if eqn.primitive.name == "pallas_call" else kernel
        if eqn.primitive.name == "masked_load":
            yield name, eqn.params.get("eviction_policy")
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from _kernel_loads(inner, name)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_routed_eviction_policy(n):
    """T <= 3 (DECODE_TUNING, FMA_TOKENS_TUNING) loads the routed gate, up and down weights with an L2 evict_first
    policy; the shared expert's loads and every load from T = 4 (VERIFY_TUNING) keep the default policy."""
    from pallas_kernels.moe import experts as experts_mod

    d, e, i = 256, 16, 64
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct

    def experts(x, w, ids, wg, wu, wd, sg, su, sd):
        return experts_mod.moe_experts_fused(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0)

    jaxpr = jax.make_jaxpr(experts)(sds((n, d), bf), sds((n, 8), jnp.float32), sds((n, 8), jnp.int32),
                                    *[sds((e, i, d), bf)] * 2, sds((e, d, i), bf), *[sds((i, d), bf)] * 2,
                                    sds((d, i), bf)).jaxpr
    loads = collections.Counter(_kernel_loads(jaxpr))
    # T = 1: the down kernel's 8 routed slots are written out (I = 64: one chunk each); T > 1: one loop body each.
    want = {1: {("experts_fwd_kernel_gate_up", "evict_first"): 2, ("experts_fwd_kernel_down_t1", "evict_first"): 8},
            3: {("experts_fwd_kernel_gate_up", "evict_first"): 2, ("experts_fwd_kernel_down", "evict_first"): 1},
            4: {}}[n]
    assert loads == collections.Counter(want)


# --- Block-FP8 expert matrices (pallas_kernels/common/fp8.py, layout OUT_IN) ---

# FP8 numerics (pallas_kernels/moe/experts.py, reference.py): the weight stays float32, never rounded to x's dtype.
# The kernels sum exact E4M3 products per 128-block in fp32 and scale each block's sum; the reference multiplies by
# the float32 weight fl(q·scale). float32 x: the two differ by fp32 roundings and summation order: measured max
# 8.5e-7 over 5 seeds of test_experts_pallas_fp8's cases on CPU (an fp32 sum of a few hundred products: ~1e-7 per
# term, 12x below the bound). bfloat16 x: the same fp32 products, so the bf16 roundings of g, u, h and the outputs
# agree but for one-ulp flips at near ties: measured max 7.1e-5 over 8 seeds of test_experts_pallas_fp8's cases and
# 2.1e-4 over 20 of the grouped kernels' (tests/ops/test_moe_grouped.py), 5x below FP8_BF16_TOL; the earlier numerics
# (the weight dequantised to bf16) are 3.1e-3 to 5.4e-3 off on the same inputs, above it.
FP8_F32_TOL, FP8_BF16_TOL = 1e-5, 1e-3


def _fp8_tol(dtype):
    return FP8_F32_TOL if jnp.dtype(dtype) == jnp.float32 else FP8_BF16_TOL


def _fp8_weights(seed, *ws):
    """Each float weight quantised to block-FP8 (OUT_IN, the checkpoint's 128x128 blocks), after scaling each
    128x128 block by its own power of two in [1/4, 4]: the blocks' scales then differ by up to 16x, so a tile that
    took a neighbouring block's scale would be far off."""
    rng = np.random.default_rng(input_seed(seed))
    out = []
    for w in ws:
        w = np.asarray(w, np.float32)
        blocks = fp8.scale_shape(w.shape, fp8.OUT_IN)
        f = 2.0 ** rng.integers(-2, 3, blocks).astype(np.float32)
        f = np.repeat(np.repeat(f, fp8.BLOCK, -2)[..., :w.shape[-2], :], fp8.BLOCK, -1)[..., :w.shape[-1]]
        out.append(fp8.quantize(jnp.asarray(w * f), fp8.OUT_IN))
    return tuple(out)


def _fp8_expert_inputs(seed, n, *, d=256, i=192, e=8, k=4, dtype=jnp.float32, big=True):
    """(args, shared triple) with every expert matrix an Fp8Weight, and the NumPy float64 copies of x, the routing
    and the weights q·scale, exact in float64."""
    args, _, np_args, np_ws = _expert_inputs(seed, n, d=d, i=i, e=e, k=k, i_s=i, dtype=dtype, big=big)
    routed = _fp8_weights(seed + 1, *np_args[3:])
    shared = _fp8_weights(seed + 2, *np_ws)
    deq = lambda w: np.asarray(w.q, np.float64) * np.asarray(fp8.expanded_scale(w), np.float64)  # noqa: E731
    np_all = (np_args[0], np_args[1], np_args[2], *(deq(w) for w in routed)), tuple(deq(w) for w in shared)
    return (*args[:3], *routed), shared, np_all


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,path", [(3, "gather"), (70, "sorted")])
def test_experts_fp8_reference_against_float64(n, path, dtype):
    """The reference with FP8 experts (float32 weights, fp32 products, then the plain math) against NumPy float64
    loops on the exact weights q·scale: the gather path dequantises the gathered experts, the sorted one the whole
    stack."""
    dtype = jnp.dtype(dtype)
    args, shared, (np_args, np_ws) = _fp8_expert_inputs(80, n, dtype=dtype)
    kw = dict(limit=4.0, shared_limit=5.0)
    y = reference.moe_experts(*args, *shared, **kw, path=path)
    assert y.dtype == dtype
    # float32: the reference's own bound (test_experts_reference_f32; measured max 6.3e-7 over 5 seeds); bf16:
    # test_experts_reference_bf16's (bf16 activations and outputs against float64).
    assert rel_err(y, np_moe(*np_args, np_ws, **kw)) <= (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,d,i,shared,limits", [
    (1, 256, 192, True, (4.0, 5.0)),  # decode: two 128-blocks each way, one of them ragged (I = 192)
    (1, 128, 64, False, (0.0, 0.0)),  # one ragged block per matrix (I = 64 < 128), no shared expert, no clamp
    (2, 256, 192, True, (4.0, 5.0)),  # verify, the tensor-core dots from T = 2 up
    (4, 256, 192, True, (4.0, 5.0)),
    (9, 128, 192, False, (4.0, 5.0)),
    (16, 128, 64, True, (0.5, 2.0)),
], ids=["T1-D256-I192", "T1-D128-I64-noshared", "T2-D256-I192", "T4-D256-I192", "T9-D128-I192-noshared",
        "T16-D128-I64"])
def test_experts_pallas_fp8(n, d, i, shared, limits, dtype):
    """The decode/verify kernels (their FP8 defaults by T) with FP8 experts against the reference (float32 weights),
    with the residual (at T = 1 the down kernel's epilogue)."""
    dtype = jnp.dtype(dtype)
    args, ws, _ = _fp8_expert_inputs(90 + n, n, d=d, i=i, dtype=dtype, big=limits[0] > 0)
    ws = ws if shared else ()
    r = jnp.asarray(np.random.default_rng(input_seed(91)).standard_normal((n, d)), dtype)
    kw = dict(limit=limits[0], shared_limit=limits[1], residual=r)
    y = moe.moe_experts(*args, *ws, **kw, backend="pallas")
    y_ref = moe.moe_experts(*args, *ws, **kw)
    assert y.dtype == dtype and y.shape == (n, d)
    assert rel_err(y, y_ref) <= _fp8_tol(dtype)  # bf16: a bound the earlier bf16-weight numerics exceed


@pytest.mark.parametrize("n,tu", [(1, "decode_bf16"), (1, "reduce"), (1, "lanes4_unroll"), (1, "lanes1"),
                                  (1, "plain_acc"), (1, "slots"), (1, "slots_reduce"), (1, "slots_dot"),
                                  (1, "slots_last"), (1, "slots_last_dot"), (1, "fused"), (1, "fused_reduce"),
                                  (2, "fma_tokens_bf16"),
                                  (4, "dot_w"), (3, "dot_bk32")])
def test_experts_pallas_fp8_tunings(n, tu):
    """FP8 experts with other tunings (float32): the bf16 defaults (per-tile reductions, 512-wide chunks taken as
    two 128-wide sub-blocks at D 256); DECODE_TUNING_FP8 with per-tile reductions; 2-row programs over 64-wide chunks
    (4 weights per lane, `tiles.lane_group`) with the gate/up chunks written out and 2-feature down programs;
    4-warp programs of 16-wide chunks (fewer weights than lanes: the products summed as they are); the per-token
    FMAs, W·xᵀ dots and 32-wide chunks (four per scale block); plain weights with the FP8 T = 1 default
    (t1_products="accumulate" with 256-wide chunks); the T = 1 down as (slot, features) programs with an XLA
    combine, both product forms, also after the T > 1 dot gate/up (16 token rows, the down reading the first), and
    with the last program combining; and the one-launch "fused" down of 2 one-warp features per program, both
    product forms."""
    from pallas_kernels.moe import experts as em, tiles

    f = em.DECODE_TUNING_FP8
    tunings = {"decode_bf16": em.DECODE_TUNING,
               "reduce": dataclasses.replace(f, t1_products="reduce"),
               "lanes4_unroll": dataclasses.replace(f, block_i=2, block_k=64, block_d=2, block_ki=64,
                                                    unroll_gate_up=True),
               "lanes1": dataclasses.replace(f, block_k=16, warps_gate_up=4, block_ki=16, warps_down=4),
               "plain_acc": f,
               "fma_tokens_bf16": em.FMA_TOKENS_TUNING,
               "dot_w": dataclasses.replace(em.VERIFY_TUNING_FP8, dot_gate_up="dot_w"),
               "dot_bk32": dataclasses.replace(em.VERIFY_TUNING, block_k=32, block_ki=32, block_d=16),
               "slots": dataclasses.replace(f, down_t1="slots", block_d=16, warps_down=4),
               "fused": dataclasses.replace(f, down_t1="fused", block_d=2, warps_down=1),
               "fused_reduce": dataclasses.replace(f, down_t1="fused", block_d=2, warps_down=1, t1_products="reduce"),
               "slots_reduce": dataclasses.replace(f, down_t1="slots", block_d=8, warps_down=2, t1_products="reduce"),
               "slots_dot": dataclasses.replace(em.VERIFY_TUNING_FP8, down_t1="slots", t1_gate_up="dot", block_d=16,
                                                t1_products="accumulate"),
               "slots_last": dataclasses.replace(f, down_t1="slots_last", block_d=16, warps_down=4),
               "slots_last_dot": dataclasses.replace(em.VERIFY_TUNING_FP8, down_t1="slots_last", t1_gate_up="dot",
                                                     block_d=8, warps_down=2, t1_products="accumulate")}
    if tu in ("lanes4_unroll", "lanes1"):  # the per-lane groups these shapes give (2x64 and 4x16 tiles)
        assert tiles.lane_group(2, 64, 32) == 4 and tiles.lane_group(4, 16, 128) == 1
    args, ws, _ = _fp8_expert_inputs(100 + n, n)
    if tu == "plain_acc":
        args, ws = (*args[:3], *(fp8.dequantize(w) for w in args[3:])), tuple(fp8.dequantize(w) for w in ws)
    kw = dict(limit=4.0, shared_limit=5.0)
    y = em.moe_experts_fused(*args, *ws, **kw, tuning=tunings[tu])
    assert rel_err(y, moe.moe_experts(*args, *ws, **kw)) <= FP8_F32_TOL


@pytest.mark.parametrize("n", [1, 4])
def test_experts_pallas_fp8_mixed(n):
    """FP8 routed experts with a plain shared expert, and the routed down projection plain with the rest FP8: each
    matrix is dequantised (or not) on its own."""
    args, ws, _ = _fp8_expert_inputs(110 + n, n)
    plain = lambda w: fp8.dequantize(w, jnp.float32)  # noqa: E731
    kw = dict(limit=4.0, shared_limit=5.0)
    for a, s in (((*args[:5], plain(args[5])), ws), (args, tuple(plain(w) for w in ws))):
        y = moe.moe_experts(*a, *s, **kw, backend="pallas")
        assert rel_err(y, moe.moe_experts(*a, *s, **kw)) <= FP8_F32_TOL


def test_dispatch_fp8_errors():
    args, ws, _ = _fp8_expert_inputs(0, 2)
    x, w, ids, wg, wu, wd = args
    bad = dataclasses.replace
    with pytest.raises(ValueError, match=r"we_gate.q.dtype=bfloat16 must be float8_e4m3fn"):
        moe.moe_experts(x, w, ids, bad(wg, q=wg.q.astype(jnp.bfloat16)), wu, wd)
    with pytest.raises(ValueError, match=r"ws_down.scale.dtype=bfloat16 must be float32 \(the checkpoint's "
                                         r"weight_scale_inv\)"):
        moe.moe_experts(*args, *ws[:2], bad(ws[2], scale=ws[2].scale.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"we_up.scale.shape=\(8, 2, 1\) must be \(8, 2, 2\) for a out_in weight "
                                         r"of shape \(8, 192, 256\) \(128-wide blocks\)"):
        moe.moe_experts(x, w, ids, wg, bad(wu, scale=wu.scale[:, :, :1]), wd)
    in_out = fp8.quantize(np.asarray(fp8.dequantize(wd)), fp8.IN_OUT)
    with pytest.raises(ValueError, match=r"we_down is an Fp8Weight of layout 'in_out'; the expert matrices need "
                                         r"'out_in' .*fp8.quantize\(w, fp8.OUT_IN\)"):
        moe.moe_experts(x, w, ids, wg, wu, in_out)
    with pytest.raises(ValueError, match=r"we_gate.dtype=float8_e4m3fn is a bare E4M3 array: pass it with its block "
                                         r"scales as fp8.Fp8Weight\(q, scale, fp8.OUT_IN\)"):
        moe.moe_experts(x, w, ids, wg.q, wu, wd)
    swapped = fp8.Fp8Weight(jnp.swapaxes(wd.q, 1, 2), jnp.swapaxes(wd.scale, 1, 2), fp8.OUT_IN)
    with pytest.raises(ValueError, match=r"we_down.shape=\(8, 192, 256\) must be \[E, D, I\] = \(8, 256, 192\) .*"
                                         r"swap the last two axes of its q and of its scale"):
        moe.moe_experts(x, w, ids, wg, wu, swapped)
    with pytest.raises(ValueError, match=r"we_up.shape=\(8, 192, 128\) must be \[E, I, D\] = \(8, 192, 256\)"):
        moe.moe_experts(x, w, ids, wg, fp8.quantize(np.asarray(fp8.dequantize(wu))[:, :, :128], fp8.OUT_IN), wd)
    # Plain weights keep their checks, next to FP8 ones (mixed is allowed).
    with pytest.raises(ValueError, match=r"ws_gate.dtype=bfloat16 must be one of \['float32'\]"):
        moe.moe_experts(*args, fp8.dequantize(ws[0], jnp.bfloat16), *ws[1:])
    from pallas_kernels.moe import experts as em

    with pytest.raises(ValueError, match=r"ExpertsTuning.t1_products='sum' must be one of \('reduce', 'accumulate'\)"):
        em.ExpertsTuning(t1_products="sum")
    with pytest.raises(ValueError, match=r"ExpertsTuning.down_t1='rows' must be one of \('fused', 'slots', "
                                         r"'slots_last'\)"):
        em.ExpertsTuning(down_t1="rows")
    with pytest.raises(ValueError, match=r"t1_gate_up='dot' writes h with 16 token rows, .*set down_t1='slots' or"):
        em.ExpertsTuning(t1_gate_up="dot")
    # A tile must lie in one 128-row scale block (D = 256: 256 down rows per program).
    with pytest.raises(ValueError, match=r"ExpertsTuning.block_d=256 gives tiles of 256 weight rows; with FP8 weights "
                                         r"a tile's rows must lie in one 128-row scale block: use block_d <= 128"):
        em.moe_experts_fused(*args, *ws, limit=0.0, shared_limit=0.0,
                             tuning=dataclasses.replace(em.VERIFY_TUNING, block_d=256))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fp8_lowers_for_cuda(monkeypatch, n):
    """FP8 experts at Flash size lower to Triton with the FP8 defaults by T (experts.default_tuning): at T = 1
    4-row gate/up programs and (slot, 64 features) down programs whose last per feature block combines and adds the
    residual (no XLA add or reduce), h in float32; the router's prefetch takes the shared expert's q arrays."""
    from pallas_kernels.common import pdl
    from pallas_kernels.moe import down as down_mod, experts as experts_mod, router as router_mod

    d, e, i = 2560, 512, 768
    bf, f32, sds = jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct

    def w8(*shape):
        return fp8.Fp8Weight(sds(shape, fp8.FP8_DTYPE), sds(fp8.scale_shape(shape, fp8.OUT_IN), f32), fp8.OUT_IN)

    def layer(x, r, b, wg, wu, wd, sg, su, sd, res):
        w, ids = moe.route(x, r, b, **ROUTE_KW, backend="pallas", prefetch=(sg.q, su.q, sd.q))
        return moe.moe_experts(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0, backend="pallas",
                               residual=res)

    modules = [router_mod, experts_mod, down_mod, pdl]
    txt = lower_for_cuda(monkeypatch, modules, layer, sds((n, d), bf), sds((e, d), f32), sds((e,), f32),
                         w8(e, i, d), w8(e, i, d), w8(e, d, i), w8(i, d), w8(i, d), w8(d, i), sds((n, d), bf))
    calls = {re.search(r'name = "([^"]+)"', c).group(1): c for c in txt.split("stablehlo.custom_call")[1:]}
    down = "experts_fwd_kernel_down_slots_last" if n == 1 else "experts_fwd_kernel_down"
    assert sorted(calls) == sorted(["router_fwd_kernel_gemv", "router_fwd_kernel_topk", "experts_fwd_kernel_gate_up",
                                    down])
    rows = 4 if n == 1 else 32  # DECODE_TUNING_FP8, VERIFY_TUNING_FP8
    assert f"grid_y = {i // rows}" in calls["experts_fwd_kernel_gate_up"]
    if n == 1:
        assert "grid_x = 9" in calls[down] and f"grid_y = {d // 64}" in calls[down]
        assert "stablehlo.add" not in txt and "stablehlo.reduce" not in txt  # combine and residual in the kernel
        assert re.search(r"tensor<9x1x768xf32>", txt)  # h: float32 between the two kernels (down.h_dtype)


def _near_tie_router(d=256, e=512):
    """An fp32 router and bias where experts c = 300 and b = 301 tie for the last of 8 places up to their third bf16
    piece: per weight b = a + s·(2^-15 + 2^-24) and c = a + s·2^-15 (a bf16-exact, |a| in [2^-5, 2^-4), s = ±1), so
    b's pieces are (a, s·2^-15, s·2^-24) and c's (a, s·2^-15, 0). With s = sign(x), b's logit exceeds c's by
    2^-24·Σ|x| (~1e-5), 100x the fp32 sums' rounding; without the third piece the two tie and the lower index, c,
    would win. Seven experts in groups 0 and 2 lead by their bias; every other expert trails by its bias."""
    rng = np.random.default_rng(input_seed(53))
    x = np.asarray(jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16), np.float32)
    sign = np.where(x[0] >= 0, 1.0, -1.0).astype(np.float32)
    mag = (2.0 ** -5) * (1 + rng.integers(0, 128, (e, d)) / 128)  # bf16-exact: 8 significant bits
    router = (mag * rng.choice([-1.0, 1.0], (e, d))).astype(np.float32)
    router[301] = router[300] + sign * np.float32(2.0 ** -15 + 2.0 ** -24)
    router[300] = router[300] + sign * np.float32(2.0 ** -15)
    bias = np.full(e, -1.0, np.float32)
    bias[[0, 1, 2, 3, 128, 129, 130]] = 1.0  # groups 0 and 2 (64 experts a group)
    bias[[300, 301]] = 0.0  # group 4
    return x, router, bias


@pytest.mark.parametrize("n", [1, 7, 40, 300])
def test_route_fp32_router_resolves_a_near_tie_exactly(n):
    """An fp32-stored router keeps exact fp32 sums at every token count: with bf16 tokens its dot paths (N > 16:
    the wide and the prefill tuning) take it as three bf16 pieces, and the constructed near tie (`_near_tie_router`)
    picks expert 301 over 300 only if the third piece is summed. The reference and float64 agree."""
    x1, router, bias = _near_tie_router()
    x = np.repeat(x1, n, axis=0)
    exact = x1 @ router.astype(np.float64).T
    assert exact[0, 301] > exact[0, 300]
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(router), jnp.asarray(bias))
    for backend in ("reference", "pallas"):
        _, ids = moe.route(*args, **ROUTE_KW, backend=backend)
        chosen = np.asarray(ids)
        assert (chosen == 301).any(axis=1).all() and not (chosen == 300).any(), \
            f"{backend} at N={n} chose {chosen[0]}: expert 301 wins over 300 only by its router's third bf16 piece"
    np.testing.assert_array_equal(np.sort(chosen, axis=1), np.sort(np_route(x, router, bias, **ROUTE_KW)[1], axis=1))


@pytest.mark.parametrize("n", [1, 7, 40, 300])
def test_router_logits_of_an_fp32_router_are_fp32_sums(n):
    """The router GEMV's logits (its partial sums added) of bf16 tokens and an fp32-stored router against float64:
    within 1e-6 relative at every tuning by token count (fp32 sums of exact products measure 0.7-1.2e-7; an fp32
    weight cut to two bf16 pieces, 16 of its 24 bits, measures 2.5e-6)."""
    from pallas_kernels.moe import router as router_mod

    x, router, _ = _router_inputs(57, n)
    xb = jnp.asarray(x, jnp.bfloat16)
    partials, _ = router_mod.gemv_partials(xb, jnp.asarray(router), router_mod.default_tuning(n))
    logits = np.asarray(partials.sum(0)[:n])
    want = np.asarray(xb, np.float64) @ router.astype(np.float64).T
    assert rel_err(logits, want) <= 1e-6
