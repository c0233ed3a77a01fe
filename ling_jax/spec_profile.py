"""`ling-jax bench --spec ... --profile`: the device time of the speculative step the timed generations run.

Three programs are traced, each a jitted block of `block` steps, and measured per step (`profiling.step_families`):

    spec step       `speculative.spec_block` as `generate_speculative` compiles it (the same drafter, aux, k, block
                    and cache length): propose, verify forward, accept, commit, observe
    verify forward  the model forward over k + 1 positions alone, as `spec_step` calls it (greedy head)
    plain step      the plain decode step (bench.profile_step)

The spec step's kernel families are its op breakdown; the verify forward beside it shows what the step spends around
its forward (drafting, acceptance, the caches' commit, the drafter's observe).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.cache import MLACache, cache_len
from ling_jax.engine import speculative as S
from ling_jax.engine.sampling import Greedy
from ling_jax.model import forward


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "backend"), donate_argnames=("layers",))
def verify_block(params, tokens, layers, length, cfg, *, steps: int, backend: str):
    """`steps` verify forwards over tokens [B, k + 1] at position `length` -> (greedy tokens [B, k + 1], layers,
    (hidden, the KDA layers' staged states)). Each forward feeds the previous one's greedy tokens, so XLA cannot hoist
    it out of the loop as invariant; every output is carried, so none of the forward's work is dead code; the MLA
    caches are carried and written in place as in the spec step, the KDA caches stay uncommitted."""
    def verify(tokens, layers):
        out, hidden, staged = forward(params, tokens, layers, length, cfg, mode="verify", backend=backend,
                                      head="greedy")
        kept = tuple(s if isinstance(s, MLACache) else c for s, c in zip(staged, layers))
        return out, kept, (hidden, tuple(s for s in staged if not isinstance(s, MLACache)))

    return jax.lax.fori_loop(1, steps, lambda _, carry: verify(*carry[:2]), verify(tokens, layers))


def profile_spec_step(params, cfg, backend: str, prompt, block: int, *, drafter, aux, k: int, max_new: int,
                      pad_id: int, prefill_chunk: int, device=None) -> dict:
    """Device time per speculative step by kernel family, with the verify forward alone under "verify" (module
    docstring). `max_new`: the generation's output length (a static of the compiled block); `device` as
    `profile_step`'s."""
    from ling_jax.profiling import step_families, trace_events
    from ling_jax.sharding import host_values, replicated

    statics = dict(cfg=cfg, sampler=Greedy(), drafter=drafter, backend=backend, pad_id=pad_id)
    prompt, key, eos, aux = replicated((np.asarray(prompt, np.int32), jax.random.key(0), jnp.zeros((0,), jnp.int32),
                                        aux), params["embed"])
    # generate_speculative's cache length, so the timed runs' compiled block serves.
    max_len = cache_len(prompt.shape[1] + max_new + k + 1)
    state, _ = S.spec_start(params, aux, jnp.asarray(prompt), key, eos, max_len=max_len, prefill_chunk=prefill_chunk,
                            **statics)
    held = dict(state=state)

    def spec():
        held["state"], held["out"], _, _ = S.spec_block(params, aux, held["state"], eos, k=k, steps=block,
                                                        max_new=max_new, **statics)
        return held["out"]

    jax.block_until_ready(spec())  # compile, or warm the timed runs' executable
    prof = dict(backend=backend, k=k, **step_families(trace_events(spec, 1, device=device), block))
    # Steps past the output's end emit nothing and run at positions only the timed runs' last block reaches: the
    # traced block (the second) should hold none.
    past = min(block, 2 * block - int(host_values(held["state"].counters)[S.VERIFY_STEPS]))
    if past > 0:
        print(f"ling-jax bench: {past} of the profiled spec block's {block} steps ran past the output's end "
              f"({max_new} tokens): a longer --output-len profiles emitting steps only", file=sys.stderr)
    # The block's first k + 1 tokens: the model's own output rather than arbitrary ids, though fed at model.length,
    # not at the positions where they were verified.
    model = held["state"].model
    held.update(tokens=held["out"][:, :k + 1], layers=model.layers)

    def verify():
        held["tokens"], held["layers"], rest = verify_block(params, held["tokens"], held["layers"], model.length,
                                                            cfg=cfg, steps=block, backend=backend)
        return held["tokens"], rest

    jax.block_until_ready(verify())
    return dict(prof, verify=step_families(trace_events(verify, 1, device=device), block))


def spec_summary(spec: dict, plain: dict) -> dict:
    """Spec step, verify forward alone and plain decode step, device timeline µs per step, and the spec step's share
    outside its verify forward (None without GPU events)."""
    step, verify = spec["span_us_per_step"], spec["verify"]["span_us_per_step"]
    return dict(spec_step_us=round(step, 1), verify_forward_us=round(verify, 1),
                plain_step_us=round(plain["span_us_per_step"], 1), outside_verify_us=round(step - verify, 1),
                outside_verify_pct=round(100 * (step - verify) / step, 1) if step else None)


def print_spec_summary(s: dict, k: int) -> None:
    outside = "-" if s["outside_verify_pct"] is None else f"{s['outside_verify_pct']:.1f} %"
    print(f"  spec step {s['spec_step_us']} µs, verify forward over {k + 1} positions alone {s['verify_forward_us']} "
          f"µs, plain decode step {s['plain_step_us']} µs (GPU timeline per step): {s['outside_verify_us']} µs "
          f"({outside}) of the spec step outside its verify forward")
