"""KDA ops: reference vs fla's pure-torch naive code, then dispatch (reference and Pallas) vs the reference.

Inputs are random draws from a fixed seed (tests/numerics.py's input_seed; LING_JAX_TEST_SEED=random sweeps, and
the seed is printed in each failure message). Comparisons use the relative error ||a - b|| / ||b||. On CPU the
Pallas kernels run in interpret mode, so CI tests them; on a GPU the same suite runs them compiled.
"""

import functools

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from pallas_kernels import kda
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.reference import layer_inputs

jax.config.update("jax_default_matmul_precision", "highest")

from fla.ops.kda.gate import naive_kda_lowerbound_gate  # noqa: E402
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402

from tests.numerics import input_seed, rel_err  # noqa: E402

W = 4


def packed(args):
    """layer_inputs' parts as decode and verify take them: the fused projection's packed x, then the rest."""
    return (ref.pack(*args[:4]), *args[4:])


def core_inputs(seed, B, T, H, K, gate="mixed"):
    """fp32 (q̂, k̂, v, g, beta, h0) as the delta rule sees them; gate="strong" puts g near the −5 bound."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = rng.standard_normal((B, T, H, K)).astype(f32)
    k = rng.standard_normal((B, T, H, K)).astype(f32)
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    v = rng.standard_normal((B, T, H, K)).astype(f32)
    lo = {"mixed": -5.0, "strong": -5.0, "weak": -0.5}[gate]
    hi = {"mixed": -0.01, "strong": -4.5, "weak": -0.001}[gate]
    g = rng.uniform(lo, hi, (B, T, H, K)).astype(f32)
    beta = rng.uniform(0.05, 1.0, (B, T, H)).astype(f32)
    h0 = rng.standard_normal((B, H, K, K)).astype(f32)
    return q, k, v, g, beta, h0


def to_t(x):
    return torch.from_numpy(np.array(jnp.asarray(x, jnp.float32)))


def torch_layer(qkv, f, b, z, window, state, conv_w, A_log, dt_bias, o_norm_w, *, lower_bound=-5.0, eps=1e-6,
                core="recurrent"):
    """Independent torch composition of the layer around fla's naive_recurrent_kda (or naive_chunk_kda,
    T % 64 == 0) following docs/model.md §3.2, bf16-aware."""
    tdt = torch.bfloat16 if qkv.dtype == jnp.bfloat16 else torch.float32
    x = torch.cat([to_t(window), to_t(qkv)], 1)  # [B, W-1+T, 3, H, K]
    T = qkv.shape[1]
    w = to_t(conv_w)
    acc = sum(w[j] * x[:, j:j + T] for j in range(W))
    y = torch.nn.functional.silu(acc).to(tdt).float()
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)
    q, k, v = l2(y[:, :, 0]), l2(y[:, :, 1]), y[:, :, 2]
    H, K = qkv.shape[3:]
    g = naive_kda_lowerbound_gate(to_t(f), to_t(A_log), to_t(dt_bias).reshape(-1), lower_bound).to(tdt).float()
    beta = torch.sigmoid(to_t(b)).to(tdt).float()
    naive = naive_recurrent_kda if core == "recurrent" else naive_chunk_kda
    o, S = naive(q, k, v, g, beta, initial_state=to_t(state).clone(), output_final_state=True)
    o = o.to(tdt).float()
    yo = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * to_t(o_norm_w) * torch.sigmoid(to_t(z))
    return yo.to(tdt).float().numpy(), x[:, T:].numpy(), S.numpy()


# --- reference vs fla naive --------------------------------------------------------------------------------

@pytest.mark.parametrize("lower_bound", [-5.0, -0.7])
def test_gate(lower_bound):
    seed = input_seed()
    _, f, *_ , A_log, dt_bias, _ = layer_inputs(seed, 2, 5, 3, 16, gate="strong")
    got = ref.kda_gate(f, A_log, dt_bias, lower_bound)
    want = naive_kda_lowerbound_gate(to_t(f), to_t(A_log), to_t(dt_bias).reshape(-1), lower_bound)
    # Same fp32 formula; only exp/sigmoid implementations differ.
    assert rel_err(got, want.numpy()) < 1e-6, seed
    # sigmoid saturates to 1 in fp32, so the bound itself is reachable.
    assert float(got.min()) >= lower_bound and float(got.max()) <= 0.0


CORE_CASES = [
    # (B, T, H, K, gate, scale): scale None is the default K^-1/2; 1.0 and 0.05 sit far on either side of it.
    (1, 1, 2, 16, "mixed", None),
    (2, 7, 3, 32, "strong", None),
    (2, 7, 3, 32, "mixed", 1.0),
    (1, 64, 2, 64, "strong", None),
    (2, 100, 2, 32, "mixed", None),
    (1, 64, 2, 32, "weak", 0.05),
    (1, 128, 4, 64, "weak", None),
    (1, 300, 2, 16, "strong", None),
]


@pytest.mark.parametrize("B,T,H,K,gate,scale", CORE_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-scale{c[5]}" for c in CORE_CASES])
def test_naive_chunk(B, T, H, K, gate, scale):
    """reference recurrent and chunk vs fla naive_recurrent_kda (and naive_chunk_kda when T % 64 == 0)."""
    seed = input_seed()
    q, k, v, g, beta, h0 = core_inputs(seed, B, T, H, K, gate)
    o_rec, S_rec = ref.recurrent_kda(q, k, v, g, beta, h0, scale=scale)
    o_chk, S_chk = ref.chunk_kda(q, k, v, g, beta, h0, scale=scale)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    o_fla, S_fla = naive_recurrent_kda(*t, scale=scale, initial_state=torch.from_numpy(h0), output_final_state=True)
    # fp32 everywhere: only summation order differs. The token loop matches to rounding (1e-5); the chunked
    # form re-associates through the triangular solve (1e-4, the prefill tolerance throughout).
    assert rel_err(o_rec, o_fla.numpy()) < 1e-5, seed
    assert rel_err(S_rec, S_fla.numpy()) < 1e-5, seed
    assert rel_err(o_chk, o_fla.numpy()) < 1e-4, seed
    assert rel_err(S_chk, S_fla.numpy()) < 1e-4, seed
    if T % 64 == 0:
        o_nc, S_nc = naive_chunk_kda(*t, scale=scale, initial_state=torch.from_numpy(h0), output_final_state=True)
        assert rel_err(o_chk, o_nc.numpy()) < 1e-4, seed
        assert rel_err(S_chk, S_nc.numpy()) < 1e-4, seed


def test_chunk_padding_leaves_state():
    """Padding T=5 to a chunk: the padded tail (g=0, beta=0, k=0) must not move the state."""
    seed = input_seed()
    q, k, v, g, beta, h0 = core_inputs(seed, 1, 5, 2, 16, "strong")
    _, S_rec = ref.recurrent_kda(q, k, v, g, beta, h0)
    _, S_chk = ref.chunk_kda(q, k, v, g, beta, h0, chunk_size=16)
    assert rel_err(S_chk, S_rec) < 1e-5, seed


LAYER_CASES = [
    # (B, T, H, K, dtype, gate)
    (1, 1, 2, 16, "float32", "mixed"),
    (2, 7, 3, 32, "float32", "strong"),
    (1, 64, 2, 32, "bfloat16", "mixed"),
    (1, 100, 32, 128, "float32", "strong"),
    (1, 300, 2, 32, "bfloat16", "strong"),
]


@pytest.mark.parametrize("B,T,H,K,dtype,gate", LAYER_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-{c[5]}" for c in LAYER_CASES])
def test_reference_layer(B, T, H, K, dtype, gate):
    """Reference layer (recurrent and chunk) vs an independent torch composition around fla's naive code."""
    seed = input_seed()
    args = layer_inputs(seed, B, T, H, K, jnp.dtype(dtype), gate)
    y_t, win_t, S_t = torch_layer(*args)
    for mode in ("recurrent", "chunk"):
        y, win, S = ref.kda_layer(*args, mode=mode)
        assert y.dtype == args[0].dtype and win.dtype == args[0].dtype and S.dtype == jnp.float32
        assert rel_err(win, win_t) == 0.0, seed
        if dtype == "float32":
            # fp32: the recurrent path is the same op sequence as fla's naive loop (1e-5); chunk re-associates (1e-4).
            tol_y = tol_s = 1e-5 if mode == "recurrent" else 1e-4
        else:
            # bf16 rounds the conv output, g, beta, o and y: one bf16 ulp flips on near-ties. Measured max over 200
            # seeds (T = 64) and 40 (T = 300), both modes, on CPU: 2.5e-4 (y), 8.4e-6 (S); tolerances 4x, 3.6x.
            tol_y, tol_s = 1e-3, 3e-5
        assert rel_err(y, y_t) < tol_y, (seed, mode)
        assert rel_err(S, S_t) < tol_s, (seed, mode)


