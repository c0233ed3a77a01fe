"""Speculative acceptance: greedy equals plain greedy, rejection sampling keeps the sampler's distribution."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ling_jax.engine import acceptance
from ling_jax.engine.acceptance import accept, accept_greedy, sample_drafts
from ling_jax.engine.sampling import Greedy, TopP

P_REJECT = 1e-3  # chi-square tests reject "same distribution" below this p-value
V, K = 10, 3
SAMPLER = TopP(temperature=0.7, top_p=0.8)


def chi_square_pvalue(counts, probs):
    """Pearson chi-square of counts against probs, cells with expected count < 5 pooled; dof = cells - 1.

    A count in a zero-probability cell (a token outside the top-p set) fails at once: no statistic excuses it.
    """
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"tokens outside the support: {np.flatnonzero((probs == 0) & (counts > 0))}"
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    return stats.chi2.sf(statistic, len(observed) - 1)


def _logits(seed, *shape, scale=1.5):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


# Samplers: `sample` draws from `log_probs`, for any leading shape.

def test_topp_log_probs_restrict_to_the_top_p_set():
    logits = _logits(0, 2, 3, V)
    probs = np.asarray(jnp.exp(SAMPLER.log_probs(logits)))
    full = np.asarray(jax.nn.softmax(logits / SAMPLER.temperature, axis=-1))
    for row, row_full in zip(probs.reshape(-1, V), full.reshape(-1, V)):
        order = np.argsort(-row_full)
        mass_before = np.cumsum(row_full[order]) - row_full[order]
        top_set = set(order[mass_before < SAMPLER.top_p].tolist())
        assert set(np.flatnonzero(row).tolist()) == top_set and len(top_set) < V
        np.testing.assert_allclose(row[list(top_set)], row_full[list(top_set)] / row_full[list(top_set)].sum(),
                                   rtol=1e-5)
    np.testing.assert_allclose(probs.reshape(-1, V), np.exp(SAMPLER.log_probs(logits.reshape(-1, V))), rtol=1e-6)


def test_topp_sample_frequencies_match_log_probs():
    logits = _logits(1, 2, 3, V)
    draws = jax.jit(jax.vmap(lambda key: SAMPLER.sample(logits, key)))(jax.random.split(jax.random.key(2), 20000))
    assert draws.shape == (20000, 2, 3) and draws.dtype == jnp.int32
    probs = np.asarray(jnp.exp(SAMPLER.log_probs(logits)))
    for b in range(2):
        for t in range(3):
            counts = np.bincount(np.asarray(draws[:, b, t]), minlength=V)
            assert chi_square_pvalue(counts, probs[b, t]) > P_REJECT


def test_greedy_log_probs_are_one_hot_at_the_lowest_tied_argmax():
    logits = jnp.asarray([[[0.0, 3.0, 3.0, 1.0], [2.0, -1.0, 2.0, 2.0]]])
    log_probs = Greedy().log_probs(logits)
    assert np.asarray(jnp.exp(log_probs)).tolist() == [[[0, 1, 0, 0], [1, 0, 0, 0]]]
    assert Greedy().sample(logits, None).tolist() == [[1, 0]]


# Greedy acceptance.

def _greedy_case(drafts, valid=None):
    """Target argmax per position: 4, 7, 1, 5 (one target row over k + 1 = 4 positions)."""
    logits = jax.nn.one_hot(jnp.asarray([[4, 7, 1, 5]]), 8) * 3.0 + _logits(3, 1, 4, 8, scale=0.1)
    drafts = jnp.asarray([drafts], jnp.int32)
    valid = jnp.ones(drafts.shape, bool) if valid is None else jnp.asarray([valid])
    n, token = accept(Greedy(), logits, drafts, valid, None, None)
    return int(n[0]), int(token[0])


@pytest.mark.parametrize("drafts, valid, expected", [
    ([4, 7, 1], None, (3, 5)),  # all accepted: the bonus token
    ([4, 2, 1], None, (1, 7)),  # rejected at 1: the target's token there
    ([3, 7, 1], None, (0, 4)),  # rejected at 0
    ([4, 7, 1], [True, False, True], (1, 7)),  # nothing proposed at 1: stop there even though a later draft matches
    ([4, 7, 99], [True, True, False], (2, 1)),  # an unproposed slot may hold an out-of-range id
])
def test_greedy_accepts_the_matching_prefix(drafts, valid, expected):
    assert _greedy_case(drafts, valid) == expected


def test_greedy_ties_go_to_the_lowest_id():
    logits = jnp.asarray([[[0.0, 2.0, 2.0], [1.0, 1.0, 0.0]]])
    n, token = accept(Greedy(), logits, jnp.asarray([[2]]), jnp.asarray([[True]]), None, None)
    assert (int(n[0]), int(token[0])) == (0, 1)
    n, token = accept(Greedy(), logits, jnp.asarray([[1]]), jnp.asarray([[True]]), None, None)
    assert (int(n[0]), int(token[0])) == (1, 0)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_from_the_targets_tokens_equals_greedy_from_its_logits(seed):
    """`accept_greedy` (the verify's fused greedy head: the target's tokens, no logits) against `accept` with the
    logits those tokens are the argmax of, lowest id on ties: logits quantised to a few levels so most positions
    tie, drafts drawn from the tied sets, valid masks and a batch of 3 (the shared count)."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.integers(0, 3, (3, K + 1, 6)), jnp.float32)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # the lowest id among the tied maxima
    tied = np.asarray(logits == logits.max(axis=-1, keepdims=True))
    drafts = jnp.asarray([[rng.choice(np.flatnonzero(tied[b, i])) for i in range(K)] for b in range(3)], jnp.int32)
    valid = jnp.asarray(rng.random((3, K)) < 0.9)
    want = accept(Greedy(), logits, drafts, valid, None, None)
    got = accept_greedy(target, drafts, valid)
    assert [a.tolist() for a in got] == [a.tolist() for a in want]
    assert tied.sum(axis=-1).max() > 1  # ties present


