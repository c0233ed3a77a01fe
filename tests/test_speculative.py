"""Speculative decoding: lossless greedy for every drafter and k, exact accept lengths with the oracle, drafter
states that equal a fresh recompute, and a spec step with no host synchronisation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.cache import cache_len, mla_cache
from ling_jax.config import preset
from ling_jax.engine import speculative as S
from ling_jax.engine.drafters import MTPDrafter, ModelDrafter, OracleDrafter, Suffix
from ling_jax.engine.generate import generate
from ling_jax.engine.sampling import Greedy, TopP
from ling_jax.model import mtp_forward, prefill
from ling_jax.params import init_params

from tests.numerics import rel_err

N_NEW = 128
KS = (1, 3, 5, 8)
PROMPT = [[5, 9, 11, 3, 200, 17, 8, 99, 4, 61, 7]]
TOL_F32 = 1e-5  # verify (k + 1 positions at once) vs decode: the same math in another summation order


@pytest.fixture(scope="module")
def toy():
    cfg = preset("toy")
    return cfg, init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=True)


@pytest.fixture(scope="module")
def draft_model(toy):
    """A smaller random Ling model with the toy's vocabulary: 3 layers (KDA, KDA, MLA), half the width."""
    cfg = preset("toy").replace(num_layers=3, hidden_size=64, num_mtp_layers=0, expert_swiglu_limits=(),
                                shared_swiglu_limits=())
    return cfg, init_params(cfg, jax.random.key(7), jnp.float32, with_mtp=False)


@pytest.fixture(scope="module")
def plain(toy):
    cfg, params = toy
    return generate(params, cfg, PROMPT, max_new_tokens=N_NEW + 16, sampler=Greedy(), ignore_eos=True).tokens[0]


def _oracle_aux(tokens, corrupt_at=()):
    cont = jnp.asarray([tokens], jnp.int32)
    corrupt = jnp.zeros(cont.shape, bool)
    for c in corrupt_at:
        corrupt = corrupt.at[0, c].set(True)
    return cont, corrupt


def _drafter(name, toy, draft_model, plain):
    if name == "oracle":
        return OracleDrafter(), _oracle_aux(plain, corrupt_at=(6, 7, 30, 31, 32, 60, 90))
    if name == "mtp":
        return MTPDrafter(), None
    if name == "model":
        return ModelDrafter(draft_model[0]), draft_model[1]
    if name == "suffix":
        return Suffix(), None
    raise ValueError(name)


def _spec(toy, drafter, aux, k, n=N_NEW, **kw):
    cfg, params = toy
    kw = dict(sampler=Greedy(), ignore_eos=True, block_size=8) | kw
    return S.generate_speculative(params, cfg, PROMPT, max_new_tokens=n, drafter=drafter, k=k, aux=aux, **kw)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", ["oracle", "mtp", "model", "suffix"])
