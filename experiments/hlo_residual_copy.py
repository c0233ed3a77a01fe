"""Where does the per-layer memcpy of bench_moe.py's residual chain come from? Prints the copies and custom calls of
the chain's optimized HLO (E = 64 experts, 2 layers). S10 9 (RESULTS.md, "Session 10"): no copy instruction.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/hlo_residual_copy.py`.
"""

import sys

import jax
import jax.numpy as jnp


def main():
    sys.argv = ["bench_moe.py"]
    import bench_moe as B

    B.E, B.CHAIN = 64, "residual"
    layers = B.make_layers(2, jax.random.key(0))
    xs = [jax.random.normal(jax.random.key(i), (1, B.D), jnp.bfloat16) for i in range(2)]
    run = B.make_chain(lambda x, lay, res: B.moe_layer(x, lay, "pallas", None, None, res), 2, 1)
    for line in run.lower(layers, xs).compile().as_text().splitlines():
        if "copy" in line or "custom-call(" in line:
            print(line.strip()[:260])


if __name__ == "__main__":
    main()