def test_accept_greedy_argument_errors():
    with pytest.raises(ValueError, match=r"target has shape \(1, 3\) and drafts \(1, 3\); pass drafts \[batch, k\] "
                                         r"and the target's greedy tokens \[batch, k \+ 1\]"):
        accept_greedy(jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool))
    with pytest.raises(ValueError, match=r"valid has shape \(1, 2\)"):
        accept_greedy(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 2), bool))


def test_batch_keeps_the_minimum_and_each_row_its_own_token():
    logits = jax.nn.one_hot(jnp.asarray([[4, 7, 1, 5], [2, 3, 6, 0]]), 8)
    drafts = jnp.asarray([[4, 7, 1], [2, 0, 0]], jnp.int32)
    n, token = accept(Greedy(), logits, drafts, jnp.ones((2, 3), bool), None, None)
    # Row 1 rejects at 1, so both keep 1 draft; row 0 accepted its draft 7 there and emits it.
    assert n.tolist() == [1, 1] and token.tolist() == [7, 3]


def test_sampled_batch_keeps_the_minimum_and_each_row_its_own_token():
    logits = _logits(14, 2, K + 1, V)
    p = jnp.exp(SAMPLER.log_probs(logits))
    drafts = jnp.argmax(p[:, :K], axis=-1).astype(jnp.int32)
    drafts = drafts.at[1, 0].set(jnp.argmin(p[1, 0]))  # p = 0 there: row 1 rejects its first draft
    assert p[1, 0, drafts[1, 0]] == 0
    n, token = accept(SAMPLER, logits, drafts, jnp.ones((2, K), bool), p[:, :K], jax.random.key(15))
    assert n.tolist() == [0, 0] and int(token[0]) == int(drafts[0, 0]) and p[1, 0, int(token[1])] > 0


def _markov_tables(seed):
    """Target and draft logit tables [previous token, V]; at this scale top-p keeps 4 to 6 of the V tokens."""
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.normal(size=(V, V)) * 0.6, jnp.float32)
    return target, target + jnp.asarray(rng.normal(size=(V, V)) * 0.8, jnp.float32)


