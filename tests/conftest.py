"""Suite-wide setup: 4 host devices for the sharding tests (must precede JAX's backend start), float32 math.

Random test inputs are drawn from fixed seeds (tests/numerics.py's input_seed). LING_JAX_TEST_SEED=random draws a
fresh seed for every input draw (the randomised sweep, e.g. `LING_JAX_TEST_SEED=random make test`);
LING_JAX_TEST_SEED=<integer> replays one: a failing test prints the seed it drew in its captured stdout, and in
its assertion message where it compares numbers.
"""

import jax

jax.config.update("jax_num_cpu_devices", 4)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test module's compiled executables are dropped after it: one process runs the whole suite, and their
    accumulation (several GB over the suite) is what a 24 GB CI machine runs out of."""
    yield
    jax.clear_caches()
