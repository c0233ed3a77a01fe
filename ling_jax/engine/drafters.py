"""Drafters for `engine.speculative`: each a frozen dataclass (a static jit argument) whose state lives in the
SpecState and whose arrays (a continuation, a draft model's params) come in as `aux`, a jit argument.

    check(aux, params, cfg)   raises, before anything is traced, on inputs the drafter cannot run
    init(aux, params, cfg, prompt [B, T], first [B], hidden [B, T, D], max_len, backend) -> state
    propose(aux, params, cfg, spec, k, sampler, key, backend) -> (drafts [B, k], valid [B, k], q [B, k, V] | None,
                                                                  state)
    observe(aux, params, cfg, spec, state, emitted [B, k+1], n_keep [], verify_hidden [B, k+1, D], backend) -> state

`spec` is the SpecState at the start of the step (its `last`, `model.length`, `hidden`, `emitted`); `q` is the
distribution the drafts were drawn from (None: model-free, one-hot); `observe` sees the step's emitted tokens, of
which the first `n_keep` are committed, and the target's hidden states at the k + 1 verified positions.

    OracleDrafter   replays a given continuation, optionally corrupted at chosen output positions
    PlannedDrafter  replays a given continuation at a planned accept count per step (timing; not lossless)
    MTPDrafter      the checkpoint's NextN layer chained k times over its own MLA cache
    ModelDrafter    a separate, smaller Ling model drafting autoregressively with its own caches
    Suffix          model-free: the most frequent continuation of the longest suffix match (engine/suffix.py)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.cache import MLACache, StagedState, commit, mla_cache
from ling_jax.config import LingConfig
from ling_jax.engine import acceptance
from ling_jax.engine.suffix import SuffixDrafter
from ling_jax.model import decode_forward, forward, mtp_forward, prefill


def _replay_positions(continuation, emitted, k):
    """The continuation's k positions after the `emitted` tokens, clamped to its last ([k] int32), and which of them
    it holds ([k] bool)."""
    idx = emitted + jnp.arange(k)
    return jnp.minimum(idx, continuation.shape[1] - 1), idx < continuation.shape[1]


def _pair_shapes(aux):
    """The shapes of a pair of arrays (None for a non-array), or None when aux is not a pair."""
    return [getattr(a, "shape", None) for a in aux] if isinstance(aux, tuple) and len(aux) == 2 else None


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Drafts the given output: aux = (continuation [B, M] int32, the whole expected output, the first token at index
    0; corrupt [B, M] bool, positions drafted wrong on purpose). Past the continuation's end nothing is proposed."""

    def check(self, aux, params, cfg):
        shapes = _pair_shapes(aux)
        if shapes is None or len(shapes[0] or ()) != 2 or shapes[0] != shapes[1]:
            raise ValueError("the oracle drafter replays a given continuation: pass aux=(continuation [B, M] int32, "
                             "corrupt [B, M] bool), the expected output from its first token on")

    def init(self, aux, params, cfg, prompt, first, hidden, max_len, backend):
        return ()

    def propose(self, aux, params, cfg, spec, k, sampler, key, backend):
        continuation, corrupt = aux
        at, inside = _replay_positions(continuation, spec.emitted, k)
        drafts = jnp.where(corrupt[:, at], (continuation[:, at] + 1) % cfg.vocab_size, continuation[:, at])
        return drafts.astype(jnp.int32), jnp.broadcast_to(inside, drafts.shape), None, ()

    def observe(self, aux, params, cfg, spec, state, emitted, n_keep, verify_hidden, backend):
        return ()


@dataclasses.dataclass(frozen=True)
class PlannedDrafter:
    """A timing mode: drafts a given continuation and commits a planned number of them per step, whatever the
    verify's argmax says; the token after them is the verify's own at that position. A step then does the work a
    real drafter at the plan's accept length would, also where the verify's argmax leaves the continuation (bf16
    and FP8 rounding at full size), but the output is not the target's greedy output. aux = (continuation [B, M]
    int32, the expected output from its first token on; plan [S] int32, drafts accepted at verify step j, each in
    0..k, the last one repeated past S). Greedy only."""

    planned = True  # engine.speculative: the step takes `planned_count` instead of the acceptance rule

    def check(self, aux, params, cfg):
        shapes = _pair_shapes(aux)
        if shapes is None or len(shapes[0] or ()) != 2 or len(shapes[1] or ()) != 1 or shapes[1][0] < 1:
            raise ValueError("the planned drafter replays a continuation at a planned accept count: pass "
                             "aux=(continuation [B, M] int32, plan [S] int32 drafts accepted per step, S >= 1)")
        if not isinstance(aux[1], jax.core.Tracer) and int(jnp.min(aux[1])) < 0:
            raise ValueError(f"the plan holds {int(jnp.min(aux[1]))} accepted drafts at a step; each count must lie "
                             "in 0..k (counts above k are capped at k)")

    def init(self, aux, params, cfg, prompt, first, hidden, max_len, backend):
        return ()

    def propose(self, aux, params, cfg, spec, k, sampler, key, backend):
        continuation, _ = aux
        at, inside = _replay_positions(continuation, spec.emitted, k)
        # Past the continuation's end its last token is drafted and committed as planned, but not counted as drafted.
        return continuation[:, at].astype(jnp.int32), jnp.broadcast_to(inside, (continuation.shape[0], k)), None, ()

    def planned_count(self, aux, steps, k):
        """Drafts to accept at verify step `steps` (a device int32 []): plan[steps], capped at k."""
        plan = aux[1]
        return jnp.minimum(plan[jnp.minimum(steps, plan.shape[0] - 1)], k).astype(jnp.int32)

    def observe(self, aux, params, cfg, spec, state, emitted, n_keep, verify_hidden, backend):
        return ()


