"""Per-layer parity with transformers' BailingHybridForCausalLM (ling_jax/crosscheck.py).

Every decoder layer's mixer output, FFN output, block output and MoE routing (expert sets per token and their
weights) of ling-jax's float32 prefill is compared with transformers' float64 forward, hooked. Each value must be
within 1e-5 relative and the expert sets must agree exactly: a bug in one layer's numerics shows at that layer,
where the logits would dilute it (test_per_layer_check_names_the_perturbed_layer: a perturbation the logits check
misses and this one names). The prompt is 80 tokens: the chunked KDA runs a full 64-token chunk and a partial one.
"""

import dataclasses
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from conversion.load import load_hf
from ling_jax import crosscheck, model
from ling_jax.config import MOE

from tests.hf_ref import CONFIGS, build, saved_checkpoint
from tests.numerics import input_seed

T_PROMPT = 80
TOL_F32 = 1e-5


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def case(request, tmp_path_factory):
    small = request.param
    m32, m64, hf_dir = saved_checkpoint(small, tmp_path_factory)
    cfg, params = load_hf(hf_dir, dtype=jnp.float32, progress=False)
    ids = np.random.default_rng(input_seed(CONFIGS.index(small))).integers(2, small.vocab_size, size=(1, T_PROMPT))
    return dict(cfg=cfg, params=params, ids=ids, ours=crosscheck.capture_ling(params, cfg, ids),
                ref=crosscheck.capture_transformers(m64, ids))


def test_every_layer_matches_transformers(case):
    report = crosscheck.compare(case["ours"], case["ref"], tolerance=TOL_F32)
    assert report.first_failure is None, "\n" + report.format()
    assert report.logits_error < TOL_F32


def test_every_layer_and_quantity_is_compared(case):
    """The comparison covers each layer's mixer, FFN and block output, and routing on exactly the MoE layers."""
    report = crosscheck.compare(case["ours"], case["ref"], tolerance=TOL_F32)
    compared = {}
    for check in report.checks:
        compared.setdefault(check.layer, set()).add(check.quantity)
    moe = {"experts", "weights"}
    want = {i: {"mixer", "ffn", "hidden"} | (moe if ffn == MOE else set())
            for i, (_, ffn) in enumerate(case["cfg"].layer_kinds)}
    assert compared == want


def test_captured_logits_are_the_model_prefill():
    """The tapped eager forward computes what the jitted prefill computes: the taps change nothing."""
    small = _small_case()
    logits, _, _ = model.prefill(small["params"], jnp.asarray(small["ids"]), small["cfg"], max_len=T_PROMPT,
                                 all_logits=True)
    np.testing.assert_allclose(small["ours"].logits, logits, rtol=1e-5, atol=1e-5)


def _scale_one_mixer(monkeypatch, layer: int, factor: float):
    """Multiply the mixer output of `layer` (the layer-th mixer call of a prefill) by `factor`."""
    calls = []

    def scaled(fn):
        def mixer(*args, residual=None, **kw):  # the mixer's own output, without the residual it adds
            out, entry = fn(*args, residual=None, **kw)
            calls.append(layer)
            out = out * factor if len(calls) == layer + 1 else out
            return (out if residual is None else residual + out), entry
        return mixer

    monkeypatch.setattr(model, "kda_block", scaled(model.kda_block))
    monkeypatch.setattr(model, "mla_block", scaled(model.mla_block))


@pytest.mark.parametrize("layer", [1, 2], ids=["mla", "kda"])
def test_per_layer_check_names_the_perturbed_layer(layer, monkeypatch):
    """A 4e-5 relative error in one layer's mixer moves the logits by less than the logits tolerance, yet the
    per-layer comparison names that layer and quantity as the first over tolerance."""
    small = _small_case()
    _scale_one_mixer(monkeypatch, layer, 1 + 4e-5)
    ours = crosscheck.capture_ling(small["params"], small["cfg"], small["ids"])
    report = crosscheck.compare(ours, small["ref"], tolerance=TOL_F32)
    assert report.logits_error < TOL_F32, "the logits check alone would catch this: use a smaller perturbation"
    first = report.first_failure
    assert (first.layer, first.quantity) == (layer, "mixer"), "\n" + report.format()
    assert first.kind.startswith(small["cfg"].layer_kinds[layer][0])
    assert f"first over tolerance: layer {layer} mixer" in report.format()


_SMALL_CASE = {}


def _small_case() -> dict:
    """The first config's models, prompt and both captures, built once for the tests that perturb them."""
    if not _SMALL_CASE:
        small = CONFIGS[0]
        m32, m64 = build(small, seed=0)
        ids = np.random.default_rng(input_seed(0)).integers(2, small.vocab_size, size=(1, T_PROMPT))
        with tempfile.TemporaryDirectory() as tmp:
            m32.save_pretrained(tmp, max_shard_size="200KB")
            cfg, params = load_hf(tmp, dtype=jnp.float32, progress=False)
        _SMALL_CASE.update(small=small, cfg=cfg, params=params, ids=ids, ours=crosscheck.capture_ling(params, cfg, ids),
                           ref=crosscheck.capture_transformers(m64, ids))
    return _SMALL_CASE


def _moe_layer(capture) -> int:
    return next(i for i, layer in enumerate(capture.layers) if "ids" in layer)


def test_expert_set_disagreement_is_reported_with_the_margin():
    """One token routed to one other expert fails its layer's "experts" check, naming the count and the
    reference's tie margin; swapping the order of a token's experts does not (sets are compared)."""
    small = _small_case()
    ours, ref = small["ours"], small["ref"]
    i = _moe_layer(ours)
    reordered = _with_layer(ours, i, ids=ours.layers[i]["ids"][:, ::-1], weights=ours.layers[i]["weights"][:, ::-1])
    assert crosscheck.compare(reordered, ref).first_failure is None

    ids = ours.layers[i]["ids"].copy()
    unused = next(e for e in range(small["small"].num_local_experts) if e not in ids[5])
    ids[5, 0] = unused
    first = crosscheck.compare(_with_layer(ours, i, ids=ids), ref).first_failure
    assert (first.layer, first.quantity) == (i, "experts")
    assert first.error == pytest.approx(1 / T_PROMPT)
    assert f"1/{T_PROMPT} tokens differ" in first.note and "reference margin" in first.note


def test_layer_count_mismatch_names_both_counts():
    ours, ref = _small_case()["ours"], _small_case()["ref"]
    short = dataclasses.replace(ours, layers=ours.layers[:-1])
    with pytest.raises(ValueError, match=rf"ling-jax has {len(ref.layers) - 1} layers and the reference "
                                         rf"{len(ref.layers)}: compare a checkpoint with the model built from it"):
        crosscheck.compare(short, ref)


def test_kind_mismatch_is_the_first_failure():
    ours, ref = _small_case()["ours"], _small_case()["ref"]
    swapped = _with_layer(ours, 0, kind="mla+dense")
    first = crosscheck.compare(swapped, ref).first_failure
    assert (first.layer, first.quantity) == (0, "kind") and first.note == f"reference layer is {ref.layers[0]['kind']}"


def _with_layer(capture, i: int, **values):
    layers = list(capture.layers)
    layers[i] = dict(layers[i], **values)
    return dataclasses.replace(capture, layers=tuple(layers))


def test_import_needs_neither_torch_nor_transformers():
    code = "import sys, ling_jax.crosscheck; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
