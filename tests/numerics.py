"""The one error measure every tolerance in the suite refers to: relative L2 error ||a - b|| / ||b|| (float64)."""

import numpy as np


def rel_err(got, want) -> float:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert np.isfinite(got).all(), "non-finite values in the tested output"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
