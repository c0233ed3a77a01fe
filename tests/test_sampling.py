"""Frequencies of `ling_jax.engine.sampling` draws against an independent float64 numpy reference.

The reference is softmax(logits / temperature) restricted to the top-p set (the smallest prefix of tokens, by
probability, whose mass reaches top_p: a token is kept while the mass before it is < top_p) and renormalised.
Each case draws N tokens per row from two different rows at once and runs a chi-square goodness-of-fit test per
row; it fails below P_MIN = 1e-4 (with the fixed seeds a pass is reproducible; under LING_JAX_TEST_SEED=random
a correct sampler fails a given row-case with probability 1e-4). Tokens outside the top-p set must never appear,
and each case shows its power: the same counts reject the distribution at temperature 1.

The keep rule's own decision point (mass before a token exactly equal to top_p) is tested apart, on logits whose
float32 softmax is exactly dyadic, so the kept set is known without tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ling_jax.engine.sampling import Greedy, TopP, make_sampler

from tests.numerics import input_seed

V = 24
N = 200_000  # draws per row: a 1e-4 test then resolves probability differences of ~1e-2 relative
P_MIN = 1e-4
MIN_EXPECTED = 5  # chi-square's usual validity rule: rarer tokens are pooled into one bin
BOUNDARY_MARGIN = 1e-3  # the cumulative masses stay this far from top_p, so float32 and float64 keep the same set


def reference_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """[rows, V] float64 probabilities of the top-p sampler, written from its definition."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    return restrict_to_top_p(p / p.sum(-1, keepdims=True), top_p)


def restrict_to_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """[rows, V] probabilities -> the same restricted to each row's top-p set and renormalised."""
    out = np.zeros_like(p)
    for row, probs in enumerate(p):
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        kept = order[before < top_p]
        out[row, kept] = probs[kept] / probs[kept].sum()
    return out


