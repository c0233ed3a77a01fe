"""The grouped-GEMM MoE experts (prefill, pallas_kernels/moe/grouped.py; interpreted on CPU, compiled on a GPU)
against the reference: the tile table, routings with empty and crowded experts, N not a multiple of the tile rows,
both clamp settings, the shared expert and the residual, the dispatcher's choice by N, tunings and their errors, and
the Triton lowering at Flash size; plus the Pallas router at prefill size."""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.numerics import input_seed, rel_err
from tests.ops.test_moe import ROUTE_KW, lower_for_cuda, np_moe
from pallas_kernels import moe
from pallas_kernels.moe import experts, grouped, reference

# float32: the kernel's fp32 dots against the reference's, summed in another order: measured max 2.5e-7 over 12 seeds
# of the reference comparisons below (on CPU). bfloat16: the decode kernels' bound (tests/ops/test_moe.py,
# BF16_EXPERTS_TOL), 10x the measured max 2.0e-4 over the same seeds (one-ulp flips of g, u or h at near ties;
# the fixed seeds are bit-exact), well inside the 2e-2 the bench allows.
F32_TOL, BF16_TOL = 1e-5, 2e-3
# Small blocks so every loop runs several steps at the test sizes (D 128, I 64: BK 32 -> 4 steps, BKI 16 -> 4) and
# 16-row tiles, so crowded experts span several tiles and N = 37 leaves partial ones.
SMALL = grouped.GroupedTuning(block_m=16, block_i=32, block_k=32, block_d=32, block_ki=16)


def _tol(dtype):
    return F32_TOL if jnp.dtype(dtype) == jnp.float32 else BF16_TOL


def _ids(rng, n, k, e, routing):
    """[N, K] distinct experts per token. "uniform": any expert. "skewed": expert 3 in almost every token, four more
    experts crowded, the last three experts never chosen."""
    if routing == "uniform":
        return np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    p = np.full(e, 0.18 / (e - 8))
    p[[0, 1, 2, 4]] = 0.08
    p[3] = 0.5
    p[e - 3:] = 0.0
    return np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)])


