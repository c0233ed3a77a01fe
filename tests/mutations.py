"""Mutation check: apply single-line bugs one at a time, each in a place that changes the numbers users get, and
run the part of the suite that should catch it. Every mutation must be killed (some test fails).

    python tests/mutations.py [--only NAME,...] [--list]        (`make mutate`; outside `make test`: it is slow)

Each mutation runs in a scratch copy of the tree (the working tree is never modified), with `pytest -x` over its
test files, so a killed mutation stops at its first failing test. A mutation whose original text is not found
fails loudly: the table must follow the code. Prints one line per mutation and a final table; exits 1 if any
survives. Seeds are the suite's fixed defaults.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # test files, or pytest node ids (file::test) where one test is the one that can tell


PARITY = "tests/test_parity.py"
LAYERS = "tests/test_layer_parity.py"
CHOICES = "tests/test_numeric_choices.py"

MUTATIONS = (
    Mutation("rms_norm_eps_x100", "model", "ling_jax/layers/norms.py",
             "keepdims=True) + eps)", "keepdims=True) + 100 * eps)", (CHOICES, LAYERS, PARITY)),
    Mutation("rope_rotation_sign", "model", "ling_jax/layers/rope.py",
             "x2 * cos + x1 * sin", "x2 * cos - x1 * sin", (LAYERS, PARITY)),
    Mutation("rope_frequencies", "model", "ling_jax/layers/rope.py",
             "dtype=jnp.float32) / dim))", "dtype=jnp.float32) / (2 * dim)))", (LAYERS, PARITY)),
    Mutation("mla_softmax_scale", "model", "ling_jax/layers/mla.py",
             "scale = cfg.qk_head_dim ** -0.5", "scale = cfg.v_head_dim ** -0.5", (LAYERS, PARITY)),
    Mutation("kda_gate_ignores_lower_bound", "kernels", "pallas_kernels/kda/reference.py",
             "return lower_bound * jax.nn.sigmoid(a * x)", "return -5.0 * jax.nn.sigmoid(a * x)",
             (LAYERS, PARITY, CHOICES, "tests/ops/test_kda.py")),
    Mutation("kda_l2norm_eps", "kernels", "pallas_kernels/kda/reference.py",
             "return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)",
             "return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e3 * eps)", (LAYERS, PARITY)),
    Mutation("router_weights_include_bias", "routing", "pallas_kernels/moe/reference.py",
             "w = jnp.take_along_axis(s, ids, axis=1)", "w = jnp.take_along_axis(choice, ids, axis=1)",
             (LAYERS, PARITY, "tests/ops/test_moe.py")),
    Mutation("router_ignores_norm_topk_prob", "routing", "pallas_kernels/moe/reference.py",
             "    if norm_topk_prob:\n        w = w / (w.sum(-1, keepdims=True) + 1e-20)",
             "    if True:\n        w = w / (w.sum(-1, keepdims=True) + 1e-20)", (CHOICES, "tests/ops/test_moe.py")),
    Mutation("router_group_score_top1", "routing", "pallas_kernels/moe/reference.py",
             "e // n_group), 2)[0].sum(-1)", "e // n_group), 1)[0].sum(-1)", (LAYERS, PARITY, "tests/ops/test_moe.py")),
    Mutation("router_fp32_drops_third_piece", "routing", "pallas_kernels/moe/router.py",
             "        return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)", "        return hi, mid",
             ("tests/ops/test_moe.py::test_route_fp32_router_resolves_a_near_tie_exactly",
              "tests/ops/test_moe.py::test_router_logits_of_an_fp32_router_are_fp32_sums")),
    Mutation("swiglu_clamp_drops_up", "model", "pallas_kernels/moe/reference.py",
             "        u = jnp.clip(u, jnp.asarray(-limit, dt), jnp.asarray(limit, dt))\n", "",
             ("tests/test_model.py", CHOICES, "tests/ops/test_moe.py")),
    Mutation("kda_commit_state_off_by_one", "commit", "pallas_kernels/kda/dispatch.py",
             "lax.dynamic_index_in_dim(s, i - 1, axis=0, keepdims=False)",
             "lax.dynamic_index_in_dim(s, jnp.minimum(i, s.shape[0] - 1), axis=0, keepdims=False)",
             ("tests/test_model.py", "tests/test_speculative.py", "tests/ops/test_kda.py")),
    Mutation("kda_commit_window_off_by_one", "commit", "pallas_kernels/kda/dispatch.py",
             "lax.dynamic_slice_in_dim(rows, i, Wm1, axis=0)",
             "lax.dynamic_slice_in_dim(rows, jnp.maximum(i - 1, 0), Wm1, axis=0)",
             ("tests/test_model.py", "tests/test_speculative.py", "tests/ops/test_kda.py")),
    Mutation("spec_commit_caps_at_k", "commit", "ling_jax/engine/speculative.py",
             "model = commit(StagedState(state.model.length, layers), n + 1)",
             "model = commit(StagedState(state.model.length, layers), jnp.minimum(n + 1, drafts.shape[1]))",
             ("tests/test_speculative.py",)),
    Mutation("mtp_draft_from_wrong_pair", "speculative", "ling_jax/engine/drafters.py",
             "return MTPState(cache, logits[:, n_keep], out[:, n_keep])",
             "return MTPState(cache, logits[:, n_keep - 1], out[:, n_keep - 1])", ("tests/test_speculative.py",)),
    Mutation("rejection_residual_is_p", "sampling", "ling_jax/engine/acceptance.py",
             "residual = jnp.where(exact_residual, jnp.maximum(p[:, :k] - q, 0.0), p[:, :k])",
             "residual = p[:, :k]", ("tests/test_acceptance.py",)),
    Mutation("top_p_keeps_one_more", "sampling", "ling_jax/engine/sampling.py",
             "kept = jnp.where(mass_before < self.top_p, sorted_logits, jnp.inf)",
             "kept = jnp.where(mass_before <= self.top_p, sorted_logits, jnp.inf)",
             ("tests/test_sampling.py::test_top_p_boundary_excludes_the_token_the_mass_before_reaches",
              "tests/test_acceptance.py")),
    Mutation("temperature_multiplies", "sampling", "ling_jax/engine/sampling.py",
             "logits = logits.astype(jnp.float32) / self.temperature",
             "logits = logits.astype(jnp.float32) * self.temperature",
             ("tests/test_sampling.py", "tests/test_acceptance.py")),
    Mutation("conversion_conv_taps_reversed", "conversion", "conversion/hf.py",
             "return (x[:, 0, :].T.reshape(shapes[0]),)", "return (x[:, 0, ::-1].T.reshape(shapes[0]),)",
             ("tests/test_conversion.py", PARITY)),
    Mutation("sharding_drops_the_expert_psum", "sharding", "ling_jax/sharding.py",
             "body = (lambda *args: jax.lax.psum(fn(*args), TP)) if sum_outputs else fn", "body = fn",
             ("tests/test_sharding.py",)),
    Mutation("step_bytes_kda_state_once", "floors", "ling_jax/bench.py",
             "((1 + positions) * H * K * K * 4", "(positions * H * K * K * 4", ("tests/test_step_bytes.py",)),
    Mutation("fp8_host_scale_amax_over_240", "fp8", "conversion/fp8_blocks.py",
             "np.where(amax > 0, amax / FP8_MAX, 1.0)", "np.where(amax > 0, amax / 240.0, 1.0)",
             ("tests/test_fp8_convention.py",)),
    Mutation("fp8_device_scale_amax_over_240", "fp8", "pallas_kernels/common/fp8.py",
             "jnp.where(amax > 0, amax / FP8_MAX, 1.0)", "jnp.where(amax > 0, amax / 240.0, 1.0)",
             ("tests/test_fp8_convention.py",)),
)


def scratch_copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", ".whl", ".before", "__pycache__", ".pytest_cache", "results")
    shutil.copytree(REPO, dst, ignore=ignore)


def run_one(m: Mutation, base: Path, python: str) -> tuple[str, float, str]:
    """-> (killed | SURVIVED | missing test | stale, seconds, first failing test or note)."""
    target = base / m.file
    original = target.read_text()
    if original.count(m.old) != 1:
        return "stale", 0.0, f"the original text occurs {original.count(m.old)} times in {m.file}"
    tests = [t for t in m.tests if (base / t.split("::")[0]).exists()]
    if not tests:
        return "missing test", 0.0, ", ".join(m.tests)
    target.write_text(original.replace(m.old, m.new))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(base)}
    t0 = time.perf_counter()
    try:
        out = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=base,
                             env=env, capture_output=True, text=True)
    finally:
        target.write_text(original)
    seconds = time.perf_counter() - t0
    if out.returncode == 0:
        return "SURVIVED", seconds, f"{' '.join(tests)} all pass"
    failed = next((line.split(" ")[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")), "")
    return "killed", seconds, failed or out.stdout.strip().splitlines()[-1][:120]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutation names")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.area:12s} {m.file}")
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "tree"
        scratch_copy(base)
        for m in chosen:
            status, seconds, note = run_one(m, base, sys.executable)
            results.append((m, status, seconds, note))
            print(f"{status:12s} {seconds:6.0f} s  {m.name}  ({note})", flush=True)
    print("\n| mutation | area | file | result | caught by | s |\n|---|---|---|---|---|---|")
    for m, status, seconds, note in results:
        print(f"| {m.name} | {m.area} | {m.file} | {status} | {note} | {seconds:.0f} |")
    return 0 if all(status == "killed" for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
