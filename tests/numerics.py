"""The one error measure every tolerance in the suite refers to: relative L2 error ||a - b|| / ||b|| (float64),
and the one place a test's random inputs take their seed from."""

import os

import numpy as np

SEED_ENV = "LING_JAX_TEST_SEED"


def rel_err(got, want) -> float:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert np.isfinite(got).all(), "non-finite values in the tested output"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def input_seed(default: int = 0) -> int:
    """The seed of a random draw of test inputs: ``default`` unless LING_JAX_TEST_SEED is set (to an integer: that
    seed for every draw; to ``random``: a fresh seed per draw). Fixed by default, so a pass covers the same inputs
    on every run."""
    raw = os.environ.get(SEED_ENV, "").strip()
    if raw == "":
        seed = default
    elif raw == "random":
        seed = int(np.random.default_rng().integers(2**31))
    elif raw.isdigit():
        seed = int(raw)
    else:
        raise ValueError(f"{SEED_ENV}={raw!r} must be a non-negative integer or 'random' (or unset for the fixed "
                         "seeds)")
    # pytest shows a failing test's stdout: the line to export to replay the draw.
    print(f"{SEED_ENV}={seed}")
    return seed