def _speculative_chain(key, start, target, draft, *, sampler, drafter, rounds, exact_residual=True):
    """Tokens emitted by `rounds` speculative rounds of a Markov target (logits target[previous token]).

    drafter "model": drafts drawn one by one from softmax(draft[previous]) with their q; "fixed": the draft table's
    argmax chain, one-hot, a random number of them valid. -> (tokens [rounds], n accepted in the first round).
    """
    def draft_step(last, step_key):
        if drafter == "model":
            token, q = sample_drafts(TopP(1.0), draft[last][None], step_key)
            return token[0], (token[0], q[0])
        token = jnp.argmax(draft[last]).astype(jnp.int32)
        return token, (token, jnp.zeros(V))

    def one_round(carry, round_key):
        previous, out, filled = carry
        draft_key, valid_key, accept_key = jax.random.split(round_key, 3)
        _, (drafts, q) = jax.lax.scan(draft_step, previous, jax.random.split(draft_key, K))
        if drafter == "model":
            q, valid = q[None], jnp.ones((1, K), bool)
        else:
            q, valid = None, (jnp.arange(K) < jax.random.randint(valid_key, (), 0, K + 1))[None]
        logits = target[jnp.concatenate([previous[None], drafts])][None]
        n, token = acceptance._accept(sampler, logits, drafts[None], valid, q, accept_key,
                                      exact_residual=exact_residual)
        emitted = jnp.where(jnp.arange(K + 1) < n[0], jnp.append(drafts, token[0]), token[0])
        out = jax.lax.dynamic_update_slice(out, emitted, (filled,))
        filled = filled + n[0] + 1
        return (out[filled - 1], out, filled), n[0]

    carry = (jnp.int32(start), jnp.zeros(rounds * (K + 1), jnp.int32), jnp.int32(0))
    (_, out, _), n = jax.lax.scan(one_round, carry, jax.random.split(key, rounds))
    return out[:rounds], n[0]


@functools.cache
def _sampled_chains(drafter, chains=24000, rounds=2, start=0):
    """{exact_residual: (counts of the first two tokens [V, V], their exact probabilities, histogram of n)}."""
    target, draft = _markov_tables(4)
    chain = functools.partial(_speculative_chain, start=start, target=target, draft=draft, sampler=SAMPLER,
                              drafter=drafter, rounds=rounds)
    run = jax.jit(jax.vmap(lambda key, exact: chain(key, exact_residual=exact), in_axes=(0, None)))
    p = np.asarray(jnp.exp(SAMPLER.log_probs(target)), np.float64)
    results = {}
    for exact in (True, False):
        tokens, first_n = run(jax.random.split(jax.random.key(5), chains), jnp.asarray(exact))
        counts = np.zeros((V, V))
        np.add.at(counts, (np.asarray(tokens[:, 0]), np.asarray(tokens[:, 1])), 1)
        results[exact] = counts, p[start][:, None] * p, np.bincount(np.asarray(first_n), minlength=K + 1)
    return results


