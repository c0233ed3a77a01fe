"""Tensor parallelism on 4 CPU devices: sharded params give the unsharded logits; bad device counts are named."""

import jax
import jax.numpy as jnp
import pytest

from ling_jax import model
from ling_jax.config import preset
from ling_jax.params import init_params

from tests.numerics import rel_err as rel
from ling_jax.sharding import logical_to_spec, make_mesh, param_shardings, state_shardings



@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_tp4_matches_single_device():
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)
    tokens = jax.random.randint(jax.random.key(1), (1, 45), 0, cfg.vocab_size)
    ref_logits, _, _ = model.prefill(params, tokens, cfg, max_len=64, all_logits=True)

    mesh = make_mesh(4)
    shardings = param_shardings(cfg, mesh, with_mtp=False)
    sharded = jax.device_put(params, shardings)
    assert sharded["layers"][0]["mixer"]["w_q"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    logits, state, _ = model.prefill(sharded, tokens[:, :40], cfg, max_len=64, all_logits=True)
    assert rel(logits, ref_logits[:, :40]) < 1e-5
    state = jax.device_put(state, state_shardings(state, mesh))
    for t in range(40, 45):
        step, state, _ = model.decode(sharded, state, tokens[:, t], cfg)
        assert rel(step, ref_logits[:, t]) < 1e-5
    assert len(state.layers[0].state.sharding.device_set) == 4


def test_bad_device_counts_are_named():
    cfg = preset("toy")
    with pytest.raises(ValueError, match="needs 9 devices"):
        make_mesh(9, devices=jax.devices()[:1])
    if len(jax.devices()) >= 3:
        with pytest.raises(ValueError, match="divisible by 3"):
            param_shardings(cfg, make_mesh(3))
    with pytest.raises(ValueError, match="more than once"):
        logical_to_spec(("heads", "ffn"))


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_pallas_backends_refuse_sharded_params():
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)
    sharded = jax.device_put(params, param_shardings(cfg, make_mesh(4), with_mtp=False))
    with pytest.raises(ValueError, match="not partitioned for tensor parallelism"):
        model.prefill(sharded, jnp.zeros((1, 4), jnp.int32), cfg, max_len=8, backend="fast")
