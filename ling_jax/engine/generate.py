"""Generation: prefill, then decode in jitted blocks of a static number of steps.

Nothing inside a block reads a device value on the host: a block is one `lax.fori_loop` with a static trip count
over the decode step, EOS is a mask (`done |= token in eos`; finished sequences emit the pad id), and there is no
`lax.cond` or data-dependent `while_loop` (each would make XLA copy a predicate to the host and wait). The host
reads a block's tokens only after the next block has been dispatched, so the device never idles on the host
("one block late"); that read is also where an all-finished batch stops early.

    LoopState                     (donated to every block)
      model  ModelState           caches + length
      last   int32 [B]            token to feed next
      done   bool [B]             sequence has emitted an EOS
      key    PRNG key             split once per step by a sampling sampler; greedy passes it through
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.backends import check_config, check_partitioning, prepare
from ling_jax.cache import ModelState, cache_len
from ling_jax.config import LingConfig
from ling_jax.engine.sampling import Greedy
from ling_jax.model import check_chunk, check_prefill_memory, decode_forward, prefill
from ling_jax.params import as_params
from ling_jax.sharding import constrain_state, host_values, replicated


# jax.monitoring's event for one XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT; a test pins that it fires).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class LoopState(NamedTuple):
    model: ModelState
    last: jax.Array
    done: jax.Array
    key: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: list[list[int]]  # new tokens per sequence, cut after the first EOS (kept) unless ignore_eos
    ttft_s: float  # prefill + first token on the host
    decode_s: float  # from the first token on the host to the last block's tokens on the host
    steps: int  # decode steps run in that time (whole blocks; may exceed the tokens kept)
    compiles: int = 0  # executables compiled inside the timed region: 0 means the times exclude compilation

    @property
    def tpot_s(self) -> float | None:
        """SGLang's TPOT, (latency - TTFT) / (output tokens - 1), over the first sequence's kept tokens; None
        for a single token (no decode step)."""
        n = len(self.tokens[0])
        return self.decode_s / (n - 1) if n > 1 else None

    @property
    def tokens_per_s(self) -> float:
        """Kept tokens of the first sequence over the whole wall time."""
        return len(self.tokens[0]) / (self.ttft_s + self.decode_s)


def _mask_eos(token: jax.Array, done: jax.Array, eos: jax.Array, pad_id: int):
    token = jnp.where(done, pad_id, token)
    return token, done | jnp.isin(token, eos)


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "max_len", "backend", "pad_id", "prefill_chunk"))
def start(params, prompt, key, eos, cfg: LingConfig, sampler, *, max_len: int, backend: str, pad_id: int,
          prefill_chunk: int | None = None):
    """Prefill and pick the first token -> (LoopState, first token [B])."""
    logits, model, _ = prefill(params, prompt, cfg, max_len=max_len, backend=backend, chunk=prefill_chunk)
    key, sub = jax.random.split(key)
    first = sampler.sample(logits[:, -1], sub)
    first, done = _mask_eos(first, jnp.zeros(first.shape, bool), eos, pad_id)
    return LoopState(constrain_state(model), first, done, key), first


def sample_step(params, loop: LoopState, eos, cfg: LingConfig, sampler, *, backend: str, pad_id: int):
    """Feed `loop.last`, sample the next token -> (LoopState, token [B]). Greedy takes the argmax inside the
    lm_head (`ling_jax.model.greedy_tokens`): the step never writes the logits."""
    if isinstance(sampler, Greedy):
        # The key passes through untouched: a new one would be a fresh buffer XLA copies back into the loop's.
        key = loop.key
        token, model, _ = decode_forward(params, loop.model, loop.last, cfg, backend=backend, head="greedy")
    else:
        key, sub = jax.random.split(loop.key)
        logits, model, _ = decode_forward(params, loop.model, loop.last, cfg, backend=backend)
        token = sampler.sample(logits, sub)
    token, done = _mask_eos(token, loop.done, eos, pad_id)
    return LoopState(model, token, done, key), token


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "steps", "backend", "pad_id"),
                   donate_argnames=("loop",))
def decode_block(params, loop: LoopState, eos, cfg: LingConfig, sampler, *, steps: int, backend: str,
                 pad_id: int):
    """`steps` decode steps in one executable -> (LoopState, tokens [B, steps], done [B])."""
    out = jnp.zeros((loop.last.shape[0], steps), jnp.int32)

    def body(i, carry):
        loop, out = carry
        loop, token = sample_step(params, loop, eos, cfg, sampler, backend=backend, pad_id=pad_id)
        return loop, jax.lax.dynamic_update_slice(out, token[:, None], (0, i))

    loop, out = jax.lax.fori_loop(0, steps, body, (loop, out))
    return loop, out, loop.done


def generate(params, cfg: LingConfig, prompt, *, max_new_tokens: int, sampler, seed: int = 0,
             backend: str = "reference", block_size: int = 16, ignore_eos: bool = False,
             prefill_chunk: int | None = None) -> GenerateResult:
    """prompt: [B, T] ints (host) -> GenerateResult. Times come from host clocks around blocking reads.

    The latent caches are sized here from the prompt and `max_new_tokens`, so no step can outgrow them.
    `prefill_chunk`: prompt tokens per prefill forward (model.PREFILL_CHUNK by default; model.prefill).
    """
    params = as_params(params)  # a Flax LingForCausalLM runs on its own arrays
    check_config(cfg, backend)  # raises on an unknown backend spec or sizes its kernels cannot take
    check_partitioning(params, backend)
    prepare(backend)
    prompt = host_prompt(prompt, cfg)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    # Steps past the last token asked for would only be discarded; the prefill gives the first token.
    block_size = min(block_size, max(max_new_tokens - 1, 1))
    if prompt.shape[1] + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}; shorten one of them")
    n_blocks = -(-(max_new_tokens - 1) // block_size)
    # Bucketed, so prompts of similar length share compiled executables; the last block's steps past
    # max_new_tokens are discarded, so only the tokens kept must fit the model's positions.
    max_len = min(cache_len(prompt.shape[1] + 1 + n_blocks * block_size), cfg.max_position_embeddings)
    prefill_chunk = check_chunk(prefill_chunk)
    check_prefill_memory(params, cfg, *prompt.shape, prefill_chunk, max_len, backend)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    eos = jnp.asarray([] if ignore_eos else cfg.eos_token_ids, jnp.int32)
    prompt_dev, key, eos = replicated((prompt, jax.random.key(seed), eos), params["embed"])
    prompt_dev = jnp.asarray(prompt_dev)
    jax.block_until_ready((prompt_dev, key, eos))

    with jax.transfer_guard("disallow"), _CompileCounter() as compiled:
        t0 = time.perf_counter()
        loop, first = start(params, prompt_dev, key, eos, cfg, sampler, max_len=max_len, backend=backend,
                            pad_id=pad_id, prefill_chunk=prefill_chunk)
        chunks = [host_values(first)[:, None]]
        t1 = time.perf_counter()
        pending, steps = None, 0
        for _ in range(n_blocks):
            loop, block_tokens, done = decode_block(params, loop, eos, cfg, sampler, steps=block_size,
                                                    backend=backend, pad_id=pad_id)
            steps += block_size
            if pending is not None and _collect(pending, chunks, ignore_eos):
                pending = None
                break
            pending = (block_tokens, done)
        if pending is not None:
            _collect(pending, chunks, ignore_eos)
        jax.block_until_ready(loop)
        t2 = time.perf_counter()

    tokens = np.concatenate(chunks, axis=1)[:, :max_new_tokens]
    return GenerateResult(_cut_after_eos(tokens, cfg.eos_token_ids, ignore_eos), t1 - t0, t2 - t1, steps,
                          compiled.count)


def host_prompt(prompt, cfg: LingConfig) -> np.ndarray:
    """`prompt` as an int32 [B, T] host array of ids in the vocabulary, or a ValueError saying what is wrong."""
    try:
        prompt = np.asarray(prompt)
    except ValueError:
        raise ValueError("prompt rows differ in length: generate takes one [batch, T] array; run prompts of "
                         "different lengths as separate calls") from None
    if not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
        raise ValueError(f"prompt dtype {prompt.dtype} must be integer token ids")
    prompt = prompt.astype(np.int32)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt shape {prompt.shape} must be [batch, T] with T >= 1")
    if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}); got [{prompt.min()}, {prompt.max()}]")
    return prompt


class _CompileCounter:
    """Counts XLA compilations while active (jax.monitoring's backend-compile event), so a result can say whether
    its times include compilation."""
    _active: list = []
    _registered = False

    def __enter__(self):
        if not _CompileCounter._registered:
            jax.monitoring.register_event_duration_secs_listener(_CompileCounter._on_event)
            _CompileCounter._registered = True
        self.count = 0
        _CompileCounter._active.append(self)
        return self

    def __exit__(self, *exc):
        _CompileCounter._active.remove(self)

    @staticmethod
    def _on_event(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            for counter in _CompileCounter._active:
                counter.count += 1


def _collect(pending, chunks: list, ignore_eos: bool) -> bool:
    """Copy a finished block to the host (this process's replica); True when every sequence is done (stop
    dispatching)."""
    block_tokens, done = host_values(pending)
    chunks.append(block_tokens)
    return (not ignore_eos) and bool(done.all())


def _cut_after_eos(tokens: np.ndarray, eos_ids: tuple[int, ...], ignore_eos: bool) -> list[list[int]]:
    out = []
    for row in tokens.tolist():
        if not ignore_eos:
            for i, t in enumerate(row):
                if t in eos_ids:
                    row = row[: i + 1]
                    break
        out.append(row)
    return out