def test_greedy_is_lossless(name, k, toy, draft_model, plain):
    drafter, aux = _drafter(name, toy, draft_model, plain)
    out = _spec(toy, drafter, aux, k)
    assert out.tokens[0] == plain[:N_NEW]
    assert out.verify_steps >= -(-(N_NEW - 1) // (k + 1)) and 1 <= out.accept_length <= k + 1
    if name != "suffix":  # the suffix drafter proposes only what its matches support
        assert out.drafted == out.verify_steps * k


@pytest.mark.parametrize("k", KS)
def test_oracle_with_the_true_continuation_accepts_every_draft(k, toy, plain):
    out = _spec(toy, OracleDrafter(), _oracle_aux(plain), k)
    assert out.tokens[0] == plain[:N_NEW]
    assert out.accept_length == k + 1 and out.verify_steps == -(-(N_NEW - 1) // (k + 1))


def _expected_accepts(k, corrupt, n_new, m=1):
    """Per step: the drafts at output positions m..m+k-1 are accepted up to the first corrupted one."""
    steps = []
    while m < n_new:
        bad = [c - m for c in sorted(corrupt) if m <= c < m + k]
        n = bad[0] if bad else k
        steps.append(n)
        m += n + 1
    return steps


@pytest.mark.parametrize("k, corrupt", [(3, (6, 7, 30)), (5, (1, 2, 3, 40, 41, 77)), (8, (9, 10, 64, 100))])
def test_oracle_corruptions_give_the_exact_accept_lengths(k, corrupt, toy, plain):
    out = _spec(toy, OracleDrafter(), _oracle_aux(plain, corrupt), k)
    want = _expected_accepts(k, corrupt, N_NEW)
    assert out.tokens[0] == plain[:N_NEW]
    assert (out.verify_steps, out.accepted) == (len(want), sum(want))


def test_eos_inside_an_accepted_run_stops_like_plain_greedy(toy, plain):
    """The EOS is an accepted draft with drafts after it in the same step: those must not be emitted."""
    cfg, params = toy
    k = 5
    # Output position i is emitted by the step starting at 1 + j (k + 1), as draft (i - 1) % (k + 1).
    first = next(i for i in range(15, N_NEW) if plain.index(plain[i]) == i and 0 < (i - 1) % (k + 1) < k - 1)
    cfg = cfg.replace(eos_token_ids=(plain[first],))
    want = generate(params, cfg, PROMPT, max_new_tokens=N_NEW, sampler=Greedy()).tokens[0]
    assert want == plain[:first + 1]
    out = S.generate_speculative(params, cfg, PROMPT, max_new_tokens=N_NEW, sampler=Greedy(),
                                 drafter=OracleDrafter(), k=k, aux=_oracle_aux(plain), block_size=4)
    assert out.tokens[0] == want


def test_pallas_backend_is_lossless_too(toy, plain):
    out = _spec(toy, OracleDrafter(), _oracle_aux(plain, corrupt_at=(5, 13)), 3, n=24, backend="pallas")
    assert out.tokens[0] == plain[:24]


def test_greedy_head_verify_equals_the_logits_verify_ties_included(toy):
    """The spec step verifies greedy drafts through the fused greedy head (`forward(head="greedy")`, no logits
    written). With the lm_head's odd columns copies of the even ones every argmax ties: the verify's tokens are the
    lowest (even) ids, and its accepted counts and tokens equal those of `acceptance.accept` on the logits of the
    same forward, for drafts that take the tied odd ids too. On Pallas, where the greedy head is the fused lm_head +
    argmax kernel (the reference's is jnp.argmax of the logits)."""
    from ling_jax.engine import acceptance
    from ling_jax.model import forward

    cfg, params = toy
    lm = params["lm_head"]
    params = dict(params, lm_head=lm.at[:, 1::2].set(lm[:, 0::2]))
    logits0, state, _ = prefill(params, jnp.asarray(PROMPT, jnp.int32), cfg, max_len=64, backend="pallas")
    kw = dict(mode="verify", backend="pallas")
    both = jax.jit(lambda fed: (forward(params, fed, state.layers, state.length, cfg, **kw)[0],
                                forward(params, fed, state.layers, state.length, cfg, **kw, head="greedy")[0]))
    first = int(jnp.argmax(logits0[0, -1]))
    _, greedy = both(jnp.asarray([[first, 7, 8, 9]], jnp.int32))
    assert first % 2 == 0 and (np.asarray(greedy) % 2 == 0).all()
    rng = np.random.default_rng(3)
    for trial in range(4):  # drafts: the verify's own tokens, some moved to the tied odd id, some wrong
        drafts = np.asarray(greedy[0, :3]) + (rng.random(3) < 0.4) * rng.integers(1, 3, 3)
        fed = jnp.asarray([[first, *drafts]], jnp.int32)
        logits, target = both(fed)
        valid = jnp.ones((1, 3), bool)
        want = acceptance.accept(Greedy(), logits, fed[:, 1:], valid, None, None)
        got = acceptance.accept_greedy(target, fed[:, 1:], valid)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], trial


def test_spec_step_verifies_greedy_through_the_greedy_head(toy, plain, monkeypatch):
    """A greedy spec step runs the verify forward with head="greedy" and accepts from its tokens
    (`acceptance.accept_greedy`), never through the logits path (`acceptance.accept`). A k and block size no other
    test uses, so the step is traced here, with the patched functions."""
    from ling_jax.engine import acceptance

    heads = []
    real_forward = S.forward

    def forward(*a, **kw):
        heads.append(kw.get("head", "logits"))
        return real_forward(*a, **kw)

    def no_logits_accept(*a, **kw):
        raise AssertionError("the greedy verify went through acceptance.accept (the logits)")

    monkeypatch.setattr(S, "forward", forward)
    monkeypatch.setattr(acceptance, "accept", no_logits_accept)
    out = _spec(toy, OracleDrafter(), _oracle_aux(plain), 2, n=10, block_size=3)
    assert out.tokens[0] == plain[:10] and heads == ["greedy"]


def test_profiled_verify_block_chains_the_spec_steps_verify_forward(toy):
    """`bench --spec --profile` times the verify forward alone (`spec_profile.verify_block`): the forward over k + 1
    positions as spec_step calls it (greedy head), each step fed the previous step's greedy tokens at the same
    position, over the MLA caches the previous step wrote and the KDA caches left uncommitted."""
    from ling_jax.cache import KDACache, MLACache
    from ling_jax.model import forward
    from ling_jax.spec_profile import verify_block

    cfg, params = toy
    _, state, _ = prefill(params, jnp.asarray(PROMPT, jnp.int32), cfg, max_len=64, backend="reference")
    fed = jnp.asarray([[5, 9, 11, 3]], jnp.int32)
    verify = jax.jit(lambda tokens, layers: forward(params, tokens, layers, state.length, cfg, mode="verify",
                                                    backend="reference", head="greedy"))
    first, _, staged = verify(fed, state.layers)
    second_in = tuple(c if isinstance(c, KDACache) else s for c, s in zip(state.layers, staged))
    want, hidden, staged = verify(first, second_in)
    assert not np.array_equal(first, want), "the second step's tokens should show that it was fed the first's"
    got, layers, (got_hidden, kda) = verify_block(params, fed, jax.tree.map(jnp.copy, state.layers), state.length,
                                                  cfg=cfg, steps=2, backend="reference")
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got_hidden, hidden, rtol=1e-5, atol=1e-6)
    assert [type(e) for e in layers] == [type(e) for e in state.layers]
    mla = [(g.kv, s.kv) for g, s in zip(layers, staged) if isinstance(s, MLACache)]
    assert mla and all(np.allclose(g, s, rtol=1e-5, atol=1e-6) for g, s in mla)
    kda_want = [s for s in staged if not isinstance(s, MLACache)]
    assert len(kda) == len(kda_want) and all(np.allclose(g.states, s.states, rtol=1e-5, atol=1e-6)
                                             for g, s in zip(kda, kda_want))