def _inputs(seed, n, *, d=128, i=64, e=16, k=4, i_s=64, dtype=jnp.float32, routing="uniform", big=False):
    """(args for moe_experts, shared expert triple, NumPy copies of both: floats as float32 holding the dtype's
    values)."""
    rng = np.random.default_rng(input_seed(seed))
    amp = 3.0 if big else 1.0  # |g|, |u| reach a few units: the clamps at 4 / 5 engage
    x = amp * rng.standard_normal((n, d))
    we_gate = rng.standard_normal((e, i, d)) / np.sqrt(d)  # every expert matrix [out, in]
    we_up = rng.standard_normal((e, i, d)) / np.sqrt(d)
    we_down = rng.standard_normal((e, d, i)) / np.sqrt(i)
    ws = (rng.standard_normal((i_s, d)) / np.sqrt(d), rng.standard_normal((i_s, d)) / np.sqrt(d),
          rng.standard_normal((d, i_s)) / np.sqrt(i_s))
    ids = jnp.asarray(_ids(rng, n, k, e, routing), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    args = (cast(x), weights, ids, cast(we_gate), cast(we_up), cast(we_down))
    shared = tuple(cast(a) for a in ws)
    as_np = lambda a: np.asarray(a, np.int64 if a.dtype == jnp.int32 else np.float32)  # noqa: E731
    return args, shared, tuple(as_np(a) for a in args), tuple(as_np(a) for a in shared)


def np_tile_table(ids, n_experts, block_m):
    """The tile table by loops: each expert's pairs in token-major order, padded to whole tiles."""
    flat = np.asarray(ids).reshape(-1)
    p = flat.size
    rows, tile_expert = [], []
    for e in range(n_experts):
        pairs = [q for q in range(p) if flat[q] == e]
        n_tiles = -(-len(pairs) // block_m)
        rows += pairs + [p] * (n_tiles * block_m - len(pairs))
        tile_expert += [e] * n_tiles
    t_max = grouped.max_tiles(p, n_experts, block_m)
    return (np.array(rows + [p] * (t_max * block_m - len(rows))),
            np.array(tile_expert + [-1] * (t_max - len(tile_expert))))


def test_tile_table_hand():
    # E = 6, BM = 4: expert 1 and 5 get no pair, expert 3 gets 6 (two tiles), a token lists expert 0 twice.
    ids = np.array([[3, 0], [3, 2], [0, 0], [3, 4], [2, 3], [3, 3]], np.int32)
    rows, te = grouped.tile_table(jnp.asarray(ids), 6, 4)
    p = 12
    assert grouped.max_tiles(p, 6, 4) == 7  # (12 + 6·3) // 4
    np.testing.assert_array_equal(np.asarray(te), [0, 2, 3, 3, 4, -1, -1])
    np.testing.assert_array_equal(np.asarray(rows)[:4], [1, 4, 5, p])  # expert 0: pairs 1, 4, 5 (token order)
    np.testing.assert_array_equal(np.asarray(rows)[4:8], [3, 8, p, p])  # expert 2
    np.testing.assert_array_equal(np.asarray(rows)[8:16], [0, 2, 6, 9, 10, 11, p, p])  # expert 3
    np.testing.assert_array_equal(np.asarray(rows)[16:20], [7, p, p, p])  # expert 4
    assert (np.asarray(rows)[20:] == p).all()
    np_rows, np_te = np_tile_table(ids, 6, 4)
    np.testing.assert_array_equal(np.asarray(rows), np_rows)
    np.testing.assert_array_equal(np.asarray(te), np_te)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_table_matches_loops(routing, block_m):
    """Every pair once, in its expert's tile, in token order; empty experts own no tile; tiles past the real ones
    are -1 (the kernels skip them)."""
    rng = np.random.default_rng(input_seed(3))
    ids = _ids(rng, 37, 4, 16, routing)
    rows, te = grouped.tile_table(jnp.asarray(ids, jnp.int32), 16, block_m)
    np_rows, np_te = np_tile_table(ids, 16, block_m)
    np.testing.assert_array_equal(np.asarray(rows), np_rows)
    np.testing.assert_array_equal(np.asarray(te), np_te)
    if routing == "skewed":  # the routing has what it claims: empty experts and one crowded across tiles
        counts = np.bincount(ids.reshape(-1), minlength=16)
        assert (counts[13:] == 0).all() and counts[3] >= 0.8 * 37
        assert collections.Counter(np_te.tolist())[3] == -(-counts[3] // block_m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("limits", [(0.0, 0.0), (4.0, 5.0)], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_grouped_matches_reference(routing, limits, dtype):
    """N = 37 (partial tiles of 16 rows), uneven or skewed routing (empty experts, one expert in almost every
    token), with the shared expert, both clamp settings, against the reference's sorted path."""
    args, shared, _, _ = _inputs(10, 37, dtype=jnp.dtype(dtype), routing=routing, big=limits[0] > 0)
    kw = dict(limit=limits[0], shared_limit=limits[1])
    y = grouped.moe_experts(*args, *shared, **kw, tuning=SMALL)
    y_ref = reference.moe_experts(*args, *shared, **kw, path="sorted")
    assert y.dtype == jnp.dtype(dtype) and y.shape == y_ref.shape
    assert rel_err(y, y_ref) <= _tol(dtype)
    if limits[0]:  # the routed clamp engages: without it the result moves far beyond the tolerance
        assert rel_err(reference.moe_experts(*args, *shared, shared_limit=limits[1], path="sorted"), y_ref) > 1e-2


def test_grouped_against_float64():
    """Independent of the reference: NumPy float64 loops, top 2 of 16, clamps far below Ling's (0.5, 2)."""
    args, shared, np_args, np_shared = _inputs(20, 45, k=2, big=True)
    kw = dict(limit=0.5, shared_limit=2.0)
    y = grouped.moe_experts(*args, *shared, **kw, tuning=SMALL)
    assert rel_err(y, np_moe(*np_args, np_shared, **kw)) <= F32_TOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_residual_and_no_shared(dtype):
    """`residual` is added last in the compute dtype, with and without the shared expert; without it the routed
    sum alone (the reference's values)."""
    dtype = jnp.dtype(dtype)
    args, shared, _, _ = _inputs(30, 37, dtype=dtype, routing="skewed", big=True)
    r = jnp.asarray(3.0 * np.random.default_rng(input_seed(31)).standard_normal((37, 128)), dtype)
    kw = dict(limit=4.0, shared_limit=5.0)
    for ws in (shared, ()):
        y = grouped.moe_experts(*args, *ws, **kw, tuning=SMALL)
        y_r = grouped.moe_experts(*args, *ws, **kw, tuning=SMALL, residual=r)
        np.testing.assert_array_equal(np.asarray(y_r, np.float32), np.asarray(r + y, np.float32))
        y_ref = reference.moe_experts(*args, *ws, **kw, path="sorted")
        assert rel_err(y_r, r + y_ref) <= _tol(dtype)


def test_grouped_repeated_ids_and_one_expert():
    """Any ids in [0, E) are taken: a token listing an expert twice gets both contributions, and every pair on one
    expert (K = 1, 15 of 16 experts empty) fills that expert's tiles only."""
    args, shared, _, _ = _inputs(40, 37)
    ids = args[2].at[0, 3].set(args[2][0, 1]).at[5, 2].set(args[2][5, 0])
    args = (*args[:2], ids, *args[3:])
    y = grouped.moe_experts(*args, *shared, tuning=SMALL)
    assert rel_err(y, reference.moe_experts(*args, *shared, path="gather")) <= F32_TOL
    one = (args[0], args[1][:, :1], jnp.full((37, 1), 7, jnp.int32), *args[3:])
    y = grouped.moe_experts(*one, tuning=SMALL)
    assert rel_err(y, reference.moe_experts(*one, path="sorted")) <= F32_TOL


@pytest.mark.parametrize("tuning", [
    dict(block_m=32, block_i=16, block_k=16, block_d=16, block_ki=64),  # 8 D steps, one I step
    dict(block_m=64, weight_eviction="evict_first"),  # the defaults' blocks: one tile holds an expert's pairs
    dict(block_m=16, block_i=64, block_k=128, block_d=128, block_ki=32, warps_gate_up=8, stages_down=1),
], ids=["small_blocks", "default_blocks_evict_first", "whole_dims"])
def test_grouped_tunings(tuning):
    args, shared, _, _ = _inputs(50, 37, routing="skewed", big=True)
    kw = dict(limit=4.0, shared_limit=5.0)
    y = grouped.moe_experts(*args, *shared, **kw, tuning=grouped.GroupedTuning(**tuning))
    assert rel_err(y, reference.moe_experts(*args, *shared, **kw, path="sorted")) <= F32_TOL


def _kernel_names(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    names = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(eqn.params["name"])
            for v in eqn.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dispatch_above_max_tokens(dtype):
    """backend="pallas" runs the grouped kernels above experts.MAX_TOKENS tokens (the default tuning, 8 of 32
    experts per token), the decode/verify kernels up to it; the result is the reference's."""
    dtype = jnp.dtype(dtype)
    n = experts.MAX_TOKENS + 1
    args, shared, _, _ = _inputs(60, n, e=32, k=8, dtype=dtype, routing="skewed", big=True)
    kw = dict(limit=4.0, shared_limit=5.0)
    run = lambda *a: moe.moe_experts(*a, **kw, backend="pallas")  # noqa: E731
    assert _kernel_names(run, *args, *shared) == ["grouped_fwd_kernel_gate_up", "grouped_fwd_kernel_down"]
    small = tuple(a[:experts.MAX_TOKENS] if a.shape[0] == n else a for a in args)
    assert _kernel_names(run, *small, *shared) == ["experts_fwd_kernel_gate_up", "experts_fwd_kernel_down"]
    y = run(*args, *shared)
    assert y.dtype == dtype
    assert rel_err(y, moe.moe_experts(*args, *shared, **kw)) <= _tol(dtype)


def test_grouped_errors():
    with pytest.raises(ValueError, match=r"GroupedTuning.block_m=48 must be a power of two >= 16"):
        grouped.GroupedTuning(block_m=48)
    with pytest.raises(ValueError, match=r"GroupedTuning.block_ki=8 must be a power of two >= 16"):
        grouped.GroupedTuning(block_ki=8)
    with pytest.raises(ValueError, match=r"GroupedTuning.warps_down=3 must be a power of two$"):
        grouped.GroupedTuning(warps_down=3)
    with pytest.raises(ValueError, match=r"GroupedTuning.stages_gate_up=0 must be an int >= 1"):
        grouped.GroupedTuning(stages_gate_up=0)
    with pytest.raises(ValueError, match=r"GroupedTuning.weight_eviction='evict_last' must be one of"):
        grouped.GroupedTuning(weight_eviction="evict_last")
    args, _, _, _ = _inputs(0, 3, d=120, i=64)
    with pytest.raises(ValueError, match=r"the grouped MoE kernel needs D=120 and I=64 divisible by 16"):
        grouped.moe_experts(*args)
    # The dispatcher's checks come first, as for the decode kernels.
    args, _, _, _ = _inputs(0, experts.MAX_TOKENS + 1)
    x, w, ids, wg, wu, wd = args
    with pytest.raises(ValueError, match=r"we_down.shape=\(16, 64, 128\) must be \[E, D, I\] = \(16, 128, 64\)"):
        moe.moe_experts(x, w, ids, wg, wu, jnp.swapaxes(wd, 1, 2), backend="pallas")
    with pytest.raises(ValueError, match=r"residual.dtype=bfloat16 must be one of \['float32'\]"):
        moe.moe_experts(*args, backend="pallas", residual=x.astype(jnp.bfloat16))


def _calls(txt):
    return {re.search(r'name = "([^"]+)"', c).group(1): c for c in txt.split("stablehlo.custom_call")[1:]}


@pytest.mark.parametrize("eviction", [None, "evict_first"])
def test_grouped_lowers_for_cuda(monkeypatch, eviction):
    """The layer's experts at Flash size and 8192 tokens lower to Triton: (I / BN, tiles) and (D / BD, tiles) grids
    with the static tile bound (65536 + 512·63) // 64 = 1528, the weight loads with the chosen eviction policy."""
    bf, sds = jnp.bfloat16, jax.ShapeDtypeStruct
    n, d, i, e, k = 8192, 2560, 768, 512, 8
    tu = grouped.GroupedTuning(weight_eviction=eviction)

    def layer(x, w, ids, wg, wu, wd, sg, su, sd, r):
        return grouped.moe_experts(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0, tuning=tu,
                                   residual=r)

    txt = lower_for_cuda(monkeypatch, [grouped], layer, sds((n, d), bf), sds((n, k), jnp.float32),
                         sds((n, k), jnp.int32), sds((e, i, d), bf), sds((e, i, d), bf), sds((e, d, i), bf),
                         sds((i, d), bf), sds((i, d), bf), sds((d, i), bf), sds((n, d), bf))
    calls = _calls(txt)
    assert sorted(calls) == ["grouped_fwd_kernel_down", "grouped_fwd_kernel_gate_up"]
    assert grouped.max_tiles(n * k, e, 64) == 1528
    assert "grid_x = 12" in calls["grouped_fwd_kernel_gate_up"] and "grid_y = 1528" in calls[
        "grouped_fwd_kernel_gate_up"]
    assert "grid_x = 20" in calls["grouped_fwd_kernel_down"] and "grid_y = 1528" in calls["grouped_fwd_kernel_down"]


@pytest.mark.parametrize("router_dtype", ["float32", "bfloat16"])
def test_route_pallas_prefill_size(monkeypatch, router_dtype):
    """The Pallas router at N = 8192 (router.PREFILL_TUNING: 64 x 64 dot tiles, no D-split; with a bf16 router a
    bf16 tensor-core dot, whose products are exact in fp32) selects the reference's experts, interpreted at D 64,
    E 32; and lowers at Flash size (grids (8, 1, 128) and (8192,))."""
    from pallas_kernels.moe import router as router_mod

    n = 8192
    rng = np.random.default_rng(input_seed(70))
    x = jnp.asarray(rng.standard_normal((n, 64)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((32, 64)) / 8, router_dtype)  # [E, D]
    bias = jnp.asarray(0.01 * rng.standard_normal(32), jnp.float32)
    w, ids = moe.route(x, router, bias, **ROUTE_KW, backend="pallas")
    w_ref, ids_ref = moe.route(x, router, bias, **ROUTE_KW)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
    sds = jax.ShapeDtypeStruct
    fn = lambda x, r, b: moe.route(x, r, b, **ROUTE_KW, backend="pallas")  # noqa: E731
    txt = lower_for_cuda(monkeypatch, [router_mod], fn, sds((n, 2560), jnp.bfloat16), sds((512, 2560), router_dtype),
                         sds((512,), jnp.float32))
    calls = _calls(txt)
    assert all(g in calls["router_fwd_kernel_gemv"] for g in ("grid_x = 8", "grid_y = 1", "grid_z = 128"))
    assert "grid_x = 8192" in calls["router_fwd_kernel_topk"]


# --- Block-FP8 expert matrices (pallas_kernels/common/fp8.py, layout OUT_IN) ---

# At D 256, I 192: BK 256 (each step two 128-wide sub-blocks, one scale each), 64-row gate/up tiles (two per scale
# block, the second block ragged), 128-feature down tiles (one scale block high), 64-wide down chunks.
FP8_TUNING = grouped.GroupedTuning(block_m=16, block_i=64, block_k=256, block_d=128, block_ki=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shared,limits", [("fp8", (4.0, 5.0)), ("mixed", (4.0, 5.0)), (None, (0.0, 0.0))],
                         ids=["shared-clamp", "shared-mixed-clamp", "routed"])
def test_grouped_fp8_matches_reference(shared, limits, dtype):
    """Prefill (N = 70 > experts.MAX_TOKENS, through the dispatcher) with every routed expert matrix FP8, D 256 and
    I 192 (2 x 2 scale blocks, one ragged), skewed routing, with and without the shared expert (all FP8, or its up
    matrix plain: either way on the grouped kernels, grouped.shared_expert) and the clamps: the grouped kernels
    against the reference (float32 weights); float32 also against NumPy float64 on the exact weights."""
    from tests.ops.test_moe import _fp8_expert_inputs, _fp8_tol

    dtype = jnp.dtype(dtype)
    n = experts.MAX_TOKENS + 6
    args, ws, (np_args, np_ws) = _fp8_expert_inputs(120, n, e=16, dtype=dtype, big=limits[0] > 0)
    ids = jnp.asarray(_ids(np.random.default_rng(input_seed(121)), n, 4, 16, "skewed"), jnp.int32)
    args, np_args = (*args[:2], ids, *args[3:]), (*np_args[:2], np.asarray(ids), *np_args[3:])
    if shared == "mixed":  # a plain up matrix: the FP8 one's values in x's dtype
        ws = (ws[0], ws[1].dequantize(jnp.float32).astype(dtype), ws[2])
    ws, np_ws = (ws, np_ws) if shared else ((), None)
    kw = dict(limit=limits[0], shared_limit=limits[1])
    y = grouped.moe_experts(*args, *ws, **kw, tuning=FP8_TUNING)
    assert y.dtype == dtype
    assert rel_err(y, moe.moe_experts(*args, *ws, **kw)) <= _fp8_tol(dtype)
    if dtype == jnp.float32:
        assert rel_err(y, np_moe(*np_args, np_ws, **kw)) <= F32_TOL
        run = lambda *a: moe.moe_experts(*a, **kw, backend="pallas")  # noqa: E731  (DEFAULT_TUNING: BK 64)
        assert _kernel_names(run, *args, *ws) == ["grouped_fwd_kernel_gate_up", "grouped_fwd_kernel_down"] * (
            2 if shared else 1)  # the routed experts, then the shared one
        assert rel_err(run(*args, *ws), y) <= _fp8_tol(dtype)


def test_grouped_fp8_errors():
    from tests.ops.test_moe import _fp8_expert_inputs

    args, ws, _ = _fp8_expert_inputs(0, 3)
    with pytest.raises(ValueError, match=r"GroupedTuning.block_d=256 gives tiles of 256 weight rows; with FP8 weights "
                                         r"a tile's rows must lie in one 128-row scale block: use block_d <= 128"):
        grouped.moe_experts(*args, *ws, tuning=grouped.GroupedTuning(block_d=256))
    with pytest.raises(ValueError, match=r"we_gate.q.dtype=float32 must be float8_e4m3fn"):
        moe.moe_experts(*args[:3], dataclasses.replace(args[3], q=args[3].q.astype(jnp.float32)), *args[4:],
                        backend="pallas")


def test_grouped_fp8_lowers_for_cuda(monkeypatch):
    """FP8 experts at Flash size and 8192 tokens lower to Triton with DEFAULT_TUNING's grids (the same as bf16), the
    FP8 shared expert on the same kernels as a one-expert stack: 8192 / 64 tiles."""
    from pallas_kernels.common import fp8

    bf, f32, sds = jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct
    n, d, i, e, k = 8192, 2560, 768, 512, 8

    def w8(*shape):
        return fp8.Fp8Weight(sds(shape, fp8.FP8_DTYPE), sds(fp8.scale_shape(shape, fp8.OUT_IN), f32), fp8.OUT_IN)

    def layer(x, w, ids, wg, wu, wd, sg, su, sd, r):
        return grouped.moe_experts(x, w, ids, wg, wu, wd, sg, su, sd, limit=4.0, shared_limit=5.0, residual=r)

    txt = lower_for_cuda(monkeypatch, [grouped], layer, sds((n, d), bf), sds((n, k), f32), sds((n, k), jnp.int32),
                         w8(e, i, d), w8(e, i, d), w8(e, d, i), w8(i, d), w8(i, d), w8(d, i), sds((n, d), bf))
    grid = lambda c: re.search(r"grid_x = (\d+).*?grid_y = (\d+)", c, re.S).groups()  # noqa: E731
    grids = [(re.search(r'name = "([^"]+)"', c).group(1), grid(c)) for c in txt.split("stablehlo.custom_call")[1:]]
    assert grids == [("grouped_fwd_kernel_gate_up", ("12", "1528")), ("grouped_fwd_kernel_down", ("20", "1528")),
                     ("grouped_fwd_kernel_gate_up", ("12", "128")), ("grouped_fwd_kernel_down", ("20", "128"))]
