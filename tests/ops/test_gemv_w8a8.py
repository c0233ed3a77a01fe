"""The W8A8 GEMV (pallas_kernels/gemv/w8a8.py) against its fp32 reference, and its documented distance from the
weight-only path. Pallas interpret mode on the CPU; compiled on the GPU.

Tolerances: float32 x 1e-5 (each E4M3 x E4M3 product is exact in fp32, so only the summation order differs);
bfloat16 x 1e-3 with at most 2 % of the entries one bf16 ulp apart (the output's one rounding lands on the other
side of a tie when the fp32 sums differ in their last bits). Against the weight-only reference the quantised
activations move the output 1e-2..5e-2 (measured 2.2-2.9e-2 here): E4M3 keeps 3 mantissa bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import fp8
from pallas_kernels.gemv import reference, rows, w8a8
from tests.numerics import input_seed, rel_err


def _case(t, k, n, dtype, seed):
    rng = np.random.default_rng(input_seed(seed))
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    w = fp8.quantize(jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32), fp8.ROWS)
    residual = jnp.asarray(rng.standard_normal((t, n)), dtype)
    norm = (jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), dtype), 1e-6)
    return x, w, residual, norm


def _assert_close(got, want, dtype, what):
    err = rel_err(got, want)
    if dtype == jnp.float32:
        assert err <= 1e-5, f"{what}: {err:.2e}"
        return
    apart = float(np.mean(np.asarray(got, np.float32) != np.asarray(want, np.float32)))
    assert err <= 1e-3 and apart <= 0.02, f"{what}: {err:.2e}, {apart:.1%} of entries apart"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t, k, n, k_splits, extras", [
    (1, 256, 200, 1, "norm"),
    (3, 384, 130, 3, "residual"),
    (16, 256, 72, 2, "norm+residual"),
    (1, 512, 64, 4, "residual"),
])
def test_w8a8_matches_its_reference(t, k, n, k_splits, extras, dtype):
    x, w, residual, norm = _case(t, k, n, dtype, seed=t * 1000 + n)
    r = residual if "residual" in extras else None
    nrm = norm if "norm" in extras else None
    tuning = rows.RowsTuning(block_n=64, k_splits=k_splits)
    got = w8a8.gemv(x, w, r, norm=nrm, tuning=tuning)
    assert got.shape == (t, n) and got.dtype == dtype
    _assert_close(got, w8a8.reference(x, w, r, norm=nrm), dtype, f"T={t} N={n} KS={k_splits} {extras}")


def test_w8a8_is_its_own_numerics_not_the_weight_only_path():
    x, w, _, norm = _case(4, 256, 96, jnp.float32, seed=7)
    got = w8a8.gemv(x, w, norm=norm)
    weight_only = reference.gemv(x, w, norm=norm)
    err = rel_err(got, weight_only)
    print(f"W8A8 vs weight-only: {err:.2e}")
    assert 1e-2 <= err <= 5e-2, f"W8A8 is {err:.2e} from the weight-only path (documented: 1e-2..5e-2)"


def test_activation_groups_follow_the_weights_convention():
    """Each token's 128-column group: scale = amax / 448, its largest value saturating at exactly ±448."""
    x = jnp.asarray(np.random.default_rng(input_seed(3)).standard_normal((2, 256)), jnp.float32)
    xa = w8a8.quantize_activations(x)
    amax = np.abs(np.asarray(x)).reshape(2, 2, 128).max(-1)
    np.testing.assert_allclose(np.asarray(xa.scale), amax / 448.0, rtol=2e-7)
    assert float(jnp.max(jnp.abs(xa.q.astype(jnp.float32)))) == 448.0


def test_w8a8_bad_inputs_are_named():
    x, w, _, _ = _case(1, 256, 64, jnp.bfloat16, seed=1)
    with pytest.raises(ValueError, match="multiple of 128"):
        w8a8.gemv(x[:, :208], fp8.quantize(jnp.ones((64, 208), jnp.float32) * 0.5, fp8.ROWS))
    with pytest.raises(ValueError, match="layout"):
        w8a8.gemv(x, fp8.convert_layout(w, fp8.IN_OUT))
    with pytest.raises(ValueError, match="group=2: the W8A8 kernel steps one 128-column block"):
        w8a8.gemv(x, w, tuning=rows.RowsTuning(block_n=64, group=2))


def test_w8a8_lowers_for_cuda(monkeypatch):
    """At Flash's w_in and o_proj sizes the kernel lowers to Triton for the H200 with its FP8 operands straight
    into the dot (interpret mode runs no lowering)."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: gpu_info.get_gpu_info_from_version(
        gpu_info.GpuVersion.H200))
    monkeypatch.setattr(w8a8, "interpret_mode", lambda: False)
    sds = jax.ShapeDtypeStruct
    for t, k, n in [(1, 2560, 32 * 641), (16, 4096, 2560)]:
        w = fp8.Fp8Weight(sds((n, k), fp8.FP8_DTYPE), sds((n, k // fp8.BLOCK), jnp.float32), fp8.ROWS)
        tu = w8a8.default_tuning(t, k, n)
        txt = jax.jit(lambda x, w: w8a8.gemv(x, w)).trace(sds((t, k), jnp.bfloat16), w).lower(
            lowering_platforms=("cuda",)).as_text()
        assert txt.count('name = "gemv_w8a8"') == 1
        assert f"grid_x = {-(-n // tu.block_n)}" in txt and f"grid_y = {tu.k_splits}" in txt


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("tp", [2, 4])
def test_w8a8_per_shard(tp):
    """Under TP the W8A8 kernel runs per shard as ling_jax.layers.linear.dense places it: column-parallel (output
    rows split, x replicated, the norm and the activations' quantisation per device) and row-parallel (K split in
    whole 128-column blocks, so each device quantises the same groups the whole x has; partial sums added across
    devices, then the residual). K = 512: TP4 leaves one group per device. float32 x: 1e-5 of the whole kernel's
    own reference."""
    from jax.sharding import PartitionSpec as P

    x, w, residual, norm = _case(3, 512, 96, jnp.float32, seed=tp)
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])

    def put(a, spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    def put_w(spec):
        return fp8.Fp8Weight(put(w.q, spec), put(w.scale, spec), fp8.ROWS)

    by_rows, by_cols = P("tp", None), P(None, "tp")
    col = jax.jit(jax.shard_map(lambda x, w, r, g: w8a8.gemv(x, w, r, norm=(g, 1e-6)), mesh=mesh,
                                in_specs=(P(), fp8.Fp8Weight(by_rows, by_rows, fp8.ROWS), by_cols, P()),
                                out_specs=by_cols, check_vma=False))
    row = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum(w8a8.gemv(x, w), "tp"), mesh=mesh,
                                in_specs=(by_cols, fp8.Fp8Weight(by_cols, by_cols, fp8.ROWS)), out_specs=P(),
                                check_vma=False))
    for xs, rs in ((x[:1], residual[:1]), (x, residual)):
        got = col(put(xs, P()), put_w(by_rows), put(rs, by_cols), put(norm[0], P()))
        _assert_close(got, w8a8.reference(xs, w, rs, norm=norm), jnp.float32, f"TP{tp} column-parallel")
        got = row(put(xs, by_cols), put_w(by_cols)) + rs
        _assert_close(got, w8a8.reference(xs, w, rs), jnp.float32, f"TP{tp} row-parallel")