# --- Pallas kernels vs the reference (interpret mode on CPU, compiled on GPU) -------------------------------

DECODE_CASES = [
    # (B, H, K, dtype, gate, BV): BV == K fuses the gated RMSNorm into the kernel.
    (1, 32, 128, "float32", "strong", 32),
    (1, 32, 128, "float32", "mixed", 128),
    (3, 2, 16, "float32", "weak", 16),
    (2, 4, 64, "bfloat16", "strong", 32),
]


@pytest.mark.parametrize("B,H,K,dtype,gate,BV", DECODE_CASES,
                         ids=[f"B{c[0]}-H{c[1]}-K{c[2]}-{c[3]}-{c[4]}-BV{c[5]}" for c in DECODE_CASES])
def test_decode(B, H, K, dtype, gate, BV):
    from pallas_kernels.kda import recurrent
    seed = input_seed()
    args = packed(layer_inputs(seed, B, 1, H, K, jnp.dtype(dtype), gate))
    y_r, w_r, S_r = kda.kda_decode(*args)
    cfg = recurrent.RecurrentConfig(BV=BV, num_warps=8 if BV == 128 else 4)
    # The kernel updates the state in place: donate it, as the model does.
    step = jax.jit(lambda *a: recurrent.decode(*a, cfg=cfg), donate_argnums=2)
    y, w, S = step(*args[:2], jnp.array(args[2]), *args[3:])
    assert y.dtype == args[0].dtype and w.dtype == args[0].dtype and S.dtype == jnp.float32
    # fp32: same op sequence, reductions ordered differently (1e-5). bf16: the conv output, o and y are rounded
    # to bf16, so a near-tie now and then flips one bf16 ulp and carries it into y and S. Over 600 seeds on CPU
    # y differed in 5.5% of them, by at most 1.8e-3 (tolerance 4e-3, 2.2x); S by at most 2.8e-4, and 4.7e-4 at
    # seed 1272601626 (tolerance 1e-3, 2.1x the worst seen).
    tol = 1e-5 if dtype == "float32" else 4e-3
    assert rel_err(y, y_r) < tol, seed
    assert rel_err(S, S_r) < (1e-5 if dtype == "float32" else 1e-3), seed
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))
    # Through dispatch too.
    y2, _, _ = kda.kda_decode(*args, backend="pallas")
    assert rel_err(y2, y_r) < tol, seed


