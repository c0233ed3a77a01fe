"""The suffix drafter on hand-made histories: longest match, most frequent continuation, the cut-offs, one path
per proposal, the bounded history, observe, batches, agreement with a brute-force reading of its definition,
and a compiled step with no host-side control flow."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.engine.suffix import SuffixDrafter


@functools.lru_cache(maxsize=None)
def jitted(drafter: SuffixDrafter, k: int):
    return jax.jit(lambda prompt, lengths: drafter.propose(drafter.init(prompt, lengths), k))


def propose(drafter: SuffixDrafter, rows: list[list[int]], k: int) -> list[list[int]]:
    """The valid drafts of each row, the rows right-padded to the capacity (one compiled shape per batch size),
    counted both ways, which must agree."""
    padded = np.array([r + [0] * (drafter.capacity - len(r)) for r in rows], np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    results = []
    for counting in ("pairs", "sorted"):
        drafts, valid = jax.device_get(jitted(dataclasses.replace(drafter, counting=counting), k)(padded, lengths))
        for row in valid:  # the valid drafts are a prefix
            assert not np.any(row[np.argmin(row):]) or row.all(), valid
        results.append([d[v].tolist() for d, v in zip(drafts, valid)])
    assert results[0] == results[1], results
    return results[0]


def reference(history: list[int], k: int, d: SuffixDrafter) -> list[int]:
    """The module docstring's definition, read literally."""
    n = len(history)

    def match(i):
        m = 0
        while m < d.max_match and i - m >= 0 and history[i - m] == history[n - 1 - m]:
            m += 1
        return m

    lengths = [match(i) for i in range(n - 1)]
    if not lengths or max(lengths) < d.min_match:
        return []
    matches = [i for i, m in enumerate(lengths) if m == max(lengths)]
    path, alive = [], matches
    for t in range(k):
        following = [(i, history[i + t + 1]) for i in alive if i + t + 1 < n]
        if not following:
            break
        counts = collections.Counter(tok for _, tok in following)
        top = max(counts.values())
        token = history[max(i for i, tok in following if counts[tok] == top) + t + 1]
        if top / len(matches) < d.min_token_prob:
            break
        path.append(token)
        alive = [i for i, tok in following if tok == token]
    return path


A, B, C, X, Y, Z = 11, 12, 13, 21, 22, 23
FREE = SuffixDrafter(capacity=64, max_match=8, min_token_prob=0.0)


def test_the_longest_match_decides():
    # "Y X" is followed by C once, "X" alone (in other contexts) by A twice: the longer match wins.
    history = [Y, X, C, 1, Z, X, A, 2, Z, X, A, 3, Y, X]
    assert propose(FREE, [history], 1) == [[C]]
    assert reference(history, 1, FREE) == [C]


def test_the_most_frequent_continuation_and_the_cut_off():
    history = [X, A, 1, X, B, 2, X, A, 3, X]  # X -> A twice, B once; after "X A" come 1 and 3
    assert propose(FREE, [history], 3) == [[A, 3, X]]  # 1 vs 3 tie: the most recent match continues
    half = SuffixDrafter(capacity=64, max_match=8, min_token_prob=0.5)
    assert propose(half, [history], 3) == [[A]]  # A is 2/3 of the matches; "A 3" only 1/3
    assert propose(SuffixDrafter(capacity=64, max_match=8, min_token_prob=0.7), [history], 3) == [[]]


def test_nothing_is_proposed_without_a_long_enough_match():
    assert propose(FREE, [[1, 2, 3, 4, 5]], 4) == [[]]  # 5 never occurred before
    assert propose(FREE, [[7]], 4) == [[]]  # a single token has no earlier occurrence
    history = [X, A, Y, X, B, Z, X]  # only one-token matches
    assert propose(FREE, [history], 2) == [[B, Z]]
    assert propose(SuffixDrafter(capacity=64, max_match=8, min_token_prob=0.0, min_match=2), [history], 2) == [[]]
    assert propose(SuffixDrafter(capacity=64, max_match=8, min_token_prob=0.0, min_match=2), [history + [B]], 2) \
        == [[Z, X]]


def test_drafts_follow_one_path_and_stop_at_the_history_end():
    history = [5, X, A, B, C, 6, X, A, B, 7, X]  # after X: "A B C" and "A B 7": one path, the latest branch
    assert propose(FREE, [history], 6) == [[A, B, 7, X]]  # the match at i=6 runs into the end of the history
    assert propose(FREE, [history], 2) == [[A, B]]
    periodic = [1, 2, 3, 1, 2, 3, 1, 2]  # the match "1 2 3 1 2" ends two tokens before the end
    assert propose(FREE, [periodic], 8) == [[3, 1, 2]]


@pytest.mark.parametrize("drafter", [SuffixDrafter(capacity=48, max_match=5, min_token_prob=0.0),
                                     SuffixDrafter(capacity=48, max_match=3, min_token_prob=0.25, min_match=2)])
