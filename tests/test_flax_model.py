"""The Flax NNX model (ling_jax/flax_model.py): the functional core's arrays and numbers, as an nnx.Module."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling_jax
from ling_jax import flax_model, model
from ling_jax.config import preset
from ling_jax.engine.generate import generate
from ling_jax.engine.sampling import Greedy
from ling_jax.params import init_params
from ling_jax.sharding import make_mesh, param_shardings, state_shardings

FOUR = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")


@pytest.fixture(scope="module", params=[None, "fp8"])
def toy(request):
    """(cfg, params, tokens [1, 12]) of the toy preset, plain and block-FP8."""
    cfg = preset("toy").replace(quantization=request.param)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, cfg.vocab_size)
    return cfg, params, tokens


def _same_arrays(a, b) -> bool:
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def test_split_state_maps_onto_params_both_ways_without_copies(toy):
    cfg, params, _ = toy
    m = flax_model.LingForCausalLM(cfg, params)
    graphdef, state = nnx.split(m)
    assert _same_arrays(flax_model.state_to_params(cfg, state), params)
    assert _same_arrays(m.params, params)
    again = flax_model.params_to_state(cfg, params)
    assert _same_arrays(flax_model.state_to_params(cfg, again), params)
    merged = nnx.merge(graphdef, state)
    assert _same_arrays(merged.params, params)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert leaves and all(isinstance(v, nnx.Param) for v in leaves)
    w_in = dict(nnx.to_flat_state(state))[("layers", 0, "mixer", "w_in") + (("q",) if cfg.quantization else ())]
    # The logical axes params.py declares, in the stored order: a block-FP8 projection holds [out, in] (ROWS).
    assert w_in.out_sharding == (("heads", None, "embed") if cfg.quantization else ("embed", "heads", None))


def test_logits_bit_for_bit_with_the_functional_core(toy):
    cfg, params, tokens = toy
    m = flax_model.LingForCausalLM(cfg, params)
    want, want_state, _ = model.prefill(params, tokens[:, :11], cfg, max_len=16, all_logits=True)
    got, state, _ = m.prefill(tokens[:, :11], max_len=16, all_logits=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @nnx.jit
    def step(module, state, token):
        return module.decode(state, token)[0]

    @jax.jit
    def step_params(p, state, token):
        return model.decode_forward(p, state, token, cfg, backend="reference")[0]

    np.testing.assert_array_equal(np.asarray(step(m, state, tokens[:, 11])),
                                  np.asarray(step_params(params, want_state, tokens[:, 11])))


def test_mtp_and_verify_methods_are_the_cores(toy):
    cfg, params, tokens = toy
    m = flax_model.LingForCausalLM(cfg, params)
    _, state, hidden = model.prefill(params, tokens[:, :8], cfg, max_len=16)
    want, _, _ = model.verify(params, state, tokens[:, 8:11], cfg)
    _, state, hidden = model.prefill(params, tokens[:, :8], cfg, max_len=16)
    got, _, _ = m.verify(state, tokens[:, 8:11])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if "mtp" in params:
        from ling_jax.cache import mla_cache
        cache, start = mla_cache(cfg, 1, 16, jnp.float32), jnp.int32(0)
        want = model.mtp_forward(params, hidden[:, :4], tokens[:, 1:5], cache, start, cfg, mode="prefill")[0]
        got = m.mtp(hidden[:, :4], tokens[:, 1:5], cache, start, mode="prefill")[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_greedy_generation_through_the_module_equals_params(toy):
    cfg, params, tokens = toy
    m = flax_model.LingForCausalLM(cfg, params)
    prompt = np.asarray(tokens[:, :6])
    want = generate(params, cfg, prompt, max_new_tokens=8, sampler=Greedy(), block_size=4, ignore_eos=True)
    got = m.generate(prompt, max_new_tokens=8, block_size=4, ignore_eos=True)
    assert got.tokens == want.tokens


@FOUR
def test_state_shardings_are_the_params_shardings():
    cfg = preset("toy")
    mesh = make_mesh(4)
    m = flax_model.LingForCausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    want = param_shardings(cfg, mesh)
    got = jax.tree.map(lambda a: a.sharding, flax_model.state_to_params(cfg, nnx.state(m)))
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    assert jax.tree.leaves(m.shardings(mesh)) == jax.tree.leaves(want)
    with jax.set_mesh(mesh):  # a sharded module runs like sharded params
        tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, cfg.vocab_size)
        logits, state, _ = m.prefill(tokens, max_len=16)
        state = jax.device_put(state, state_shardings(state, mesh))
        assert np.isfinite(np.asarray(m.decode(state, tokens[:, -1])[0])).all()


def test_eval_shape_of_the_full_preset_allocates_nothing():
    """In a fresh process, so that the measured resident memory is this model's alone."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from flax import nnx
        from ling_jax.config import preset
        from ling_jax.flax_model import LingForCausalLM
        from ling_jax.params import count_params

        def rss_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024

        cfg = preset("ling-3.0-flash")
        nnx.eval_shape(lambda: LingForCausalLM(preset("toy"), rngs=nnx.Rngs(0)))  # imports and tracing warmed up
        before = rss_mb()
        abstract = nnx.eval_shape(lambda: LingForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
        grown = rss_mb() - before
        leaves = jax.tree.leaves(nnx.state(abstract))
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), {type(x) for x in leaves}
        n = sum(x.size for x in leaves)
        print(n, count_params(cfg), grown)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, cwd=_repo())
    assert out.returncode == 0, out.stderr[-2000:]
    n, count, grown = out.stdout.split()[-3:]
    assert int(n) == int(count) > 127e9  # every weight of the 127.5B-parameter model, abstract
    # 255 GB of bf16 weights; tracing ~700 initialisers leaves well under 300 MB resident.
    assert float(grown) < 300, f"eval_shape grew the process by {grown} MB"