PREFILL_CASES = [
    # (B, T, H, K, dtype, gate, BV)
    (1, 1, 2, 16, "float32", "mixed", 16),
    (2, 7, 3, 32, "float32", "strong", 16),
    (1, 64, 2, 32, "float32", "strong", 32),
    (1, 100, 32, 128, "float32", "strong", 64),
    (1, 300, 2, 64, "float32", "mixed", 64),
    (1, 128, 2, 32, "bfloat16", "strong", 32),
    (1, 300, 2, 32, "bfloat16", "mixed", 16),
]


@pytest.mark.parametrize("B,T,H,K,dtype,gate,BV", PREFILL_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-{c[5]}-BV{c[6]}" for c in PREFILL_CASES])
def test_prefill(B, T, H, K, dtype, gate, BV):
    """Pallas chunk prefill vs the reference chunk path and vs fla's naive recurrent (and naive chunk) code.

    Interpret mode pads out-of-bounds reads with NaN, so a load past T that is not masked poisons the output.
    """
    from pallas_kernels.kda import chunk
    seed = input_seed()
    args = layer_inputs(seed, B, T, H, K, jnp.dtype(dtype), gate)
    y, w, S = chunk.prefill(*args, cfg=chunk.ChunkConfig(BV=BV))
    y_r, w_r, S_r = kda.kda_prefill(*args)
    y_t, w_t, S_t = torch_layer(*args)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_r))
    if dtype == "float32":
        # fp32 throughout; the chunked form re-associates sums through the triangular solve (1e-4).
        tol_y, tol_s = 1e-4, 1e-4
    else:
        # bf16 inputs: q̂/k̂/v and W/U/Ã are stored in bf16 between the kernels, as fla's chunk path does.
        # Measured max over 10 seeds on CPU: 3.6e-3 (y), 3.3e-3 (S), against every reference; 1e-2 is 2.8x, 3x.
        tol_y, tol_s = 1e-2, 1e-2
    assert rel_err(y, y_r) < tol_y, seed
    assert rel_err(S, S_r) < tol_s, seed
    assert rel_err(y, y_t) < tol_y, seed
    assert rel_err(S, S_t) < tol_s, seed
    if T % 64 == 0:
        y_c, _, S_c = torch_layer(*args, core="chunk")
        assert rel_err(y, y_c) < tol_y, seed
        assert rel_err(S, S_c) < tol_s, seed
    y2, _, _ = kda.kda_prefill(*args, backend="pallas")
    assert rel_err(y2, y_r) < tol_y, seed