def test_device_and_host_paths_agree_with_the_definition_on_random_histories(drafter):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 3 + r % 3, size=rng.integers(1, 49)).tolist() for r in range(48)]
    for row, drafts in zip(rows, propose(drafter, rows, 6)):
        assert drafts == reference(row, 6, drafter) == drafter.propose_host(np.array(row), 6), row
    longer = rng.integers(0, 4, size=100)  # the host path, too, sees only the newest `capacity` tokens
    assert drafter.propose_host(longer, 6) == reference(longer[-48:].tolist(), 6, drafter)


def test_a_batch_keeps_one_history_per_row():
    rows = [[X, A, B, 9, X], [X, C, 9, 9, X, C, 8, 3, 3, X]]
    assert propose(FREE, rows, 3) == [[A, B, 9], [C, 8, 3]]


def test_the_history_is_bounded_and_keeps_the_newest_tokens():
    drafter = SuffixDrafter(capacity=16, max_match=4, min_token_prob=0.0)
    old = [X, A, B, C] + list(range(100, 112))  # 16 tokens: fills the history
    state = drafter.init(np.array([old], np.int32))
    new = np.array([[X, Y, Z, 1, 2, 3]], np.int32)
    state = drafter.observe(state, new, jnp.int32(6))
    state = drafter.observe(state, np.array([[X, 0]], np.int32), jnp.int32(1))
    assert int(state.length[0]) == 16
    assert state.history[0].tolist() == (old + new[0].tolist() + [X])[-16:]
    # The X -> A B C occurrence was dropped, X -> Y Z kept.
    assert propose(drafter, state.history.tolist(), 3) == [[Y, Z, 1]]
    long_prompt = np.arange(1000, 1040, dtype=np.int32)[None]
    assert drafter.init(long_prompt).history[0].tolist() == list(range(1024, 1040))


@pytest.mark.parametrize("k", [1, 4])
def test_observe_appends_exactly_n_tokens(k):
    drafter = SuffixDrafter(capacity=32, max_match=4)
    prompt = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]], np.int32)
    state = drafter.init(prompt)
    tokens = np.array([[60, 61, 62, 63, 64][:k + 1], [70, 71, 72, 73, 74][:k + 1]], np.int32)
    observe = jax.jit(drafter.observe)
    for n in range(1, k + 2):
        after = observe(state, tokens, jnp.int32(n))
        assert after.length.tolist() == [5 + n, 5 + n]
        for row in range(2):
            assert after.history[row, :5 + n].tolist() == prompt[row].tolist() + tokens[row, :n].tolist()
            assert not after.history[row, 5 + n:].any()  # nothing past the length


def no_host_control_flow(compiled_text: str) -> list[str]:
    """The lines of compiled HLO that would make the device wait on the host: a conditional, or a while loop
    whose trip count XLA does not know."""
    return [line for line in compiled_text.splitlines()
            if "conditional(" in line or ("while(" in line and "known_trip_count" not in line)]


@pytest.mark.parametrize("counting", ["pairs", "sorted"])
def test_the_compiled_step_has_no_host_control_flow(counting):
    drafter = SuffixDrafter(capacity=256, max_match=16, min_token_prob=0.1, counting=counting)
    state = drafter.init(np.arange(40, dtype=np.int32)[None] % 7)
    propose_text = jax.jit(lambda s: drafter.propose(s, 5)).lower(state).compile().as_text()
    observe_text = jax.jit(drafter.observe).lower(state, np.zeros((1, 6), np.int32), jnp.int32(3)).compile().as_text()
    assert no_host_control_flow(propose_text) == []
    assert no_host_control_flow(observe_text) == []


@pytest.mark.parametrize("field, value, message", [
    ("capacity", 1, r"capacity=1 must be an int in \[2, 46340\].*use e.g. 4096"),
    ("capacity", 50000, r"capacity=50000 must be an int in \[2, 46340\].*use e.g. 4096"),
    ("max_match", 0, "max_match=0 must be an int >= 1; use e.g. 64"),
    ("min_match", 0, r"min_match=0 must be an int in \[1, max_match=64\]; use 1 or 2"),
    ("min_token_prob", 1.5, r"min_token_prob=1.5 must lie in \[0, 1\]; use 0 to propose every continuation"),
    ("counting", "hash", "counting='hash' is unknown; use auto, pairs or sorted"),
])
def test_bad_fields_are_named_with_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        SuffixDrafter(**{field: value})


def test_bad_arguments_are_named_with_the_fix():
    drafter = SuffixDrafter(capacity=16)
    with pytest.raises(ValueError, match=r"prompt has shape \(4,\).*pass token ids \[B, T\] as int32"):
        drafter.init(np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="k=0 must be a static int >= 1"):
        drafter.propose(drafter.init(np.ones((1, 3), np.int32)), 0)