class MTPState(NamedTuple):
    cache: MLACache  # the NextN layer's latent cache; its position i holds the pair (hidden_i, token_{i+1})
    logits: jax.Array  # [B, V] the NextN prediction of the token after `last`: the next step's first draft
    hidden: jax.Array  # [B, D] the NextN output that produced it (the input of the chained second draft)


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    """The NextN layer as SGLang's NEXTN runs it: the first draft comes from the pair (target hidden at length - 1,
    last); drafts 2..k chain the layer's own output. After verify the layer re-reads the committed pairs with the
    target's true hidden states (one forward over k + 2 pairs), which also gives the next step's first draft."""

    def check(self, aux, params, cfg):
        _require_mtp(params)

    def init(self, aux, params, cfg, prompt, first, hidden, max_len, backend):
        tokens = jnp.concatenate([prompt[:, 1:], first[:, None]], axis=1)
        cache = mla_cache(cfg, prompt.shape[0], max_len, params["embed"].dtype)
        logits, out, cache = mtp_forward(params, hidden, tokens, cache, jnp.int32(0), cfg, mode="prefill",
                                         backend=backend)
        return MTPState(cache, logits[:, -1], out[:, -1])

    def propose(self, aux, params, cfg, spec, k, sampler, key, backend):
        state = spec.drafter
        keys = jax.random.split(key, k)
        token, q = acceptance.sample_drafts(sampler, state.logits, keys[0])
        drafts, qs, h, cache = [token], [q], state.hidden, state.cache
        for j in range(1, k):
            logits, out, cache = mtp_forward(params, h[:, None], token[:, None], cache, spec.model.length - 1 + j,
                                             cfg, mode="decode", backend=backend)
            token, q = acceptance.sample_drafts(sampler, logits[:, 0], keys[j])
            drafts.append(token)
            qs.append(q)
            h = out[:, 0]
        drafts = jnp.stack(drafts, axis=1)
        return drafts, jnp.ones(drafts.shape, bool), jnp.stack(qs, axis=1), state._replace(cache=cache)

    def observe(self, aux, params, cfg, spec, state, emitted, n_keep, verify_hidden, backend):
        hidden = jnp.concatenate([spec.hidden[:, None], verify_hidden], axis=1)  # positions length-1 .. length+k
        tokens = jnp.concatenate([spec.last[:, None], emitted], axis=1)
        logits, out, cache = mtp_forward(params, hidden, tokens, state.cache, spec.model.length - 1, cfg,
                                         mode="verify", backend=backend)
        return MTPState(cache, logits[:, n_keep], out[:, n_keep])


def _require_mtp(params) -> None:
    if "mtp" not in params:
        raise ValueError("the MTP drafter needs the checkpoint's NextN layer, and these params have none "
                         "(num_nextn_predict_layers=0, or loaded with with_mtp=False): load it with with_mtp=True, "
                         "or choose another drafter")


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A separate Ling model (`cfg`, its params in aux) with the target's vocabulary: k decode steps propose, then one
    verify over the k + 1 fed tokens from its pre-step state, committed like the target's."""
    cfg: LingConfig
    backend: str = "reference"

    def check(self, aux, params, cfg):
        check_draft_model(cfg, self.cfg)
        if not isinstance(aux, dict) or "embed" not in aux:
            raise ValueError("the model drafter needs its params as aux (the pytree `load_hf` or `init_params` "
                             "returns for its config)")

    def init(self, aux, params, cfg, prompt, first, hidden, max_len, backend):
        _, state, _ = prefill(aux, prompt, self.cfg, max_len=max_len, backend=self.backend)
        return state

    def propose(self, aux, params, cfg, spec, k, sampler, key, backend):
        state, token, drafts, qs = spec.drafter, spec.last, [], []
        for j, sub in enumerate(jax.random.split(key, k)):
            logits, state, _ = decode_forward(aux, state, token, self.cfg, backend=self.backend)
            token, q = acceptance.sample_drafts(sampler, logits, sub)
            drafts.append(token)
            qs.append(q)
        drafts = jnp.stack(drafts, axis=1)
        return drafts, jnp.ones(drafts.shape, bool), jnp.stack(qs, axis=1), spec.drafter

    def observe(self, aux, params, cfg, spec, state, emitted, n_keep, verify_hidden, backend):
        fed = jnp.concatenate([spec.last[:, None], emitted[:, :-1]], axis=1)  # its first n_keep are committed
        _, _, layers = forward(aux, fed, state.layers, state.length, self.cfg, mode="verify", backend=self.backend)
        return commit(StagedState(state.length, layers), n_keep)


@dataclasses.dataclass(frozen=True)
class Suffix:
    """`suffix.SuffixDrafter` over every committed token (prompt and output); its drafts are one-hot."""
    drafter: SuffixDrafter = SuffixDrafter()

    def check(self, aux, params, cfg):
        pass

    def init(self, aux, params, cfg, prompt, first, hidden, max_len, backend):
        return self.drafter.init(jnp.concatenate([prompt, first[:, None]], axis=1))

    def propose(self, aux, params, cfg, spec, k, sampler, key, backend):
        drafts, valid = self.drafter.propose(spec.drafter, k)
        return drafts, valid, None, spec.drafter

    def observe(self, aux, params, cfg, spec, state, emitted, n_keep, verify_hidden, backend):
        return self.drafter.observe(state, emitted, n_keep)


def check_draft_model(cfg: LingConfig, draft_cfg: LingConfig) -> None:
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft_cfg.vocab_size} differs from the target's "
                         f"{cfg.vocab_size}: a draft model must share the target's tokenizer")


Drafter = Any  # OracleDrafter | MTPDrafter | ModelDrafter | Suffix (the protocol above)
