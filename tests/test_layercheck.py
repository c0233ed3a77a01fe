"""`ling-jax layercheck` (ling_jax/layercheck.py, ling_jax/layercheck_cli.py): the verify forward against sequential
decode, and a backend against the reference, layer by layer.

On the toy preset in float32 every layer's hidden state agrees within 1e-5 and every expert set agrees, with float
or block-FP8 weights; an error planted in one layer's verify computation is named at that layer while the layers
before it pass; a router that routes the same input differently is told from the near-ties it causes downstream;
the command runs end to end and prints JSON; bad options are refused in one line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import cli, layercheck, model
from ling_jax.config import MOE, preset
from ling_jax.params import init_params

from tests.cli_run import assert_refused, run_ling_jax

PROMPT = [7, 41, 3, 99, 12, 250, 18, 5, 77, 301, 64, 9]
VERIFY = [5, 17, 300, 42, 8, 9]  # the last committed token, then k = 5 drafts
PLANTED = 3  # a KDA+MoE layer in the middle of the toy's six


def _toy(quantization=None):
    cfg = preset("toy").replace(quantization=quantization)
    return cfg, init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)


@pytest.fixture(scope="module")
def toy():
    return _toy()


@pytest.mark.parametrize("quantization, mode, backend", [(None, "verify-vs-decode", "reference"),
                                                         ("fp8", "verify-vs-decode", "reference"),
                                                         (None, "backends", "pallas")],
                         ids=["verify-vs-decode", "verify-vs-decode-fp8-weights", "pallas-vs-reference"])
def test_every_layer_agrees_within_float32_bound(quantization, mode, backend):
    """Every layer's hidden state within 1e-5 and every MoE layer's expert sets equal at every position, the logits
    too; the two sides are different programs (some error is not zero)."""
    cfg, params = _toy(quantization)
    report = layercheck.check(params, cfg, PROMPT, VERIFY, mode=mode, backend=backend)
    assert report.bound == layercheck.F32_BOUND == 1e-5 and report.weights == (quantization or "float32")
    assert [r.layer for r in report.rows] == list(range(cfg.num_layers))
    for row in report.rows:
        assert row.error <= 1e-5 and row.ok, row
        moe = cfg.ffn_kind(row.layer) == MOE
        assert row.experts_equal == (True,) * len(VERIFY) if moe else row.experts_equal is None, row
    assert any(r.error > 0 for r in report.rows)
    assert report.logits_error <= 1e-5 and all(report.argmax_equal) and report.ok and report.first_failure is None


def test_an_error_planted_in_one_layers_verify_is_named_at_that_layer(toy, monkeypatch):
    """A 1e-4 relative error added to one layer's output in the verify forward only (its k + 1 positions at once;
    decode never sees it): that layer is the first over the bound, the layers before it pass."""
    cfg, params = toy
    run_block = model.block

    def block(p, h, entry, start, cfg, layer, *, mode, **kw):
        out, entry = run_block(p, h, entry, start, cfg, layer, mode=mode, **kw)
        return (out * (1 + 1e-4) if layer == PLANTED and mode == "verify" else out), entry

    monkeypatch.setattr(model, "block", block)
    report = layercheck.check(params, cfg, PROMPT, VERIFY)
    assert not report.ok and report.first_failure.startswith(f"layer {PLANTED} (kda+moe) hidden")
    assert all(r.ok for r in report.rows[:PLANTED]) and not report.rows[PLANTED].ok
    assert 5e-5 < report.rows[PLANTED].error < 2e-4
    assert "first over the bound: layer 3" in report.format()


def test_a_router_that_routes_the_same_input_differently_is_not_a_near_tie(toy, monkeypatch):
    """One layer's verify routes with expert 0's bias raised: its flips are wider than the two sides' scores can
    close (the routing itself differs), while the next layer's flips are near-ties its changed input explains."""
    cfg, params = toy
    run_moe = model.moe_block

    def moe_block(p, h, norm, cfg, layer, **kw):
        # The verify's width only: the prompt's prefill is a module-level jit whose cached program outlives the patch.
        if layer == PLANTED and h.shape[1] == len(VERIFY):
            p = dict(p, expert_bias=p["expert_bias"].at[0].add(1.0))
        return run_moe(p, h, norm, cfg, layer, **kw)

    monkeypatch.setattr(model, "moe_block", moe_block)
    report = layercheck.check(params, cfg, PROMPT, VERIFY)
    row = report.rows[PLANTED]
    assert all(r.ok for r in report.rows[:PLANTED]) and row.failures == ["hidden", "experts"]
    assert row.flips and not any(f.explained for f in row.flips)
    assert all(f.score_difference < 1e-5 for f in row.flips)  # the router's input agrees: the routing is the bug
    after = report.rows[PLANTED + 1].flips
    assert after and all(f.explained for f in after)