@pytest.mark.parametrize("accepted, past", [(0, 0), (2, 1)], ids=["within-the-output", "past-its-end"])
def test_profiled_spec_step_traces_the_spec_block_then_the_verify_forward(toy, accepted, past, monkeypatch, capsys):
    """`spec_profile.profile_spec_step` on the CPU, the profiler's events synthetic: it traces the spec block, then
    the verify forward alone, each measured per step of the block; a traced block whose steps run past the output's
    end (k = 2, two blocks of 2 steps, 10 tokens: the fourth step, all drafts kept, has none left) is warned of."""
    from ling_jax import profiling
    from ling_jax.engine.drafters import PlannedDrafter
    from ling_jax.spec_profile import profile_spec_step

    cfg, params = toy
    spec_events = [("gemv_rows_fwd_kernel", 0.0, 4.0), ("loop_select_fusion_2", 4.0, 1.0),
                   ("gemv_rows_fwd_kernel", 6.0, 4.0), ("loop_select_fusion_2", 10.0, 1.0)]
    verify_events = [("gemv_rows_fwd_kernel", 0.0, 4.0), ("gemv_rows_fwd_kernel", 5.0, 4.0)]
    traced = []

    def trace_events(run, n, *, device=None, pause_s=0.0):
        for _ in range(n):
            jax.block_until_ready(run())  # the real calls, so the donated state flows as on a GPU
        traced.append(device)
        return spec_events if len(traced) == 1 else verify_events

    monkeypatch.setattr(profiling, "trace_events", trace_events)
    aux = (jnp.asarray(PROMPT, jnp.int32), jnp.full((8,), accepted, jnp.int32))
    prof = profile_spec_step(params, cfg, "reference", PROMPT, 2, drafter=PlannedDrafter(), aux=aux, k=2, max_new=10,
                             pad_id=0, prefill_chunk=64)
    assert set(prof) == {"backend", "k", "span_us_per_step", "busy_us_per_step", "kernels_per_step", "families",
                         "verify"} and (prof["backend"], prof["k"], traced) == ("reference", 2, [None, None])
    assert prof["span_us_per_step"] == 5.5 and prof["kernels_per_step"] == 2
    assert prof["verify"] == profiling.step_families(verify_events, 2) and prof["verify"]["busy_us_per_step"] == 4.0
    err = capsys.readouterr().err
    assert (f"{past} of the profiled spec block's 2 steps ran past the output's end (10 tokens)" in err) == bool(past)