# --- dispatch, reference backend ---------------------------------------------------------------------------

def test_prefill_split_matches_whole():
    """prefill(0:37) then prefill(37:100), then decode x3 == one prefill over the 103 rows (state and window thread)."""
    seed = input_seed()
    args = layer_inputs(seed, 1, 103, 2, 32, fresh_window=True)
    qkv, f, b, z, window, state = args[:6]
    rest = args[6:]
    y_all, win_all, S_all = kda.kda_prefill(*args)
    sl = lambda a, i, j: a[:, i:j]
    y1, w1, S1 = kda.kda_prefill(sl(qkv, 0, 37), sl(f, 0, 37), sl(b, 0, 37), sl(z, 0, 37), window, state, *rest)
    y2, w2, S2 = kda.kda_prefill(sl(qkv, 37, 100), sl(f, 37, 100), sl(b, 37, 100), sl(z, 37, 100), w1, S1, *rest)
    ys = [y1, y2]
    w, S = w2, S2
    for t in range(100, 103):
        x = ref.pack(sl(qkv, t, t + 1), sl(f, t, t + 1), sl(b, t, t + 1), sl(z, t, t + 1))
        y, w, S = kda.kda_decode(x, w, S, *rest)
        ys.append(y)
    # fp32; chunk boundaries move, so the chunked re-association differs (1e-4).
    assert rel_err(jnp.concatenate(ys, 1), y_all) < 1e-4, seed
    assert rel_err(S, S_all) < 1e-4, seed
    assert rel_err(w, win_all) == 0.0, seed


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("T", [2, 6, 9])
def test_verify_commit(T, backend):
    """verify's outputs equal decode's token by token, and commit equals (to rounding) decoding n tokens."""
    seed = input_seed()
    B, H, K = 2, 3, 32
    args = layer_inputs(seed, B, T, H, K)
    qkv, f, b, z, window, state = args[:6]
    rest = args[6:]
    y_v, conv_rows, states = kda.kda_verify(*packed(args), backend=backend)
    # Decode token by token as the ground truth of each position.
    w, S = window, state
    dec = []
    for t in range(T):
        sl = lambda a: a[:, t:t + 1]
        y, w, S = kda.kda_decode(ref.pack(sl(qkv), sl(f), sl(b), sl(z)), w, S, *rest, backend=backend)
        dec.append((y, w, S))
    # fp32, same recurrence (verify may fuse differently from decode): 1e-5.
    assert rel_err(y_v, jnp.concatenate([d[0] for d in dec], 1)) < 1e-5, seed
    # Every accept count, for the whole batch and per sequence (the two sequences at opposite ends): below T an
    # off-by-one in the window slice or the state index is not clamped back to the right position.
    commit = jax.jit(kda.kda_commit)
    for n in [np.full(B, i) for i in range(1, T + 1)] + [np.array([1, T]), np.array([T, 1])]:
        wc, Sc = commit(conv_rows, states, jnp.asarray(n, jnp.int32))
        for i, ni in enumerate(n):
            assert rel_err(Sc[i], dec[ni - 1][2][i]) < 1e-5, (seed, n)
            np.testing.assert_array_equal(np.asarray(wc[i]), np.asarray(dec[ni - 1][1][i]), err_msg=f"{seed=} {n=}")