def top_p_margin(logits: np.ndarray, temperature: float, top_p: float) -> float:
    """How far the sorted cumulative masses lie from top_p (the keep rule's decision points)."""
    probs = reference_probs(logits, temperature, 1.0)
    cumulative = np.cumsum(-np.sort(-probs, axis=-1), axis=-1)
    return float(np.abs(cumulative - top_p).min())


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value of `counts` under `probs`; 0 when a token of probability 0 was drawn."""
    if counts[probs == 0].any():
        return 0.0
    counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    rare = expected < MIN_EXPECTED
    if rare.any():
        counts = np.append(counts[~rare], counts[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    if len(counts) < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


def shows_the_cut(logits: np.ndarray, temperature: float, top_p: float) -> bool:
    """Whether a top-p case can see the cut: no mass at the boundary, at least one token removed per row, and a
    top-p set that differs from the one at temperature 1 (temperature comes before the cut)."""
    want = reference_probs(logits, temperature, top_p)
    return (top_p_margin(logits, temperature, top_p) > BOUNDARY_MARGIN and (want == 0).sum(-1).min() >= 1
            and ((reference_probs(logits, 1.0, top_p) > 0) != (want > 0)).any())


def case_logits(rng: np.random.Generator, temperature: float, top_p: float) -> np.ndarray:
    """Two rows of distinct logits (no ties, so the top-p set is one set); for top_p < 1, rows that show the cut."""
    for _ in range(100):
        logits = rng.normal(0.0, 1.0, size=(2, V)).astype(np.float32)
        distinct = np.diff(np.sort(logits, axis=-1), axis=-1).min() > 1e-4
        if distinct and (top_p == 1 or shows_the_cut(logits, temperature, top_p)):
            return logits
    raise AssertionError(f"no logits in 100 draws show the top-{top_p} cut at temperature {temperature}")


def draw_counts(sampler, logits: np.ndarray, seed: int, n: int = N) -> np.ndarray:
    """[rows, vocab] counts of n independent draws per row, all rows in one sample call."""
    batch = jnp.broadcast_to(jnp.asarray(logits), (n, *logits.shape))
    tokens = np.asarray(sampler.sample(batch, jax.random.key(seed)))
    assert tokens.shape == (n, logits.shape[0]) and tokens.dtype == np.int32
    return np.stack([np.bincount(tokens[:, row], minlength=logits.shape[-1]) for row in range(logits.shape[0])])


@pytest.mark.parametrize("top_p", [0.9, 1.0], ids=["top_p0.9", "top_p1"])
@pytest.mark.parametrize("temperature", [0.5, 2.0], ids=["t0.5", "t2"])
def test_top_p_frequencies(temperature, top_p):
    seed = input_seed(int(10 * temperature + 100 * top_p))
    logits = case_logits(np.random.default_rng(seed), temperature, top_p)
    want = reference_probs(logits, temperature, top_p)
    counts = draw_counts(TopP(temperature, top_p), logits, seed)
    for row in range(len(logits)):
        removed = np.flatnonzero(want[row] == 0)
        assert counts[row, removed].sum() == 0, (f"seed {seed}, row {row}: tokens {removed.tolist()} lie outside "
                                                 f"the top-{top_p} set but were drawn {counts[row, removed].tolist()}")
        p_value = chi_square_p(counts[row], want[row])
        print(f"T={temperature} top_p={top_p} row {row}: {len(removed)} tokens removed, chi-square p = {p_value:.3g}")
        assert p_value >= P_MIN, (f"seed {seed}, row {row}: the draws do not follow softmax(logits / {temperature}) "
                                  f"over the top-{top_p} set (chi-square p = {p_value:.2e} < {P_MIN})")
        wrong = chi_square_p(counts[row], reference_probs(logits[row:row + 1], 1.0, top_p)[0])
        print(f"  against temperature 1: p = {wrong:.3g}")
        assert wrong < P_MIN, (f"seed {seed}, row {row}: the test cannot tell temperature {temperature} from 1 "
                               f"(p = {wrong:.2e}); draw more samples")


# Probabilities 16, 8, 4, 3, 1 / 32: every one and every partial sum is exact in float32 (and in float64).
DYADIC_PROBS = np.array([16, 8, 4, 3, 1]) / 32
DYADIC_ORDERS = ([3, 0, 4, 1, 2], [1, 4, 2, 3, 0])  # two rows, the tokens in two orders (the sort must sort)
BOUNDARY_DRAWS = 20_000  # the rarest kept token has probability >= 3/31, so every kept token is drawn


def exact_logit(ratio: float) -> np.float32:
    """A float32 logit whose float32 exp on this backend is exactly `ratio` (a dyadic in (0, 1]): the nearest of
    log(ratio)'s float32 neighbours that gives it, as backends' exp may differ in the last ulp."""
    x = np.float32(np.log(ratio))
    below, above = [x], [x]
    for _ in range(4):
        below.append(np.nextafter(below[-1], np.float32(-np.inf)))
        above.append(np.nextafter(above[-1], np.float32(np.inf)))
    for candidate in sorted(set(below + above), key=lambda c: abs(float(c) - np.log(ratio))):
        if float(jnp.exp(jnp.float32(candidate))) == ratio:
            return candidate
    raise AssertionError(f"no float32 logit near log({ratio}) has exp exactly {ratio} on this backend")


def dyadic_case() -> tuple[np.ndarray, np.ndarray]:
    """-> (float32 logits [2, 5], their exact probabilities): the top logit is 0, so softmax's max subtraction is
    exact, the exps are exact by construction and their sum is 2; the float32 softmax is checked to be exact."""
    row = np.array([exact_logit(r) for r in DYADIC_PROBS / DYADIC_PROBS.max()], dtype=np.float32)
    logits = np.stack([row[order] for order in DYADIC_ORDERS])
    probs = np.stack([DYADIC_PROBS[order] for order in DYADIC_ORDERS])
    got = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    assert (got == probs).all(), f"float32 softmax {got.tolist()} is not exactly {probs.tolist()}"
    return logits, probs


@pytest.mark.parametrize("top_p,n_kept", [(0.5, 1), (0.75, 2), (0.875, 3), (0.96875, 4), (0.8, 3)])
def test_top_p_boundary_excludes_the_token_the_mass_before_reaches(top_p, n_kept):
    """At top_p equal to a partial sum of the probabilities, the token whose mass before equals top_p is dropped:
    the smallest set whose mass reaches top_p. This is transformers' TopPLogitsWarper convention: it sorts
    ascending and removes a token when the cumulative mass up to and including it is <= 1 - top_p, which is the
    descending mass before it being >= top_p (0.8 is off every boundary, as a control)."""
    logits, probs = dyadic_case()
    want = restrict_to_top_p(probs, top_p)
    assert ((want > 0).sum(-1) == n_kept).all()
    sampler = TopP(1.0, top_p)
    log_probs = np.asarray(sampler.log_probs(jnp.asarray(logits)))
    for row in range(len(logits)):
        kept = np.flatnonzero(np.isfinite(log_probs[row])).tolist()
        assert kept == np.flatnonzero(want[row]).tolist(), (
            f"row {row}, top_p {top_p}: kept tokens {kept}, the smallest set whose mass reaches top_p is "
            f"{np.flatnonzero(want[row]).tolist()}")
        # float32 log_softmax of exact inputs: a few ulps
        np.testing.assert_allclose(np.exp(log_probs[row, kept]), want[row, kept], rtol=1e-6)
    counts = draw_counts(sampler, logits, input_seed(5), BOUNDARY_DRAWS)
    assert ((counts > 0) == (want > 0)).all(), f"top_p {top_p}: drawn tokens {counts.tolist()}, kept set {want > 0}"


def test_greedy_is_the_numpy_argmax():
    """Every row's draw is its argmax, the lowest id among tied maxima, whatever the key."""
    rng = np.random.default_rng(input_seed(3))
    logits = rng.normal(size=(64, V)).astype(np.float32)
    tied = np.stack([rng.choice(V, size=2, replace=False) for _ in range(16)])
    logits[np.arange(16)[:, None], tied] = logits[:16].max(-1, keepdims=True) + 1.0
    want = np.argmax(logits, axis=-1)
    assert (want[:16] == tied.min(-1)).all()
    for seed in range(3):
        got = np.asarray(Greedy().sample(jnp.asarray(logits), jax.random.key(seed)))
        assert got.dtype == np.int32 and (got == want).all(), f"key {seed}: rows {np.flatnonzero(got != want)}"
    assert make_sampler(0.0) == Greedy() and make_sampler(0.5, 0.9) == TopP(0.5, 0.9)
