"""Tensor parallelism on 4 CPU devices: sharded params give the unsharded logits; bad device counts are named."""

import jax
import jax.numpy as jnp
import pytest

from ling_jax import model
from ling_jax.config import preset
from ling_jax.params import init_params
from ling_jax.sharding import logical_to_spec, make_mesh, param_shardings, state_shardings

from tests.numerics import rel_err as rel


@pytest.fixture(scope="module")
def toy():
    """(cfg, single-device params, tokens [1, 45], their single-device logits)."""
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)
    tokens = jax.random.randint(jax.random.key(1), (1, 45), 0, cfg.vocab_size)
    ref_logits, _, _ = model.prefill(params, tokens, cfg, max_len=64, all_logits=True)
    return cfg, params, tokens, ref_logits


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("n", [2, 4])
def test_tp_matches_single_device(toy, n):
    """TP2 and TP4 prefill logits at every position, then 5 decode steps, within 1e-5 of one device (float32: only
    the order of the all-reduced partial sums differs)."""
    cfg, params, tokens, ref_logits = toy
    mesh = make_mesh(n)
    sharded = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))
    mixer = sharded["layers"][0]["mixer"]  # the fused leaves split by head, every part of a head on one device
    assert mixer["w_in"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert mixer["conv_qkv"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp", None)
    logits, state, _ = model.prefill(sharded, tokens[:, :40], cfg, max_len=64, all_logits=True)
    assert rel(logits, ref_logits[:, :40]) < 1e-5
    state = jax.device_put(state, state_shardings(state, mesh))
    for t in range(40, 45):
        step, state, _ = model.decode(sharded, state, tokens[:, t], cfg)
        assert rel(step, ref_logits[:, t]) < 1e-5
    assert len(state.layers[0].state.sharding.device_set) == n


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("n", [2, 4])
def test_tp_verify_matches_single_device(toy, n):
    """TP2 and TP4 verify of T drafts: the single-device verify's logits and staged state within 1e-5, and
    commit(staged, k) for every k in 1..T is the single-device state after decoding k."""
    from ling_jax.cache import commit
    from tests.test_model import assert_commit_matches_decode, decoded_states

    cfg, params, tokens, _ = toy
    P, T = 40, 5
    drafts = tokens[:, P:P + T]
    _, state, _ = model.prefill(params, tokens[:, :P], cfg, max_len=64)
    decoded = decoded_states(params, cfg, jax.tree.map(jnp.copy, state), drafts)
    ref_logits, ref_staged, _ = model.verify(params, state, drafts, cfg)
    mesh = make_mesh(n)
    sharded = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))
    _, state, _ = model.prefill(sharded, tokens[:, :P], cfg, max_len=64)
    state = jax.device_put(state, state_shardings(state, mesh))
    logits, staged, _ = model.verify(sharded, state, drafts, cfg)
    assert rel(logits, ref_logits) < 1e-5
    assert int(staged.length) == int(ref_staged.length) == P
    for i, (mine, ref) in enumerate(zip(staged.layers, ref_staged.layers)):
        for name, a, b in zip(mine._fields, mine, ref):
            assert rel(a, b) < 1e-5, (i, name)
    for k in range(1, T + 1):
        assert_commit_matches_decode(commit(staged, jnp.int32(k)), decoded[k - 1], 1e-5)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_tp4_prefill_across_chunks_matches_single_device(toy):
    """A TP4 prefill of 150 tokens (two full 64-token KDA chunks and a partial one), batch 2: the single-device
    logits and caches, and the next decode step from them."""
    cfg, params, _, _ = toy
    tokens = jax.random.randint(jax.random.key(2), (2, 151), 0, cfg.vocab_size)
    ref_logits, ref_state, _ = model.prefill(params, tokens[:, :150], cfg, max_len=256, all_logits=True)
    ref_step, _, _ = model.decode(params, ref_state, tokens[:, 150], cfg)
    _, ref_state, _ = model.prefill(params, tokens[:, :150], cfg, max_len=256)  # decode donated it
    mesh = make_mesh(4)
    sharded = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))
    logits, state, _ = model.prefill(sharded, tokens[:, :150], cfg, max_len=256, all_logits=True)
    assert rel(logits, ref_logits) < 1e-5
    for mine, ref in zip(jax.tree.leaves(state.layers), jax.tree.leaves(ref_state.layers)):
        assert rel(mine, ref) < 1e-5
    step, _, _ = model.decode(sharded, jax.device_put(state, state_shardings(state, mesh)), tokens[:, 150], cfg)
    assert rel(step, ref_step) < 1e-5