def test_a_moe_layer_whose_route_the_taps_missed_is_refused():
    """The MoE layers come from the config: one whose route the taps did not catch stops the check, its expert
    comparison is not silently dropped."""
    cfg = preset("toy")
    taps = {i: {"hidden": np.zeros((1, 2, cfg.hidden_size), np.float32)} for i in range(cfg.num_layers)}
    moe = [i for i in range(cfg.num_layers) if cfg.ffn_kind(i) == MOE]
    with pytest.raises(RuntimeError, match=rf"MoE layers \[{', '.join(map(str, moe))}\] routed without"):
        layercheck._capture(taps, np.zeros((1, 2, cfg.vocab_size), np.float32), cfg)


def test_json_writes_non_finite_values_as_null():
    from ling_jax.layercheck_cli import _finite

    row = dict(hidden=float("inf"), flips=[dict(gap=float("inf"), score_difference=float("nan"))], bound=1e-5)
    assert json.loads(json.dumps(_finite(row), allow_nan=False)) == dict(
        hidden=None, flips=[dict(gap=None, score_difference=None)], bound=1e-5)


def test_boundary_gap_is_the_smaller_of_the_group_and_expert_gaps():
    """Two groups of four, one kept, two experts chosen: the gap is the kept group's lead over the other (its top-2
    sum) or the second expert's lead over the third, whichever is smaller."""
    cfg = preset("toy").replace(num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)
    choice = np.array([[0.9, 0.8, 0.1, 0.0, 0.85, 0.8, 0.7, 0.0],    # groups 1.7 vs 1.65; experts 0.8 vs 0.1
                       [0.9, 0.8, 0.75, 0.0, 0.5, 0.4, 0.3, 0.0]])  # groups 1.7 vs 0.9; experts 0.8 vs 0.75
    np.testing.assert_allclose(layercheck.boundary_gap(choice, cfg), [0.05, 0.05])
    choice[0, 4:] = [0.2, 0.1, 0.0, 0.0]
    np.testing.assert_allclose(layercheck.boundary_gap(choice, cfg), [0.7, 0.05])


def test_backends_on_the_decode_path_runs_end_to_end(capsys):
    """`--compare backends --path decode`: decode steps on the fast backend against decode steps on the reference,
    every layer within 1e-5."""
    code = cli.main(["layercheck", "--preset", "toy", "--random-weights", "--compare", "backends", "--path", "decode",
                     "--prompt-len", "12", "--num-draft", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mode"] == "backends" and report["positions"] == 3 and report["ok"]
    assert (report["side"], report["baseline"]) == ("3 decode steps on backend fast",
                                                    "3 decode steps on backend reference")
    assert all(r["ok"] and r["hidden"] <= 1e-5 for r in report["rows"])


def test_bfloat16_reports_without_a_bound(capsys):
    """bfloat16 activations, the default comparison end to end with --json: the errors are reported, no bound
    applies and the command exits 0 whatever they are."""
    code = cli.main(["layercheck", "--preset", "toy", "--random-weights", "--dtype", "bfloat16", "--prompt-len", "20",
                     "--num-draft", "2", "--json"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == 0 and report["bound"] is None and report["activations"] == "bfloat16" and report["ok"]
    assert report["mode"] == "verify-vs-decode" and report["positions"] == 3 and "random weights" in out.err
    assert [r["layer"] for r in report["rows"]] == list(range(preset("toy").num_layers))
    assert all(r["bound"] is None and r["hidden"] < 0.5 for r in report["rows"])


@pytest.mark.parametrize("args, fragments", [
    (["--preset", "toy"], ["--random-weights"]),
    (["--preset", "toy", "--random-weights", "--activations", "float32"], ["--activations goes with --dtype fp8"]),
    (["--preset", "toy", "--random-weights", "--path", "decode"], ["--compare backends"]),
    (["--preset", "toy", "--random-weights", "--path", "verify"], ["drop --path"]),
    (["--checkpoint", "/nonexistent", "--random-weights"], ["--random-weights", "go with --preset"]),
    (["--preset", "toy", "--random-weights", "--seed", "-1"], ["--seed -1", ">= 0"]),
    (["--preset", "toy", "--random-weights", "--tolerance", "0"], ["--tolerance 0.0", "> 0"]),
    (["--preset", "toy", "--random-weights", "--prompt-len", "0"], ["--prompt-len 0", ">= 1"]),
    (["--preset", "toy", "--random-weights", "--compare", "backends", "--backend", "reference"],
     ["--backend fast"]),
    (["--preset", "toy", "--random-weights", "--num-draft", "17"], ["--num-draft 17", "1..16"]),
    (["--preset", "toy", "--random-weights", "--verify-ids", "1,2,3", "--num-draft", "3"], ["drop --num-draft"]),
    (["--preset", "toy", "--random-weights", "--verify-ids", "1,9999"], ["--verify-ids", "[0, 512)"]),
])
def test_bad_options_are_one_clear_line(args, fragments):
    assert_refused(run_ling_jax("layercheck", *args), *fragments)


def test_help_shows_every_default():
    from tests.test_cli import _option_entries

    result = run_ling_jax("layercheck", "--help")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    entries = _option_entries(result.stdout)
    assert len(entries) >= 15
    for header, text in entries:
        is_flag = header in ("-h, --help", "--random-weights", "--json")
        assert is_flag or "(default:" in text, f"{header}: no default in {text!r}"
