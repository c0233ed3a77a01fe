"""Decode state: one typed pytree holding everything a sequence carries between forwards.

    ModelState
      length   int32 []            tokens already in the caches (the next token's position)
      layers   tuple, one entry per layer:
                 KDACache  conv_window [B, W-1, 3, H, K] compute dtype  last W-1 pre-conv q|k|v rows
                           state       [B, H, K, V] float32             delta-rule state
                 MLACache  kv          [B, L, R + P] compute dtype      [normalised c_kv | rotated k_rope]

    StagedState (what `verify` returns; `commit` turns it back into a ModelState)
      length   int32 []            tokens committed before the verified ones
      layers   tuple, one entry per layer:
                 KDAStaged conv_rows   [B, W-1+T, 3, H, K] compute dtype  old window ++ the T verified rows
                           states      [B, T, H, K, V] float32            post-state of every verified position
                 MLACache  (as above, already holding all T new positions)

L, the latent cache length, is the requested maximum rounded up to a multiple of CACHE_BUCKET: the Pallas MLA
kernel tiles L by 16, and bucketing keeps the number of compiled shapes small as prompt lengths vary. The MTP
layer's cache (`mla_cache`) is passed to `model.mtp_forward` explicitly; it is not part of ModelState yet.

`commit(staged, n)` keeps the first n verified positions with device-side indexing only (docs/design.md §2): a KDA
layer's window is `conv_rows[:, n : n+W-1]` and its state `states[:, n-1]`. MLA slots past `length` are stale and
are never read (masked by position).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.config import KDA, LingConfig
from pallas_kernels.kda import kda_commit


class KDACache(NamedTuple):
    conv_window: jax.Array  # [B, W-1, 3, H, K]
    state: jax.Array  # [B, H, K, V] float32


class KDAStaged(NamedTuple):
    """A KDA layer after verify: everything commit needs to pick the window and state after any position."""
    conv_rows: jax.Array  # [B, W-1+T, 3, H, K]: the window after position t is conv_rows[:, t+1 : t+W]
    states: jax.Array  # [B, T, H, K, V] float32


class MLACache(NamedTuple):
    kv: jax.Array  # [B, L, R + P]


class ModelState(NamedTuple):
    length: jax.Array  # int32 []
    layers: tuple


class StagedState(NamedTuple):
    length: jax.Array  # int32 [], before the verified tokens
    layers: tuple  # KDAStaged | MLACache per layer


CACHE_BUCKET = 256


def cache_len(max_len: int) -> int:
    """The latent-cache length allocated for sequences of up to `max_len` tokens."""
    return -(-max_len // CACHE_BUCKET) * CACHE_BUCKET


def kda_cache(cfg: LingConfig, batch: int, dtype) -> KDACache:
    H, K = cfg.num_heads, cfg.head_dim
    return KDACache(jnp.zeros((batch, cfg.conv_kernel_size - 1, 3, H, K), dtype),
                    jnp.zeros((batch, H, K, K), jnp.float32))


def mla_cache(cfg: LingConfig, batch: int, max_len: int, dtype) -> MLACache:
    return MLACache(jnp.zeros((batch, cache_len(max_len), cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype))


def init_state(cfg: LingConfig, batch: int, max_len: int, dtype) -> ModelState:
    """Empty caches for sequences of up to `max_len` tokens."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}; shorten the prompt or the number of new tokens")
    layers = tuple(kda_cache(cfg, batch, dtype) if cfg.mixer_kind(i) == KDA else mla_cache(cfg, batch, max_len, dtype)
                   for i in range(cfg.num_layers))
    return ModelState(jnp.zeros((), jnp.int32), layers)


def layers_capacity(layers: tuple) -> int | None:
    """Positions the latent caches hold (static: their length axis); None when no layer has one (all KDA)."""
    lengths = {e.kv.shape[1] for e in layers if isinstance(e, MLACache)}
    return min(lengths) if lengths else None


def cache_capacity(state: ModelState | StagedState) -> int | None:
    return layers_capacity(state.layers)


def commit(staged: StagedState, n: jax.Array) -> ModelState:
    """Keep the first `n` (device int32 scalar, 1 <= n <= T) verified positions; no host read of n."""
    n = jnp.asarray(n, jnp.int32)
    if n.ndim != 0:
        raise ValueError(f"n.shape={n.shape}: commit keeps one count for the whole batch (the sequences share "
                         "one length); pass an int32 scalar")
    layers = tuple(KDACache(*kda_commit(e.conv_rows, e.states, n)) if isinstance(e, KDAStaged) else e
                   for e in staged.layers)
    return ModelState(staged.length + n, layers)
