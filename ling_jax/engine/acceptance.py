"""Lossless acceptance of speculative drafts, fully on device (no cond, no data-dependent loop).

One verify forward gives target logits [B, k + 1, V] for the last committed token and k drafts; position i's
logits predict the token in draft i's slot, position k's the token after the last draft. `accept` keeps a prefix
of the drafts and picks the token that follows it so that the committed tokens are distributed exactly as the
sampler would have produced them one by one: argmax equality for `Greedy`, rejection sampling (Leviathan et al.,
Chen et al.: "speculative sampling") for `TopP`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ling_jax.engine.sampling import Greedy


def sample_drafts(sampler, logits: jax.Array, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Draw draft tokens from a drafter's logits [..., V] -> (tokens [...] int32, q [..., V] float32).

    q is the distribution the tokens were drawn from (one-hot for Greedy), the `draft_probs` `accept` needs.
    """
    return sampler.sample(logits, key), jnp.exp(sampler.log_probs(logits))


def accept(sampler, target_logits: jax.Array, drafts: jax.Array, valid: jax.Array,
           draft_probs: jax.Array | None, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """-> (n_accepted [B] int32 in 0..k, next_token [B] int32); the step commits drafts[:, :n] + next_token.

    target_logits [B, k + 1, V]; drafts [B, k] int32; valid [B, k] bool (False: nothing proposed in that slot, so
    it is rejected and its token drawn from the target); draft_probs [B, k, V], the drafter's distribution for each
    draft, or None for a model-free drafter (one-hot at the draft); key: a PRNG key (unused by Greedy).
    The caches hold one length, so every row keeps the batch minimum of accepted drafts; a row that accepted more
    emits its own accepted draft in the next slot, which is a target sample there, so each row stays lossless.
    """
    _check_arguments(sampler, target_logits, drafts, valid, draft_probs, key)
    drafts = jnp.where(valid, drafts.astype(jnp.int32), 0)  # an unproposed slot may hold any id, even out of range
    return _accept(sampler, target_logits, drafts, valid, draft_probs, key)


def accept_greedy(target: jax.Array, drafts: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`accept` for `Greedy` from the target's greedy tokens [B, k + 1] (the verify forward's fused greedy head,
    which on Pallas writes no logits: `model.forward(head="greedy")`, the lowest id among equal maxima as
    `Greedy`)."""
    if drafts.ndim != 2 or target.shape != (drafts.shape[0], drafts.shape[1] + 1):
        raise ValueError(f"target has shape {target.shape} and drafts {drafts.shape}; pass drafts [batch, k] and the "
                         "target's greedy tokens [batch, k + 1]: the last committed token's, then one per draft")
    if valid.shape != drafts.shape:
        raise ValueError(f"valid has shape {valid.shape}; pass a bool mask shaped like drafts, {drafts.shape}")
    drafts = jnp.where(valid, drafts.astype(jnp.int32), 0)
    return _shared_count(*_greedy_prefix(target.astype(jnp.int32), drafts, valid), drafts)


def accept_planned(target: jax.Array, drafts: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A planned count: n [] drafts kept whatever the target says, then the target's greedy token at position n ->
    (n [B], next_token [B]), as `accept` returns them. A timing mode (drafters.PlannedDrafter), not lossless."""
    n = jnp.broadcast_to(n, drafts.shape[:1]).astype(jnp.int32)
    return n, _at(target.astype(jnp.int32), n)


def _accept(sampler, target_logits, drafts, valid, draft_probs, key, *, exact_residual: bool = True):
    """`accept` after argument checks; exact_residual False (a bool, or a traced one so that both variants share an
    executable) draws rejections from p instead of (p - q)+, which is wrong and exists only so tests can show that
    their distribution check catches it."""
    if isinstance(sampler, Greedy):
        n, token = _accept_greedy(sampler, target_logits, drafts, valid)
    else:
        n, token = _accept_sampled(sampler.log_probs(target_logits), drafts, valid, draft_probs, key,
                                   exact_residual=exact_residual)
    return _shared_count(n, token, drafts)


def _accept_greedy(sampler, target_logits, drafts, valid):
    return _greedy_prefix(sampler.sample(target_logits, None), drafts, valid)


def _greedy_prefix(target, drafts, valid):
    """target [B, k + 1] greedy tokens -> (accepted drafts [B], the target's token after them [B])."""
    n = _leading_true(valid & (drafts == target[:, :-1]))
    return n, _at(target, n)


def _accept_sampled(log_p, drafts, valid, draft_probs, key, *, exact_residual: bool):
    k, vocab = drafts.shape[1], log_p.shape[-1]
    p = jnp.exp(log_p)  # [B, k + 1, V]
    q = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32) if draft_probs is None else draft_probs.astype(jnp.float32)
    q = jnp.where(valid[..., None], q, 0.0)  # nothing proposed: the residual (p - 0)+ is p itself
    p_draft = _at(p[:, :k], drafts)
    q_draft = _at(q, drafts)
    accept_key, token_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, drafts.shape)
    # u < p/q written without the division: q(d) = 0 < p(d) accepts (ratio +inf), p(d) = 0 always rejects.
    n = _leading_true(valid & (u * q_draft < p_draft))
    residual = jnp.where(exact_residual, jnp.maximum(p[:, :k] - q, 0.0), p[:, :k])
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # Zero mass means p == q, where no rejection can happen; p keeps the unreachable branch finite.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[:, :k])
    follow = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k + 1, V]: what comes after n accepted drafts
    chosen = jnp.take_along_axis(follow, n[:, None, None], axis=1)[:, 0]
    return n, jax.random.categorical(token_key, jnp.log(chosen), axis=-1).astype(jnp.int32)


def _leading_true(mask):
    """[B, k] bool -> [B] int32: how many leading entries are True."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _at(values, index):
    """values [B, k, ...] indexed along axis 1 (index [B]) or along the last axis (index [B, k])."""
    if index.ndim == 1:
        return jnp.take_along_axis(values, index[:, None], axis=1)[:, 0]
    return jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0]


def _shared_count(n, token, drafts):
    """Cut every row to the batch minimum; the token in that slot is the row's draft if it accepted beyond it."""
    kept = jnp.min(n)
    emitted = jnp.concatenate([drafts, token[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(emitted.shape[1]) < n[:, None], emitted, token[:, None])
    return jnp.broadcast_to(kept, n.shape).astype(jnp.int32), emitted[:, kept]


def _check_arguments(sampler, target_logits, drafts, valid, draft_probs, key):
    if drafts.ndim != 2:
        raise ValueError(f"drafts has shape {drafts.shape}; pass [batch, k] token ids")
    batch, k = drafts.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_logits has shape {target_logits.shape}; with drafts [{batch}, {k}] pass "
                         f"[{batch}, {k + 1}, vocab]: the last committed token's logits, then one per draft")
    if valid.shape != drafts.shape:
        raise ValueError(f"valid has shape {valid.shape}; pass a bool mask shaped like drafts, {drafts.shape}")
    vocab = target_logits.shape[-1]
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs has shape {draft_probs.shape}; pass [{batch}, {k}, {vocab}] (the drafter's "
                         "distribution per draft, from sample_drafts) or None for a model-free drafter")
    if key is None and not isinstance(sampler, Greedy):
        raise ValueError(f"key is None but {sampler} samples; pass a jax.random key")