@FOUR
def test_orbax_round_trip_restores_onto_two_devices_from_four(tmp_path):
    cfg = preset("toy")  # (block-FP8 toy sizes split no whole 128-row scale blocks 4 ways)
    m = flax_model.LingForCausalLM(cfg, rngs=nnx.Rngs(3), dtype=jnp.bfloat16, mesh=make_mesh(4))
    flax_model.save(m, tmp_path / "ckpt")
    restored = flax_model.load(tmp_path / "ckpt", mesh=make_mesh(2))
    for a, b, s in zip(jax.tree.leaves(m.params), jax.tree.leaves(restored.params),
                       jax.tree.leaves(param_shardings(cfg, make_mesh(2)))):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        assert b.sharding == s
    one = flax_model.load(tmp_path / "ckpt")
    assert _same_structure(one.params, m.params)


def _same_structure(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b)


def test_engine_tokens_from_the_module_equal_params_on_a_transformers_checkpoint(tmp_path_factory):
    from conversion.load import load_hf
    from tests import hf_ref

    small = hf_ref.CONFIGS[0]
    _, _, hf_dir = hf_ref.saved_checkpoint(small, tmp_path_factory)
    cfg, params = load_hf(hf_dir, progress=False)
    m = ling_jax.load(hf_dir)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 7))
    want = generate(params, cfg, prompt, max_new_tokens=10, sampler=Greedy(), block_size=4, ignore_eos=True)
    got = m.generate(prompt, max_new_tokens=10, block_size=4, ignore_eos=True)
    assert got.tokens == want.tokens
    assert generate(m, cfg, prompt, max_new_tokens=10, sampler=Greedy(), block_size=4,
                    ignore_eos=True).tokens == want.tokens  # the engine takes the module where it takes params
    logits = model.prefill(m, np.asarray(prompt), cfg, max_len=32)[0]  # and so do the model functions
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model.prefill(params, prompt, cfg, max_len=32)[0]))


def test_bad_inputs_are_named(toy):
    cfg, params, _ = toy
    with pytest.raises(ValueError, match="needs params to wrap, or rngs"):
        flax_model.LingForCausalLM(cfg)
    broken = dict(params, final_norm=params["final_norm"][:-1])
    with pytest.raises(ValueError, match=r"final_norm: expected \[\d+\], found \[\d+\]"):
        flax_model.LingForCausalLM(cfg, broken)
    with pytest.raises(ValueError, match="missing lm_head"):
        flax_model.LingForCausalLM(cfg, {k: v for k, v in params.items() if k != "lm_head"})


def _repo():
    from pathlib import Path
    return str(Path(__file__).resolve().parents[1])