# --- the packed fused-projection input of decode and verify ----------------------------------------------

def test_pack_is_the_projection_layout():
    """reference.pack lays the parts out as w_in's columns (the layer's split_inputs reads them back), and unpack
    inverts it exactly."""
    from ling_jax.config import preset
    from ling_jax.layers.kda import split_inputs
    args = layer_inputs(input_seed(), 2, 3, 4, 32)
    qkv, f, b, z = args[:4]
    x = ref.pack(qkv, f, b, z)
    assert x.shape == (2, 3, 4, 5 * 32 + 1)
    parts = split_inputs(x, preset("toy"))  # the toy preset's K is 32 too
    for name, want in (("q", qkv[:, :, 0]), ("k", qkv[:, :, 1]), ("v", qkv[:, :, 2]), ("f", f), ("g", z),
                       ("b", b[..., None])):
        np.testing.assert_array_equal(np.asarray(parts[name]), np.asarray(want), err_msg=name)
    for got, want in zip(ref.unpack(x), (qkv, f, b, z)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


PACKED_CASES = [(T, dtype) for T in (1, 3, 6) for dtype in ("float32", "bfloat16")]


def _packed_op(T):
    return kda.kda_decode if T == 1 else kda.kda_verify


def _spec_on_parts(args, T):
    """The reference layer on the unpacked parts: the specification the packed entry points must meet."""
    if T == 1:
        return ref.kda_layer(*args, mode="recurrent")
    return ref.kda_verify_layer(*args)


@pytest.mark.parametrize("T,dtype", PACKED_CASES, ids=[f"T{c[0]}-{c[1]}" for c in PACKED_CASES])
def test_packed_decode_verify(T, dtype):
    """Decode (T = 1) and verify through dispatch on the packed x (default tiling: BV = 16 < K, two V tiles
    per head and the norm after the kernel), both backends, against the reference layer on the parts."""
    seed = input_seed()
    args = layer_inputs(seed, 2, T, 3, 32, jnp.dtype(dtype), "mixed")
    want = _spec_on_parts(args, T)
    # Tolerances as in test_decode: fp32 reorders reductions; bf16 flips an ulp on a near-tie now and then.
    tol_y, tol_s = (1e-5, 1e-5) if dtype == "float32" else (4e-3, 1e-3)
    for backend in ("reference", "pallas"):
        y, rows, S = _packed_op(T)(*packed(args), backend=backend)
        assert y.dtype == args[0].dtype and rows.dtype == args[0].dtype and S.dtype == jnp.float32
        assert rel_err(y, want[0]) < tol_y, (seed, backend)
        assert rel_err(S, want[2]) < tol_s, (seed, backend)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(want[1]), err_msg=f"{seed=} {backend=}")


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_packed_per_shard(T, tp):
    """The packed x splits on H exactly as the parts did: the Pallas op under the layer's own specs (per shard
    of heads, TP2 and TP4 over H = 4) equals the reference on the whole array."""
    from jax.sharding import NamedSharding
    from ling_jax.config import preset
    from ling_jax.layers import kda as layer
    from ling_jax.sharding import make_mesh
    cfg = preset("toy")
    seed = input_seed()
    args = packed(layer_inputs(seed, 2, T, cfg.num_heads, cfg.head_dim))
    want = _packed_op(T)(*args)
    mesh = make_mesh(tp)
    in_specs = layer._in_specs(cfg, packed=True)
    out_specs = (layer._PER_HEAD, layer._ROWS, layer._STATES if T > 1 else layer._STATE)
    op = lambda *a: _packed_op(T)(*a, backend="pallas")  # noqa: E731
    run = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    got = run(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)))
    assert got[0].sharding.spec == layer._PER_HEAD
    assert rel_err(got[0], want[0]) < 1e-5, seed
    assert rel_err(got[2], want[2]) < 1e-5, seed
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("mode,T", [("decode", 1), ("verify", 3), ("verify", 6)])
@pytest.mark.parametrize("tp", [1, 2])
def test_kda_block_pallas_equals_reference(mode, T, tp):
    """The layer: kda_block with the KDA op on Pallas (the packed path) equals the reference backend (the parts),
    on one device and per shard of heads under TP2; projections on the reference GEMV in both."""
    from jax.sharding import NamedSharding, PartitionSpec
    from ling_jax.cache import KDACache
    from ling_jax.config import preset
    from ling_jax.layers.kda import kda_block
    from ling_jax.params import init_params
    from ling_jax.sharding import make_mesh, param_shardings
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)
    seed = input_seed()
    rng = np.random.default_rng(seed)
    H, K, D, W_ = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.conv_kernel_size
    h = jnp.asarray(rng.standard_normal((2, T, D)), jnp.float32)
    cache = KDACache(jnp.asarray(rng.standard_normal((2, W_ - 1, 3, H, K)), jnp.float32),
                     jnp.asarray(rng.standard_normal((2, H, K, K)) * 0.5, jnp.float32))

    def block(layer, h, cache, backend):
        return kda_block(layer["mixer"], h, (layer["input_norm"], cfg.rms_norm_eps), cache, cfg, mode=mode,
                         backend=backend, gemv="reference", residual=h)

    want, want_cache = jax.jit(functools.partial(block, backend="reference"))(params["layers"][0], h, cache)
    if tp > 1:
        mesh = make_mesh(tp)
        layer = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))["layers"][0]
        heads = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        cache = KDACache(jax.device_put(cache.conv_window, heads(PartitionSpec(None, None, None, "tp", None))),
                         jax.device_put(cache.state, heads(PartitionSpec(None, "tp", None, None))))
        with jax.set_mesh(mesh):
            got, got_cache = jax.jit(functools.partial(block, backend="pallas"))(layer, h, cache)
    else:
        got, got_cache = jax.jit(functools.partial(block, backend="pallas"))(params["layers"][0], h, cache)
    assert rel_err(got, want) < 1e-5, seed
    for g, w in zip(got_cache, want_cache):
        assert rel_err(g, w) < 1e-5, seed