def _planned_steps(plan, k, n_new):
    """(verify steps, accepted drafts) a run of `n_new` tokens takes when step j keeps plan[j] drafts (the last one
    repeated)."""
    steps = accepted = 0
    emitted = 1
    while emitted < n_new:
        n = min(plan[min(steps, len(plan) - 1)], k)
        steps, accepted, emitted = steps + 1, accepted + n, emitted + n + 1
    return steps, accepted


@pytest.mark.parametrize("k, plan", [(3, [3, 0, 2, 1, 3, 3, 0]), (1, [0, 1, 1])])
def test_planned_acceptance_holds_the_plan_and_commits_greedy_given_matching_drafts(k, plan, toy, plain):
    """The planned timing mode: with the true continuation as drafts, every step keeps exactly its planned count
    and the output is plain greedy's (the bonus token is the verify's own); the device's counts are the plan's."""
    from ling_jax.engine.drafters import PlannedDrafter

    aux = (jnp.asarray([plain], jnp.int32), jnp.asarray(plan, jnp.int32))
    out = _spec(toy, PlannedDrafter(), aux, k)
    assert out.planned and out.tokens[0] == plain[:N_NEW]
    assert (out.verify_steps, out.accepted) == _planned_steps(plan, k, N_NEW)
    assert out.agreement == 1.0  # every draft is the verify's argmax


def test_planned_acceptance_holds_the_plan_whatever_the_verify_says(toy, plain):
    """Drafts the verify rejects (a shifted continuation) are still committed as planned: the counts are the plan's,
    the natural agreement is low, and the output is no longer greedy's (a timing mode, not lossless)."""
    from ling_jax.engine.drafters import PlannedDrafter

    plan = [2, 3, 1]
    wrong = [(t + 1) % 64 + 100 for t in plain]
    out = _spec(toy, PlannedDrafter(), (jnp.asarray([wrong], jnp.int32), jnp.asarray(plan, jnp.int32)), 3)
    assert (out.verify_steps, out.accepted) == _planned_steps(plan, 3, N_NEW)
    assert out.agreement < 0.2 and out.tokens[0] != plain[:N_NEW]
    assert out.accept_length == (out.accepted + out.verify_steps) / out.verify_steps