def test_tp2_chunked_prefill_with_the_kernels_matches_single_device(toy):
    """TP2, every Pallas kernel, a 150-token batch-2 prompt in chunks of 64: the extend mode's flash attention from a
    traced start and the grouped-GEMM MoE (2 x 64 tokens per chunk) per shard inside the chunk scan give the
    single-device reference's logits and caches."""
    cfg, params, _, _ = toy
    tokens = jax.random.randint(jax.random.key(3), (2, 150), 0, cfg.vocab_size)
    ref_logits, ref_state, _ = model.prefill(params, tokens, cfg, max_len=256, all_logits=True)
    mesh = make_mesh(2)
    sharded = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))
    with jax.set_mesh(mesh):
        logits, state, _ = model.prefill(sharded, tokens, cfg, max_len=256, all_logits=True, backend="pallas",
                                         chunk=64)
    assert rel(logits, ref_logits) < 1e-5
    for mine, ref in zip(jax.tree.leaves(state.layers), jax.tree.leaves(ref_state.layers)):
        assert rel(mine[:, :150] if mine.ndim == 3 else mine, ref[:, :150] if ref.ndim == 3 else ref) < 1e-5


# The toy in block-FP8 at widths where every row split keeps whole 128-wide scale blocks on each of 4 devices
# (sharding.check_divisible): 4 heads x 128, and 512 intermediate rows. Three layers: KDA + dense, KDA + MoE, MLA + MoE.
_FP8_TOY = preset("toy", quantization="fp8", head_dim=128, v_head_dim=128, intermediate_size=512,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512)
FP8_TP = _FP8_TOY.replace(num_layers=3, num_mtp_layers=0, expert_swiglu_limits=_FP8_TOY.expert_swiglu_limits[:3],
                          shared_swiglu_limits=_FP8_TOY.shared_swiglu_limits[:3])


@pytest.fixture(scope="module")
def fp8_run():
    """(params, tokens [1, 25], what one device gives with the Pallas kernels: prefill logits, the decode step's,
    the verify's)."""
    params = init_params(FP8_TP, jax.random.key(4), jnp.float32, with_mtp=False)
    tokens = jax.random.randint(jax.random.key(5), (1, 25), 0, FP8_TP.vocab_size)
    return params, tokens, _fp8_steps(params, tokens)


def _fp8_steps(params, tokens):
    """Prefill of 20 tokens (past the GEMV's 16: XLA GEMMs over the ROWS weights dequantised), then one decode step
    and a verify of 4 through the Pallas kernels (the FP8 GEMV per shard)."""
    logits, state, _ = model.prefill(params, tokens[:, :20], FP8_TP, max_len=64, all_logits=True, backend="pallas")
    step, state, _ = model.decode(params, state, tokens[:, 20], FP8_TP, backend="pallas")
    ver, _, _ = model.verify(params, state, tokens[:, 21:25], FP8_TP, backend="pallas")
    return logits, step, ver


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
@pytest.mark.parametrize("n", [2, 4])
def test_fp8_tp_per_shard_matches_single_device(fp8_run, n):
    """Block-FP8 over TP2 and TP4 with every Pallas kernel per shard: the ROWS projections split by their declared
    axes (column-parallel w_in by head rows, row-parallel w_o and w_down by the input columns and their scale blocks)
    give one device's prefill, decode and verify logits within 1e-5 (float32: only the order of the all-reduced
    partial sums differs)."""
    from jax.sharding import PartitionSpec as P

    params, tokens, want = fp8_run
    mesh = make_mesh(n)
    sharded = jax.device_put(params, param_shardings(FP8_TP, mesh, with_mtp=False))
    w_in, w_o = sharded["layers"][0]["mixer"]["w_in"], sharded["layers"][0]["mixer"]["w_o"]
    assert (w_in.q.sharding.spec, w_in.scale.sharding.spec) == (P("tp", None, None), P("tp", None, None))
    assert (w_o.q.sharding.spec, w_o.scale.sharding.spec) == (P(None, "tp", None), P(None, "tp"))
    with jax.set_mesh(mesh):
        got = _fp8_steps(sharded, tokens)
    for name, g, w in zip(("prefill", "decode", "verify"), got, want):
        assert rel(g, w) < 1e-5, name


