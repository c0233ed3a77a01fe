"""Chunked prefill: a prompt prefilled in chunks leaves the state a one-shot prefill leaves, and decoding goes on
identically; the memory check refuses a prefill that cannot fit, with its sizes, before allocating."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import model
from ling_jax.cache import KDACache, MLACache
from ling_jax.config import DeviceMemoryError, preset
from ling_jax.engine import generate as G
from ling_jax.engine import speculative as S
from ling_jax.engine.drafters import Suffix
from ling_jax.engine.sampling import Greedy
from ling_jax.params import init_params

from tests.cli_run import run_ling_jax
from tests.numerics import input_seed
from tests.numerics import rel_err as rel

# Chunked and one-shot prefill run the same math in other shapes (KDA from a carried state, MLA over the cache
# masked past the chunk): measured <= 2e-6 relative on the toy preset in float32; 1e-5 leaves room for XLA's
# reduction orders.
TOL_F32 = 1e-5
T = 150  # not a multiple of the KDA chunk (64) nor of most chunk sizes below
MAX_LEN = 256


@pytest.fixture(scope="module")
def toy():
    cfg = preset("toy")
    return cfg, init_params(cfg, jax.random.key(input_seed(3)), jnp.float32, with_mtp=False)


@pytest.fixture(scope="module")
def tokens(toy):
    cfg, _ = toy
    return jax.random.randint(jax.random.key(input_seed(4)), (2, T + 40), 0, cfg.vocab_size)


@pytest.fixture(scope="module")
def one_shot(toy, tokens):
    cfg, params = toy
    return model.prefill(params, tokens[:, :T], cfg, max_len=MAX_LEN, all_logits=True, chunk=T)


def _state_arrays(state):
    out = []
    for entry in state.layers:
        out += [entry.conv_window, entry.state] if isinstance(entry, KDACache) else [entry.kv]
    return out


@pytest.mark.parametrize("chunk", [64, 50, 1, 149, 200], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(toy, tokens, one_shot, chunk):
    """Chunks that do not divide T (64: 22 + 2 x 64), that do (50), of one token, a remainder of one (149) and
    larger than the prompt (200: one forward)."""
    cfg, params = toy
    logits, state, hidden = model.prefill(params, tokens[:, :T], cfg, max_len=MAX_LEN, all_logits=True,
                                          chunk=chunk)
    ref_logits, ref_state, ref_hidden = one_shot
    assert int(state.length) == T
    assert rel(logits, ref_logits) < TOL_F32
    assert rel(hidden, ref_hidden) < TOL_F32
    for got, want in zip(_state_arrays(state), _state_arrays(ref_state)):
        got, want = (got[:, :T], want[:, :T]) if got.ndim == 3 else (got, want)
        assert rel(got, want) < TOL_F32


def test_chunked_prefill_with_the_kernels(toy, tokens, one_shot):
    """The `pallas` profile (interpreted on the CPU): KDA chunk kernels from a carried state, the MLA flash kernel
    from a non-zero start, the grouped-GEMM MoE (2 x 64 tokens per chunk: past the decode kernels' 64) against the
    reference's one-shot prefill. float32: the kernels' own bounds are <= 2e-6 (tests/ops)."""
    cfg, params = toy
    logits, state, _ = model.prefill(params, tokens[:, :T], cfg, max_len=MAX_LEN, all_logits=True, chunk=64,
                                     backend="pallas")
    assert rel(logits, one_shot[0]) < TOL_F32
    for got, want in zip(_state_arrays(state), _state_arrays(one_shot[1])):
        got, want = (got[:, :T], want[:, :T]) if got.ndim == 3 else (got, want)
        assert rel(got, want) < TOL_F32


def test_decoding_after_a_chunked_prefill_goes_on_identically(toy, tokens, one_shot):
    """40 decode steps from the chunked state and from the one-shot state, fed the same tokens."""
    cfg, params = toy
    _, state, _ = model.prefill(params, tokens[:, :T], cfg, max_len=MAX_LEN, chunk=64)
    ref_state = one_shot[1]
    got, want = [], []
    for t in range(T, T + 40):
        lg, state, _ = model.decode(params, state, tokens[:, t], cfg)
        rl, ref_state, _ = model.decode(params, ref_state, tokens[:, t], cfg)
        got.append(lg)
        want.append(rl)
    assert rel(jnp.stack(got), jnp.stack(want)) < TOL_F32


def test_last_logits_only(toy, tokens, one_shot):
    cfg, params = toy
    logits, _, _ = model.prefill(params, tokens[:, :T], cfg, max_len=MAX_LEN, chunk=64)
    assert logits.shape == (2, 1, cfg.vocab_size)
    assert rel(logits[:, 0], one_shot[0][:, -1]) < TOL_F32


def test_extend_never_reads_past_the_chunk(toy, tokens):
    """A later chunk expands the whole latent cache; rows past the chunk (here NaN) must not reach the output."""
    cfg, params = toy
    _, state, _ = model.prefill(params, tokens[:, :100], cfg, max_len=MAX_LEN, chunk=100)
    poisoned = state._replace(layers=tuple(
        MLACache(e.kv.at[:, 100:].set(jnp.nan)) if isinstance(e, MLACache) else e for e in state.layers))
    logits, _, _ = model.forward(params, tokens[:, 100:150], poisoned.layers, poisoned.length, cfg, mode="extend",
                                 backend="reference")
    clean, _, _ = model.forward(params, tokens[:, 100:150], state.layers, state.length, cfg, mode="extend",
                                backend="reference")
    assert bool(jnp.isfinite(logits).all())
    assert rel(logits, clean) == 0.0


def test_generate_with_a_prefill_chunk_gives_the_same_tokens(toy, tokens):
    cfg, params = toy
    prompt = np.asarray(tokens[:1, :T])
    plain = G.generate(params, cfg, prompt, max_new_tokens=24, sampler=Greedy(), ignore_eos=True)
    chunked = G.generate(params, cfg, prompt, max_new_tokens=24, sampler=Greedy(), ignore_eos=True,
                         prefill_chunk=40)
    spec = S.generate_speculative(params, cfg, prompt, max_new_tokens=24, sampler=Greedy(), drafter=Suffix(),
                                  k=3, ignore_eos=True, prefill_chunk=40)
    assert chunked.tokens == plain.tokens
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_a_bad_chunk_is_named(toy, tokens, chunk):
    cfg, params = toy
    with pytest.raises(ValueError, match="prefill chunk="):
        model.prefill(params, tokens[:, :8], cfg, max_len=16, chunk=chunk)


def test_prefill_bytes_scale_with_the_chunk_not_the_prompt():
    cfg = preset("ling-3.0-flash")
    args = dict(max_len=33024, itemsize=2, flash_attention=True)
    whole = model.prefill_bytes(cfg, 1, 32768, 32768, **args)
    chunked = model.prefill_bytes(cfg, 1, 32768, 4096, **args)
    assert whole["caches"] == chunked["caches"]
    # 7 MLA layers x 33024 positions x 576 values x 2 bytes, 35 KDA layers x (32 x 128 x 128 fp32 + window)
    assert chunked["caches"] == 7 * 33024 * 576 * 2 + 35 * (32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 2)
    assert chunked["activations"] < whole["activations"] / 4


class _FakeDevice:
    platform, device_kind = "gpu", "NVIDIA H200"

    def memory_stats(self):
        return {"bytes_limit": 8 * 2 ** 30, "bytes_in_use": 2 ** 30}


class _FakeSharding:
    device_set = {_FakeDevice()}


class _FakeEmbed:
    sharding, dtype = _FakeSharding(), jnp.bfloat16


def test_a_prefill_that_cannot_fit_is_refused_with_its_sizes():
    """Caches of a 32k-token Flash prefill (0.3 GiB) plus one 32k chunk's activations (the MoE's sorted pairs,
    ~8.6 GiB) exceed 7 GiB free; a 2048-token chunk fits. The reference on a GPU (XLA's dense MoE form, eager
    attention scores) is refused at 8192 tokens."""
    cfg = preset("ling-3.0-flash")
    params = {"embed": _FakeEmbed()}
    kernels = "kda=pallas,moe_prefill=pallas,mla_prefill=pallas"
    with pytest.raises(DeviceMemoryError, match=r"needs ~\d+\.\d GiB per device \(caches 0\.3 GiB.*7\.0 GiB are free.*"
                                          r"--prefill-chunk"):
        model.check_prefill_memory(params, cfg, 1, 32768, 32768, 33024, kernels)
    model.check_prefill_memory(params, cfg, 1, 32768, 2048, 33024, kernels)
    with pytest.raises(DeviceMemoryError, match="the prefill kernels \\(--backend fast\\)"):
        model.check_prefill_memory(params, cfg, 1, 8192, 8192, 9216, "reference")


def test_the_cli_prefills_in_chunks_with_the_same_tokens():
    from ling_jax import cli

    assert cli.PREFILL_CHUNK == model.PREFILL_CHUNK  # restated there so option errors need no JAX import
    ids = ",".join(str(i) for i in np.random.default_rng(input_seed(5)).integers(3, 500, 70))
    common = ["generate", "--preset", "toy", "--prompt-ids", ids, "--max-new-tokens", "12", "--ignore-eos",
              "--warmup", "0", "--json"]
    whole, chunked = (run_ling_jax(*common, *extra) for extra in ([], ["--prefill-chunk", "16"]))
    assert whole.returncode == chunked.returncode == 0, whole.stderr + chunked.stderr
    import json

    assert json.loads(chunked.stdout)["tokens"] == json.loads(whole.stdout)["tokens"]


def test_the_cli_reports_a_prefill_that_does_not_fit_in_one_line(monkeypatch, capsys):
    """The CLI treats the memory refusal as bad input: one error line with the sizes, exit 2, no traceback."""
    from ling_jax import cli

    def refuse(*args, **kwargs):
        raise DeviceMemoryError("prefill of batch 1 x 70 tokens ... needs ~9.0 GiB per device: pass a smaller "
                                "prefill chunk (--prefill-chunk)")

    monkeypatch.setattr(model, "check_prefill_memory", refuse)
    monkeypatch.setattr(G, "check_prefill_memory", refuse)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--preset", "toy", "--max-new-tokens", "2", "--warmup", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "needs ~9.0 GiB per device" in err and "--prefill-chunk" in err and "Traceback" not in err