def test_planned_drafter_refusals(toy, plain):
    from ling_jax.engine.drafters import PlannedDrafter

    cont = jnp.asarray([plain], jnp.int32)
    with pytest.raises(ValueError, match=r"pass aux=\(continuation \[B, M\] int32, plan \[S\] int32"):
        _spec(toy, PlannedDrafter(), (cont, jnp.zeros((0,), jnp.int32)), 3, n=8)
    with pytest.raises(ValueError, match=r"the plan holds -1 accepted drafts at a step; each count must lie in 0..k"):
        _spec(toy, PlannedDrafter(), (cont, jnp.asarray([2, -1], jnp.int32)), 3, n=8)
    with pytest.raises(ValueError, match=r"PlannedDrafter plans greedy accept counts \(a timing mode\); sample with "
                                         r"Greedy\(\)"):
        _spec(toy, PlannedDrafter(), (cont, jnp.ones((2,), jnp.int32)), 3, n=8, sampler=TopP(1.0, 0.9))


def _committed(plain, n):
    return np.asarray([PROMPT[0] + plain[:n]], np.int32)


def test_mtp_state_equals_a_fresh_recompute(toy, plain):
    """After some steps the NextN layer's next-draft logits are those of the layer run once over every committed
    pair with the target's own hidden states (the extend after each verify keeps its cache exact)."""
    cfg, params = toy
    state = _run_steps(toy, MTPDrafter(), None, k=3, steps=5)
    n = int(state.emitted)
    seq = _committed(plain, n)  # prompt + every committed token; the last is `state.last`, not yet fed
    assert int(state.last[0]) == plain[n - 1]
    _, _, hidden = prefill(params, jnp.asarray(seq[:, :-1]), cfg, max_len=seq.shape[1], all_logits=True)
    cache = mla_cache(cfg, 1, seq.shape[1], jnp.float32)
    want, _, _ = mtp_forward(params, hidden, jnp.asarray(seq[:, 1:]), cache, jnp.int32(0), cfg, mode="prefill")
    assert rel_err(state.drafter.logits, want[:, -1]) < TOL_F32


def test_model_drafter_state_equals_a_fresh_prefill(toy, draft_model, plain):
    dcfg, dparams = draft_model
    state = _run_steps(toy, ModelDrafter(dcfg), dparams, k=4, steps=4)
    n = int(state.emitted)
    seq = _committed(plain, n)
    _, fresh, _ = prefill(dparams, jnp.asarray(seq[:, :-1]), dcfg, max_len=cache_len(seq.shape[1] + 16))
    assert int(state.drafter.length) == int(fresh.length) == seq.shape[1] - 1
    length = int(fresh.length)
    for got, want in zip(state.drafter.layers, fresh.layers):
        if hasattr(got, "state"):
            assert rel_err(got.state, want.state) < TOL_F32 and rel_err(got.conv_window, want.conv_window) < TOL_F32
        else:
            assert rel_err(got.kv[:, :length], want.kv[:, :length]) < TOL_F32


def _run_steps(toy, drafter, aux, *, k, steps):
    cfg, params = toy
    eos = jnp.asarray([], jnp.int32)
    state, _ = S.spec_start(params, aux, jnp.asarray(PROMPT), jax.random.key(0), eos, cfg, Greedy(), drafter,
                            max_len=cache_len(len(PROMPT[0]) + 64), backend="reference", pad_id=0)
    state, _, _, _ = S.spec_block(params, aux, state, eos, cfg, Greedy(), drafter, k=k, steps=steps,
                                  backend="reference", pad_id=0, max_new=1000)
    return state


@pytest.mark.parametrize("drafter_name", ["mtp", "suffix"])
def test_spec_block_has_no_host_synchronising_control_flow(drafter_name, toy, draft_model, plain):
    cfg, params = toy
    drafter, aux = _drafter(drafter_name, toy, draft_model, plain)
    eos = jnp.asarray(cfg.eos_token_ids, jnp.int32)
    state, _ = S.spec_start(params, aux, jnp.asarray(PROMPT), jax.random.key(0), eos, cfg, TopP(0.8, 0.9), drafter,
                            max_len=256, backend="reference", pad_id=0)
    hlo = S.spec_block.lower(params, aux, state, eos, cfg, TopP(0.8, 0.9), drafter, k=3, steps=2,
                             backend="reference", pad_id=0, max_new=64).compile().as_text()
    assert "conditional(" not in hlo
    whiles = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
    assert whiles and all("known_trip_count" in line for line in whiles), [w[:160] for w in whiles]


