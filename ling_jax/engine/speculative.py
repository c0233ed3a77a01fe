"""Speculative decoding: draft -> verify -> accept -> commit as one jitted step, acceptance state on the device.

One step, with a static number of drafts k (docs/design.md §2):

    propose   the drafter continues the committed tokens with k drafts (and, if it has them, their probabilities)
    verify    one target forward over k + 1 positions: the last committed token (not yet in the caches) + the drafts;
              greedy takes the target's tokens from the fused greedy head, sampling its logits
    accept    greedy: the longest prefix equal to the target's argmax, then the target's token after it; sampling:
              exact rejection sampling, so the output distribution is the target's (engine/acceptance.py)
    commit    the caches keep the n + 1 fed positions that are now committed (`cache.commit`, device indices only),
              the drafter observes the n + 1 emitted tokens, `length` advances by n + 1

The batch shares one length, so a step keeps the smallest accepted count of its rows (`acceptance.accept` cuts
them; a row's extra accepted drafts are re-proposed next step; nothing is lost, greedy or sampled). There is no
`lax.cond`, no data-dependent `while_loop` and no host read: a block of steps is one `lax.fori_loop` with a static
trip count writing its tokens into a device buffer at a device-computed offset, and the host reads a block's tokens
only after the next block has been dispatched, as `engine.generate` does.

    SpecState                       (donated to every block)
      model     ModelState           target caches + length (positions in the caches)
      last      int32 [B]            the last committed token, fed at the next verify
      hidden    [B, D]               the target's final-normed hidden state at position length - 1 (the MTP input)
      drafter   pytree               the drafter's own state (its caches, history, ...)
      key       PRNG key
      done      bool [B]             the row has emitted an EOS
      emitted   int32 []             tokens emitted so far, the first (prefill's) included
      counters  int32 [4]            verify steps, drafted tokens, accepted drafts, greedy drafts equal to the
                                     verify's argmax (steps before the end only)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.backends import check_config, check_partitioning, prepare
from ling_jax.cache import ModelState, StagedState, cache_len, commit
from ling_jax.config import LingConfig
from ling_jax.engine import acceptance
from ling_jax.engine.generate import _CompileCounter, _cut_after_eos, _mask_eos, host_prompt
from ling_jax.engine.sampling import Greedy
from ling_jax.model import check_chunk, check_prefill_memory, forward, prefill
from ling_jax.params import as_params
from ling_jax.sharding import constrain_state, host_values, replicated

VERIFY_STEPS, DRAFTED, ACCEPTED, AGREED = range(4)
# k + 1 <= 17 verify positions keep the step in the decode/verify kernels' regime (they take <= 64 tokens); longer
# chains would be prefill-sized forwards.
MAX_DRAFTS = 16


class SpecState(NamedTuple):
    model: ModelState
    last: jax.Array
    hidden: jax.Array
    drafter: Any
    key: jax.Array
    done: jax.Array
    emitted: jax.Array
    counters: jax.Array


@dataclasses.dataclass(frozen=True)
class SpecResult:
    tokens: list[list[int]]  # new tokens per sequence, cut after the first EOS (kept) unless ignore_eos
    ttft_s: float
    decode_s: float  # from the first token on the host to the last block's tokens on the host
    verify_steps: int  # spec steps that emitted tokens (steps past the end of the output are not counted)
    drafted: int  # drafts proposed in those steps (valid ones)
    accepted: int  # drafts accepted in those steps
    compiles: int = 0  # executables compiled inside the timed region
    agreed: int = 0  # greedy: drafts equal to the verify's argmax in those steps (0 when sampling)
    planned: bool = False  # the accepted counts followed a plan (drafters.PlannedDrafter): a timing mode
    # Spec steps run on the device, timed in decode_s: the blocks dispatched × block_size. A block's tokens are read
    # after the next block is dispatched (the device never waits on the host), so the block after the one that
    # completes the output runs too, its steps past the end.
    steps_run: int = 0

    @property
    def agreement(self) -> float | None:
        """Greedy: the fraction of drafted positions where the verify's argmax equalled the draft; None when none
        was drafted."""
        return self.agreed / self.drafted if self.drafted else None

    @property
    def accept_length(self) -> float | None:
        """Committed tokens per verify step, the target's own token included (SGLang's accept length); None when
        no step ran (a single output token comes from the prefill)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None

    @property
    def tpot_s(self) -> float | None:
        """Decode time per emitted token after the first (SGLang's TPOT); None for a single token."""
        n = len(self.tokens[0])
        return self.decode_s / (n - 1) if n > 1 else None

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens[0]) / (self.ttft_s + self.decode_s)


