"""Tensor parallelism as users run it, on 4 CPU devices: `generate`'s greedy tokens at TP1, TP2 and TP4, and the
collectives XLA compiles into the sharded decode and verify steps (docs/design.md §3: two all-reduces per layer,
the vocab-split head's few scalars per device, no weight gathered)."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import model
from ling_jax.cache import MLACache, cache_len
from ling_jax.config import preset
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.params import init_params
from ling_jax.sharding import make_mesh, param_shardings, state_shardings

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4,
                                reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")

PROMPT_LEN, NEW_TOKENS, BLOCK = 12, 32, 16
DRAFTS = 4

# One line of HLO text per collective: its result shape (a tuple when XLA combined several into one launch) and op.
_COLLECTIVE = re.compile(r"^\s*%?[\w.-]+ = (\([^)]*\)|\S+) "
                         r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", re.M)
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")


@functools.cache
def toy():
    """(cfg, float32 params on one device, prompt [1, PROMPT_LEN] on the host)."""
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (1, PROMPT_LEN), 2, cfg.vocab_size))
    return cfg, params, prompt


def _sharded(n: int):
    cfg, params, _ = toy()
    mesh = make_mesh(n)
    return mesh, jax.device_put(params, param_shardings(cfg, mesh, with_mtp=False))


@functools.cache
def greedy_run(backend: str, n: int):
    """generate's NEW_TOKENS greedy tokens at TP n -> (tokens, the HLO text of its compiled decode block; None at n=1).

    The block is lowered with generate's own arguments, so its compilation is the one generate ran (cached)."""
    cfg, params, prompt = toy()
    run = functools.partial(G.generate, cfg=cfg, prompt=prompt, max_new_tokens=NEW_TOKENS, sampler=Greedy(),
                            backend=backend, block_size=BLOCK, ignore_eos=True)
    if n == 1:
        return run(params).tokens[0], None
    mesh, sharded = _sharded(n)
    with jax.set_mesh(mesh):
        tokens = run(sharded).tokens[0]
        eos = jnp.zeros((0,), jnp.int32)
        max_len = cache_len(PROMPT_LEN + 1 + -(-(NEW_TOKENS - 1) // BLOCK) * BLOCK)
        loop, _ = G.start(sharded, jnp.asarray(prompt), jax.random.key(0), eos, cfg, Greedy(), max_len=max_len,
                          backend=backend, pad_id=cfg.pad_token_id, prefill_chunk=G.check_chunk(None))
        hlo = G.decode_block.lower(sharded, loop, eos, cfg, Greedy(), steps=BLOCK, backend=backend,
                                   pad_id=cfg.pad_token_id).compile().as_text()
    return tokens, hlo


def verify_hlo(backend: str, n: int) -> str:
    """The HLO text of model.verify's compiled step for DRAFTS tokens at TP n, from the documented state layout."""
    cfg, _, prompt = toy()
    mesh, sharded = _sharded(n)
    with jax.set_mesh(mesh):
        state = jax.eval_shape(lambda p, x: model.prefill(p, x, cfg, max_len=64, backend=backend)[1], sharded,
                               jnp.asarray(prompt))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                             state_shardings(state, mesh))
        mla = tuple(e if isinstance(e, MLACache) else None for e in state.layers)
        kda = tuple(None if isinstance(e, MLACache) else e for e in state.layers)
        drafts = jax.ShapeDtypeStruct((1, DRAFTS), jnp.int32)
        return model._verify.lower(sharded, state.length, kda, mla, drafts, cfg, backend=backend).compile().as_text()


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(op, the shapes it moves) for every collective launch in `hlo`."""
    return [(op, [tuple(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(shape)])
            for shape, op in _COLLECTIVE.findall(hlo)]


def assert_collectives(hlo: str, cfg, backend: str, tokens: int, n: int) -> None:
    """At most two all-reduces per layer (the mixer's o_proj and the FFN's down projection, both row-parallel) plus
    one for the head, each of one activation; all-gathers only of the greedy head's (max, index) per token and
    device; no other collective. A weight gathered around an op shows as an all-gather of a weight's size."""
    found = collectives(hlo)
    listing = "\n".join(f"  {op} {shapes}" for op, shapes in found)
    reduces = [shapes for op, shapes in found if op == "all-reduce"]
    # The reference MoE is partitioned by XLA, which reduces the routed experts' per-choice outputs [T, top_k, D]
    # with the shared expert's [T, D] in one launch, before the routing-weighted sum; the kernels backend sums
    # them on each device first and reduces one [T, D].
    per_launch = tokens * cfg.hidden_size * (1 if backend == "pallas" else 1 + cfg.num_experts_per_tok)
    problems = []
    if len(reduces) > 2 * cfg.num_layers + 1:
        problems.append(f"{len(reduces)} all-reduces for {cfg.num_layers} layers (at most {2 * cfg.num_layers + 1})")
    problems += [f"an all-reduce of {shapes}: more than {per_launch} elements" for shapes in reduces
                 if sum(map(math.prod, shapes)) > per_launch]
    problems += [f"an all-gather of {shapes}: more than one value per token and device ({tokens * n})"
                 for op, shapes in found if op == "all-gather" and sum(map(math.prod, shapes)) > tokens * n]
    problems += [f"a {op} of {shapes}" for op, shapes in found if op not in ("all-reduce", "all-gather")]
    assert not problems, f"{backend} TP{n}: " + "; ".join(problems) + f". Collectives found:\n{listing}"


# The kernels at TP4 are compared with the single-device reference: one slow interpret-mode run instead of two
# (tests/test_model.py checks the kernels against the reference on one device), and a mismatch still fails.
@pytest.mark.parametrize("backend, n", [("reference", 2), ("reference", 4), ("pallas", 4)])
def test_greedy_tokens_match_single_device(backend, n):
    """32 greedy tokens through `generate` at TP n are the single-device reference's, token for token."""
    want, _ = greedy_run("reference", 1)
    got, _ = greedy_run(backend, n)
    assert len(want) == NEW_TOKENS and len(set(want)) > 1
    assert got == want, f"{backend} TP{n} tokens {got} differ from one device's {want}"


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_decode_step_collectives(backend):
    """The compiled greedy decode block at TP4 (its steps are one while loop: the body is one step)."""
    cfg = toy()[0]
    _, hlo = greedy_run(backend, 4)
    assert re.search(r"\bwhile\(", hlo), "the decode block no longer compiles to one loop: counts would be per block"
    assert_collectives(hlo, cfg, backend, tokens=1, n=4)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_verify_step_collectives(backend):
    """The compiled verify step at TP4: DRAFTS tokens, every position's logits left split by vocab."""
    cfg = toy()[0]
    assert_collectives(verify_hlo(backend, 4), cfg, backend, tokens=DRAFTS, n=4)


def test_collectives_are_found():
    """The HLO parsing above counts a combined all-reduce as one launch and reads every shape it moves."""
    hlo = ("  %all-reduce.51 = (f32[1,128]{1,0}, f32[1,4,128]{2,1,0}) all-reduce(%a, %b), channel_id=5\n"
           "  %psum.2 = bf16[1,1,128]{2,1,0} all-reduce-start(%c), channel_id=1\n"
           "  %all-gather.4 = s32[4,1]{1,0} all-gather(%d), dimensions={0}\n"
           "  %add.1 = f32[1,128]{1,0} add(%all-reduce.51, %e)\n")
    assert collectives(hlo) == [("all-reduce", [(1, 128), (1, 4, 128)]), ("all-reduce", [(1, 1, 128)]),
                                ("all-gather", [(4, 1)])]