def test_bad_device_counts_are_named():
    cfg = preset("toy")
    with pytest.raises(ValueError, match="needs 9 devices"):
        make_mesh(9, devices=jax.devices()[:1])
    if len(jax.devices()) >= 3:
        with pytest.raises(ValueError, match="divisible by 3"):
            param_shardings(cfg, make_mesh(3))
    with pytest.raises(ValueError, match="more than once"):
        logical_to_spec(("heads", "ffn"))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_pallas_kernels_run_per_shard(toy):
    """TP2 with every Pallas kernel: the logits of one device, and no weight all-gathered around a kernel."""
    import re

    from ling_jax.cache import commit
    from ling_jax.engine import generate as G
    from ling_jax.engine.sampling import Greedy

    cfg, params, tokens, ref_logits = toy
    mesh = make_mesh(2)
    sharded = jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))
    with pytest.raises(ValueError, match="jax.set_mesh"):
        model.prefill(sharded, tokens, cfg, max_len=64, backend="pallas")
    with jax.set_mesh(mesh):
        logits, state, _ = model.prefill(sharded, tokens[:, :40], cfg, max_len=64, all_logits=True, backend="pallas")
        assert rel(logits, ref_logits[:, :40]) < 1e-5
        step, state, _ = model.decode(sharded, state, tokens[:, 40], cfg, backend="pallas")
        assert rel(step, ref_logits[:, 40]) < 1e-5
        assert_greedy_head_across_shards(sharded, state, tokens[:, 41:45], cfg)
        v_logits, staged, _ = model.verify(sharded, state, tokens[:, 41:45], cfg, backend="pallas")
        assert rel(v_logits, ref_logits[:, 41:45]) < 1e-5
        assert int(commit(staged, jnp.int32(4)).length) == 45

        def gathers(backend):
            eos = jnp.zeros((0,), jnp.int32)
            loop, _ = G.start(sharded, tokens[:, :8], jax.random.key(0), eos, cfg, Greedy(), max_len=16,
                              backend=backend, pad_id=0)
            hlo = G.decode_block.lower(sharded, loop, eos, cfg, Greedy(), steps=1, backend=backend,
                                       pad_id=0).compile().as_text()
            return len(re.findall(r"\ball-gather(?:-start)?\(", hlo))

        assert gathers("pallas") <= gathers("reference")


def assert_greedy_head_across_shards(params, state, fed, cfg):
    """The vocabulary-split greedy head picks jnp.argmax of the logits, and a tie between the two devices' halves
    of the vocabulary goes to the lower index whichever device holds it (forward does not donate: `state` stays).
    The logits come from the reference ops (the kernels' own logits are checked above); a tie is exact in both."""
    def run(head, backend):
        return jax.jit(lambda p: model.forward(p, fed, state.layers, state.length, cfg, mode="verify",
                                               backend=backend, head=head)[0])

    V = cfg.vocab_size
    logits_of, greedy_of = run("logits", "reference"), run("greedy", "pallas")
    best = int(jnp.argmax(logits_of(params)[0, 0]))
    twin = best - V // 2 if best >= V // 2 else best + V // 2  # the same column on the other device
    head = params["lm_head"]
    tied = dict(params, lm_head=jax.device_put(head.at[:, twin].set(head[:, best]), head.sharding))
    for p, expect_first in ((params, best), (tied, min(best, twin))):
        ids = greedy_of(p)
        assert ids.tolist() == jnp.argmax(logits_of(p), axis=-1).tolist()
        assert int(ids[0, 0]) == expect_first


def test_kernel_specs_are_the_params_shardings():
    """The shard_map specs the layers give the Pallas calls, derived from params.py's logical axes, written out:
    heads for the KDA op's inputs and state, the intermediate dim for every expert matrix (gate/up [.., Ie, D] by
    rows, down [.., D, Ie] by columns), the router and biases replicated. A drift would hand a kernel the wrong
    shard of a weight."""
    from jax.sharding import PartitionSpec as P

    from ling_jax.layers import kda, moe

    cfg = preset("toy")
    rows, heads, tp = P(None, None, None, "tp", None), P(None, None, "tp", None), "tp"
    assert kda._in_specs(cfg) == (rows, heads, P(None, None, tp), heads, rows, P(None, tp, None, None),
                                  P(None, None, tp, None), P(tp), P(tp, None), P(None))
    names = ("router", "expert_bias") + moe._ROUTED + moe._SHARED
    assert moe._partition_specs(cfg, names) == (P(None, None), P(None), P(None, tp, None), P(None, tp, None),
                                                P(None, None, tp), P(tp, None), P(tp, None), P(None, tp))
    mesh = make_mesh(2)
    shardings = param_shardings(cfg, mesh)
    ffn = next(layer["ffn"] for layer in shardings["layers"] if "we_gate" in layer["ffn"])
    assert tuple(ffn[n].spec for n in names) == moe._partition_specs(cfg, names)