def test_commit_scalar_n():
    seed = input_seed()
    args = layer_inputs(seed, 1, 4, 2, 16)
    _, conv_rows, states = kda.kda_verify(*packed(args))
    for n in range(1, 5):
        w, S = kda.kda_commit(conv_rows, states, jnp.int32(n))
        np.testing.assert_array_equal(np.asarray(S), np.asarray(states[:, n - 1]))
        np.testing.assert_array_equal(np.asarray(w), np.asarray(conv_rows[:, n:n + W - 1]))


SCALAR_CASES = [
    # (lower_bound, eps, BV): a weak bound and a large norm eps (each visible in y and S; the defaults run in every
    # other test), with the gated norm outside the kernel (BV < K) and fused into it (BV == K).
    (-0.7, 0.5, 16),
    (-0.7, 0.5, 32),
]


@pytest.mark.parametrize("lower_bound,eps,BV", SCALAR_CASES, ids=[f"lb{c[0]}-eps{c[1]}-BV{c[2]}" for c in SCALAR_CASES])
def test_kernel_scalars(lower_bound, eps, BV):
    """The gate's lower bound and the norm's eps reach every Pallas kernel (decode, verify, prefill) vs the
    independent torch composition at the same scalars."""
    from pallas_kernels.kda import chunk, recurrent
    seed = input_seed()
    B, H, K = 2, 2, 32
    kw = dict(lower_bound=lower_bound, eps=eps)
    rc = recurrent.RecurrentConfig(BV=BV, num_warps=4)
    for T, run in ((1, lambda *a: recurrent.decode(*packed(a), **kw, cfg=rc)),
                   (5, lambda *a: recurrent.verify(*packed(a), **kw, cfg=rc)),
                   (20, lambda *a: chunk.prefill(*a, **kw, cfg=chunk.ChunkConfig(BV=BV)))):
        args = layer_inputs(seed, B, T, H, K, gate="mixed")
        y, _, S = run(*args)
        y_t, _, S_t = torch_layer(*args, **kw)
        S = S[:, -1] if S.ndim == 5 else S  # verify returns every position's state
        # fp32; the chunked prefill re-associates through the triangular solve (1e-4), the token loops do not.
        tol = 1e-4 if T == 20 else 1e-5
        assert rel_err(y, y_t) < tol, (seed, T)
        assert rel_err(S, S_t) < tol, (seed, T)
        # Each value alone moves the result far beyond the tolerance: a kernel that ignored one would fail.
        y_eps, _, _ = torch_layer(*args, lower_bound=lower_bound)
        _, _, S_lb = torch_layer(*args, eps=eps)
        assert rel_err(y_eps, y_t) > 100 * tol and rel_err(S_lb, S_t) > 100 * tol, (seed, T)