def _emitted_tokens(drafts, nxt, n):
    """The n + 1 tokens a step emits per row: drafts[:, :n] then the row's token at n (`accept` has already cut
    every row to the batch's n and picked that token). Entries past n are don't-care."""
    k = drafts.shape[1]
    padded = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    return jnp.where(jnp.arange(k + 1)[None] == n, nxt[:, None], padded)


def _mask_eos_run(tokens, count, done, eos, pad_id):
    """EOS inside a step's emitted run: tokens after the first EOS (and every token of a finished row) become pad."""
    is_eos = jnp.isin(tokens, eos) & (jnp.arange(tokens.shape[1])[None] < count)
    after = jnp.cumsum(is_eos, axis=1) - is_eos > 0
    tokens = jnp.where(done[:, None] | after, pad_id, tokens)
    return tokens, done | is_eos.any(axis=1)


def spec_step(params, aux, state: SpecState, eos, cfg: LingConfig, sampler, drafter, *, k: int, backend: str,
              pad_id: int, max_new: int):
    """One draft -> verify -> accept -> commit cycle -> (SpecState, tokens [B, k+1], count []): the step's emitted
    tokens are tokens[:, :count] (count = n + 1, or 0 once the output is complete)."""
    key, k_draft, k_accept = jax.random.split(state.key, 3)
    drafts, valid, q, dstate = drafter.propose(aux, params, cfg, state, k, sampler, k_draft, backend)
    fed = jnp.concatenate([state.last[:, None], drafts], axis=1)
    # Greedy verifies through the fused greedy head, as plain decode does (on Pallas, up to 16 tokens in all: the
    # [B, k + 1, V] logits are never written).
    greedy = isinstance(sampler, Greedy)
    out, hidden, layers = forward(params, fed, state.model.layers, state.model.length, cfg, mode="verify",
                                  backend=backend, head="greedy" if greedy else "logits")
    if getattr(drafter, "planned", False):
        n_acc, nxt = acceptance.accept_planned(out, drafts, drafter.planned_count(aux, state.counters[VERIFY_STEPS], k))
    elif greedy:
        n_acc, nxt = acceptance.accept_greedy(out, drafts, valid)
    else:
        n_acc, nxt = acceptance.accept(sampler, out, drafts, valid, q, k_accept)
    # Greedy: the drafted positions where the verify's argmax equals the draft, the natural agreement, which a
    # planned count may exceed or fall short of (sampling counts none: it keeps drafts that are not the argmax).
    agreed = jnp.sum(valid & (drafts == out[:, :-1]), axis=1).min() if greedy else jnp.int32(0)
    n = n_acc[0]  # the batch's shared count
    tokens = _emitted_tokens(drafts, nxt, n)
    model = commit(StagedState(state.model.length, layers), n + 1)
    dstate = drafter.observe(aux, params, cfg, state, dstate, tokens, n + 1, hidden, backend)

    live = (state.emitted < max_new) & ~state.done.all()
    count = jnp.where(live, n + 1, 0)
    tokens, done = _mask_eos_run(tokens, count, state.done, eos, pad_id)
    counters = state.counters + live * jnp.stack([1, valid.sum(axis=1).min(), n, agreed]).astype(jnp.int32)
    state = SpecState(model, tokens[:, n], hidden[:, n], dstate, key, done,
                      state.emitted + count, counters)
    return state, tokens, count


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "drafter", "k", "steps", "backend", "pad_id",
                                             "max_new"), donate_argnames=("state",))
def spec_block(params, aux, state: SpecState, eos, cfg: LingConfig, sampler, drafter, *, k: int, steps: int,
               backend: str, pad_id: int, max_new: int):
    """`steps` spec steps in one executable -> (SpecState, tokens [B, steps*(k+1)], count [], done [B]): the block's
    emitted tokens are tokens[:, :count]."""
    out = jnp.zeros((state.last.shape[0], steps * (k + 1)), jnp.int32)

    def body(_, carry):
        state, out, filled = carry
        state, tokens, count = spec_step(params, aux, state, eos, cfg, sampler, drafter, k=k, backend=backend,
                                         pad_id=pad_id, max_new=max_new)
        return state, jax.lax.dynamic_update_slice(out, tokens, (0, filled)), filled + count

    state, out, filled = jax.lax.fori_loop(0, steps, body, (state, out, jnp.zeros((), jnp.int32)))
    return state, out, filled, state.done


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "drafter", "max_len", "backend", "pad_id",
                                             "prefill_chunk"))