def test_sampled_speculation_is_seeded_and_stays_in_the_top_p_set(toy):
    cfg, params = toy
    kw = dict(sampler=TopP(0.7, 0.8), ignore_eos=True, block_size=4)
    a = _spec(toy, MTPDrafter(), None, 3, n=24, seed=5, **kw)
    b = _spec(toy, MTPDrafter(), None, 3, n=24, seed=5, **kw)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 24


def _without_mtp(params):
    return {name: value for name, value in params.items() if name != "mtp"}


@pytest.mark.parametrize("call, message", [
    (lambda toy, dm: _spec(toy, OracleDrafter(), _oracle_aux([1, 2]), 0), "1 <= k <= 16"),
    (lambda toy, dm: _spec(toy, OracleDrafter(), _oracle_aux([1, 2]), 17), "1 <= k <= 16"),
    (lambda toy, dm: _spec(toy, OracleDrafter(), None, 2), "continuation"),
    (lambda toy, dm: S.generate_speculative(_without_mtp(toy[1]), toy[0], PROMPT, max_new_tokens=4,
                                            sampler=Greedy(), drafter=MTPDrafter(), k=2), "NextN layer"),
    (lambda toy, dm: _spec(toy, ModelDrafter(dm[0].replace(vocab_size=1024)), dm[1], 2), "vocab_size=1024"),
])
def test_bad_combinations_are_named(call, message, toy, draft_model):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(toy, draft_model)


@pytest.fixture(scope="module")
def transformers_ckpt(tmp_path_factory):
    """A transformers-written float32 checkpoint with an MTP layer, its greedy continuation from transformers'
    `generate(do_sample=False)`, and a random draft model sharing its vocabulary."""
    import torch

    from conversion.load import load_hf
    from tests.hf_ref import save_with_mtp

    case = save_with_mtp(tmp_path_factory.mktemp("hf_mtp"))
    cfg, params = load_hf(case["dir"], dtype=jnp.float32, progress=False)
    assert "mtp" in params
    prompt = np.random.default_rng(4).integers(2, cfg.vocab_size, size=(1, 23))
    main_model = case["m32"]
    main_model.config.num_hidden_layers = cfg.num_layers  # transformers' model holds the NextN block as a layer
    main_model.model.layers = main_model.model.layers[:cfg.num_layers]
    with torch.no_grad():
        out = main_model.generate(torch.as_tensor(prompt), max_new_tokens=N_NEW, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    want = out[0, prompt.shape[1]:].tolist()
    draft_cfg = cfg.first_layers(2)
    draft = init_params(draft_cfg, jax.random.key(3), jnp.float32, with_mtp=False)
    return dict(cfg=cfg, params=params, prompt=prompt, want=want, draft=(draft_cfg, draft))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", ["oracle", "mtp", "model", "suffix"])
def test_greedy_is_lossless_on_a_transformers_checkpoint(name, k, transformers_ckpt):
    c = transformers_ckpt
    plain_tokens = generate(c["params"], c["cfg"], c["prompt"], max_new_tokens=N_NEW, sampler=Greedy(),
                            ignore_eos=True).tokens[0]
    assert plain_tokens == c["want"]  # ling-jax's plain greedy is transformers' greedy here
    drafter, aux = {"oracle": (OracleDrafter(), _oracle_aux(c["want"], corrupt_at=(3, 17, 18, 50))),
                    "mtp": (MTPDrafter(), None), "model": (ModelDrafter(c["draft"][0]), c["draft"][1]),
                    "suffix": (Suffix(), None)}[name]
    out = S.generate_speculative(c["params"], c["cfg"], c["prompt"], max_new_tokens=N_NEW, sampler=Greedy(),
                                 drafter=drafter, k=k, aux=aux, ignore_eos=True, block_size=8)
    assert out.tokens[0] == c["want"]