def test_validation_messages():
    args = list(layer_inputs(0, 1, 3, 2, 16))
    with pytest.raises(ValueError, match=r"qkv.shape=.* must be \[B, T, 3, H, K\]"):
        kda.kda_prefill(args[0][:, :, :2], *args[1:])
    with pytest.raises(ValueError, match=r"state.dtype=bfloat16 must be float32"):
        kda.kda_prefill(*args[:5], args[5].astype(jnp.bfloat16), *args[6:])
    with pytest.raises(ValueError, match=r"z.shape=.* must be \(1, 3, 2, 16\)"):
        kda.kda_prefill(*args[:3], args[3][:, :2], *args[4:])
    with pytest.raises(ValueError, match=r"kda_decode needs T == 1, got x.shape=\(1, 3, 2, 81\)"):
        kda.kda_decode(*packed(args))
    x, *rest = packed(args)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=80 must be 5K\+1 = 81 \(q\|k\|v\|f\|g\|b per head, K=16"):
        kda.kda_verify(x[..., :80], *rest, backend="pallas")
    with pytest.raises(ValueError, match=r"x.dtype=float16 must be float32 or bfloat16"):
        kda.kda_verify(x.astype(jnp.float16), *rest, backend="pallas")
    with pytest.raises(ValueError, match=r"x.shape=.* must be the packed \[B, T, H, 5K\+1\]"):
        kda.kda_verify(args[0], *rest)
    with pytest.raises(ValueError, match=r"conv_window.dtype=bfloat16 must be float32"):
        kda.kda_verify(x, rest[0].astype(jnp.bfloat16), *rest[1:], backend="pallas")
    with pytest.raises(ValueError, match=r"backend='triton' must be one of"):
        kda.kda_prefill(*args, backend="triton")
    with pytest.raises(ValueError, match=r"lower_bound=-6.0 must be in \[-5, 0\)"):
        kda.kda_prefill(*args, lower_bound=-6.0)


def test_triton_lowering():
    """Every kernel lowers through the Pallas Triton lowering for an sm_90 target (no GPU needed): catches
    unsupported primitives and non-power-of-two blocks in CI before they reach the H200."""
    from unittest import mock
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    from pallas_kernels.kda import chunk, conv, recurrent
    h100 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
    with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100), \
            mock.patch.object(recurrent, "interpret_mode", lambda: False), \
            mock.patch.object(chunk, "interpret_mode", lambda: False), \
            mock.patch.object(conv, "interpret_mode", lambda: False):
        for dtype in (jnp.float32, jnp.bfloat16):
            a1 = packed(layer_inputs(0, 1, 1, 4, 128, dtype))
            a6 = packed(layer_inputs(0, 1, 6, 4, 128, dtype))
            a100 = layer_inputs(0, 1, 100, 4, 128, dtype)
            for BV in (32, 128):
                rc = recurrent.RecurrentConfig(BV=BV)
                lower(lambda *a: recurrent.decode(*a, cfg=rc), *a1)
                lower(lambda *a: recurrent.verify(*a, cfg=rc), *a6)
                lower(lambda *a: chunk.prefill(*a, cfg=chunk.ChunkConfig(BV=BV)), *a100)