def spec_start(params, aux, prompt, key, eos, cfg: LingConfig, sampler, drafter, *, max_len: int, backend: str,
               pad_id: int, prefill_chunk: int | None = None):
    """Prefill, the first token and the drafter's initial state -> (SpecState, first token [B])."""
    logits, model, hidden = prefill(params, prompt, cfg, max_len=max_len, backend=backend, chunk=prefill_chunk)
    key, sub = jax.random.split(key)
    first = sampler.sample(logits[:, -1], sub)
    first, done = _mask_eos(first, jnp.zeros(first.shape, bool), eos, pad_id)
    dstate = drafter.init(aux, params, cfg, prompt, first, hidden, max_len, backend)
    counters = jnp.zeros((4,), jnp.int32)
    state = SpecState(constrain_state(model), first, hidden[:, -1], dstate, key, done, jnp.ones((), jnp.int32),
                      counters)
    return state, first


def generate_speculative(params, cfg: LingConfig, prompt, *, max_new_tokens: int, sampler, drafter, k: int,
                         aux: Any = None, seed: int = 0, backend: str = "reference", block_size: int = 8,
                         ignore_eos: bool = False, prefill_chunk: int | None = None) -> SpecResult:
    """prompt [B, T] host ints -> SpecResult; `aux` holds the drafter's arrays (the oracle's continuation, a draft
    model's params). `block_size` spec steps per dispatched executable; `prefill_chunk` as in `generate`."""
    params = as_params(params)  # a Flax LingForCausalLM runs on its own arrays
    check_config(cfg, backend)
    check_partitioning(params, backend)
    prepare(backend)
    if not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"k={k} drafts: choose 1 <= k <= {MAX_DRAFTS} (the verify kernels take k + 1 tokens)")
    drafter.check(aux, params, cfg)
    if getattr(drafter, "planned", False) and not isinstance(sampler, Greedy):
        raise ValueError(f"{type(drafter).__name__} plans greedy accept counts (a timing mode); sample with "
                         "Greedy(), or use a drafter that the acceptance rule judges")
    prompt = host_prompt(prompt, cfg)
    if max_new_tokens < 1 or block_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and block_size={block_size} must be >= 1")
    block_size = min(block_size, max(max_new_tokens - 1, 1))  # a step emits >= 1 token: more would be discarded
    # The last useful step may run k + 1 positions past the output's end; later steps' tokens are discarded.
    needed = prompt.shape[1] + max_new_tokens + k + 1
    if needed > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} + k + 1 exceeds the "
                         f"model's max_position_embeddings={cfg.max_position_embeddings}; shorten one of them")
    max_len = cache_len(needed)
    prefill_chunk = check_chunk(prefill_chunk)
    check_prefill_memory(params, cfg, *prompt.shape, prefill_chunk, max_len, backend)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    eos = jnp.asarray([] if ignore_eos else cfg.eos_token_ids, jnp.int32)
    n_blocks = -(-(max_new_tokens - 1) // block_size)  # a step emits >= 1 token
    statics = dict(cfg=cfg, sampler=sampler, drafter=drafter, backend=backend, pad_id=pad_id)
    prompt_dev, key, eos, aux = replicated((prompt, jax.random.key(seed), eos, aux), params["embed"])
    prompt_dev = jnp.asarray(prompt_dev)
    jax.block_until_ready((prompt_dev, key, eos, aux))

    with jax.transfer_guard("disallow"), _CompileCounter() as compiled:
        t0 = time.perf_counter()
        state, first = spec_start(params, aux, prompt_dev, key, eos, max_len=max_len, prefill_chunk=prefill_chunk,
                                  **statics)
        chunks = [host_values(first)[:, None]]
        t1 = time.perf_counter()
        pending, dispatched = None, 0
        for _ in range(n_blocks):
            state, out, count, done = spec_block(params, aux, state, eos, k=k, steps=block_size,
                                                 max_new=max_new_tokens, **statics)
            dispatched += 1
            if pending is not None and _collect(pending, chunks, max_new_tokens, ignore_eos):
                pending = None
                break
            pending = (out, count, done)
        if pending is not None:
            _collect(pending, chunks, max_new_tokens, ignore_eos)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        counters = host_values(state.counters)

    tokens = np.concatenate(chunks, axis=1)[:, :max_new_tokens]
    return SpecResult(_cut_after_eos(tokens, cfg.eos_token_ids, ignore_eos), t1 - t0, t2 - t1,
                      int(counters[VERIFY_STEPS]), int(counters[DRAFTED]), int(counters[ACCEPTED]), compiled.count,
                      int(counters[AGREED]), getattr(drafter, "planned", False), dispatched * block_size)


def _collect(pending, chunks: list, max_new_tokens: int, ignore_eos: bool) -> bool:
    """Copy a finished block's tokens to the host (this process's replica); True when the output is complete (stop
    dispatching)."""
    out, count, done = host_values(pending)
    chunks.append(out[:, :int(count)])
    return sum(c.shape[1] for c in chunks) >= max_new_tokens or (not ignore_eos and bool(done.all()))