@pytest.mark.parametrize("drafter", ["model", "fixed"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """24k chains, first two emitted tokens: pooled V^2 cells (dof = cells - 1), reject at p < P_REJECT."""
    counts, exact, first_n = _sampled_chains(drafter)[True]
    assert (first_n > 0).all(), f"every accept count 0..{K} must occur, got {first_n}"
    assert chi_square_pvalue(counts, exact) > P_REJECT
    assert chi_square_pvalue(counts.sum(axis=1), exact.sum(axis=1)) > P_REJECT


@pytest.mark.parametrize("drafter", ["model", "fixed"])
def test_the_distribution_check_catches_a_wrong_residual(drafter):
    """Drawing rejections from p instead of norm((p - q)+) over-weights the rejected drafts: the check must see it."""
    counts, exact, _ = _sampled_chains(drafter)[False]
    assert chi_square_pvalue(counts, exact) < P_REJECT
    assert chi_square_pvalue(counts.sum(axis=1), exact.sum(axis=1)) < P_REJECT


def test_speculative_greedy_equals_plain_greedy():
    target, draft = _markov_tables(6)
    rounds = 6

    def plain(start):
        tokens, previous = [], start
        for _ in range(rounds):
            previous = jnp.argmax(target[previous]).astype(jnp.int32)
            tokens.append(previous)
        return jnp.stack(tokens)

    def speculative(start, key):
        run = functools.partial(_speculative_chain, target=target, draft=draft, sampler=Greedy(), drafter="fixed",
                                rounds=rounds)
        return run(key, start)[0]

    starts = jnp.arange(V, dtype=jnp.int32)
    keys = jax.random.split(jax.random.key(7), V)
    assert jax.vmap(speculative)(starts, keys).tolist() == jax.vmap(plain)(starts).tolist()


# Degenerate inputs and shapes.

def test_draft_equal_to_target_is_always_accepted_and_zero_residual_stays_finite():
    logits = _logits(8, 1, K + 1, V)
    p = jnp.exp(SAMPLER.log_probs(logits))
    outside = int(jnp.argmin(p[0, 0]))  # p(d) = q(d) = 0 and q = p: rejected, the residual (p - q)+ is all zero
    inside = jnp.argmax(p[0, :K], axis=-1).astype(jnp.int32)[None]
    assert p[0, 0, outside] == 0
    run = jax.jit(jax.vmap(lambda drafts, key: accept(SAMPLER, logits, drafts, jnp.ones((1, K), bool), p[:, :K],
                                                      key), in_axes=(None, 0)))
    keys = jax.random.split(jax.random.key(9), 200)
    n, token = run(inside, keys)
    assert (n == K).all() and (p[0, K][token] > 0).all()
    n, token = run(inside.at[0, 0].set(outside), keys)
    assert (n == 0).all() and (p[0, 0][token] > 0).all()


def test_draft_outside_the_drafters_support_is_accepted_when_the_target_allows_it():
    logits = _logits(10, 1, 2, V)
    p = jnp.exp(SAMPLER.log_probs(logits))
    draft = jnp.argmax(p[0, 0]).astype(jnp.int32)
    q = jax.nn.one_hot((draft + 1) % V, V)[None, None]  # q(draft) = 0 < p(draft): the ratio is +inf
    n, _ = accept(SAMPLER, logits, draft[None, None], jnp.ones((1, 1), bool), q, jax.random.key(11))
    assert n.tolist() == [1]


def test_sample_drafts_returns_the_distribution_it_drew_from():
    logits = _logits(12, 2, V)
    tokens, q = sample_drafts(Greedy(), logits, None)
    assert tokens.tolist() == jnp.argmax(logits, -1).tolist()
    assert np.asarray(q).tolist() == np.asarray(jax.nn.one_hot(tokens, V)).tolist()
    tokens, q = sample_drafts(SAMPLER, logits, jax.random.key(13))
    assert (np.asarray(q)[np.arange(2), np.asarray(tokens)] > 0).all()
    np.testing.assert_allclose(q, jnp.exp(SAMPLER.log_probs(logits)))


@pytest.mark.parametrize("change, fragments", [
    (dict(target_logits=jnp.zeros((1, K, V))), ["target_logits", f"[1, {K + 1}, vocab]"]),
    (dict(drafts=jnp.zeros((K,), jnp.int32)), ["drafts", "[batch, k]"]),
    (dict(valid=jnp.ones((1, K + 1), bool)), ["valid", f"(1, {K})"]),
    (dict(draft_probs=jnp.zeros((1, K, V + 1))), ["draft_probs", f"[1, {K}, {V}]", "None"]),
    (dict(key=None), ["key", "jax.random key"]),
])
def test_bad_arguments_name_the_argument_and_the_fix(change, fragments):
    args = dict(target_logits=jnp.zeros((1, K + 1, V)), drafts=jnp.zeros((1, K), jnp.int32),
                valid=jnp.ones((1, K), bool), draft_probs=None, key=jax.random.key(0)) | change
    with pytest.raises(ValueError) as error:
        accept(SAMPLER, **args)
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)


@pytest.mark.parametrize("sampler", [Greedy(), SAMPLER], ids=["greedy", "top_p"])
def test_compiled_accept_has_no_host_round_trip(sampler):
    """No `conditional`, and every `while` (threefry's) has a trip count XLA knows statically."""
    args = (jnp.zeros((2, K + 1, V)), jnp.zeros((2, K), jnp.int32), jnp.ones((2, K), bool),
            jnp.full((2, K, V), 1.0 / V), jax.random.key(0))
    hlo = jax.jit(accept, static_argnums=0).lower(sampler, *args).compile().as_text()
    assert "conditional(" not in hlo
    for line in hlo.splitlines():
        if re.search(r"\bwhile\(", line):
            assert "known_trip_count" in line, line[:200]
