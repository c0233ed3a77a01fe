"""Decode state: one typed pytree holding everything a sequence carries between forwards.

    ModelState
      length   int32 []            tokens already in the caches (the next token's position)
      layers   tuple, one entry per layer:
                 KDACache  conv_window [B, W-1, 3, H, K] compute dtype  last W-1 pre-conv q|k|v rows
                           state       [B, H, K, V] float32             delta-rule state
                 MLACache  kv          [B, L, R + P] compute dtype      [normalised c_kv | rotated k_rope]
      mtp      MLACache | None     the MTP layer's own latent cache

`verify` returns a `StagedState` whose KDA entries hold every position's post-state (`KDAStaged`, design A in
DESIGN §3) and whose MLA caches already hold all T new positions; `commit(staged, n)` keeps the first n positions
with device-side indexing only. MLA slots past `length` are stale and are never read (masked by position).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.config import KDA, LingConfig
from pallas_kernels.kda import KDAStaged, kda_commit


class KDACache(NamedTuple):
    conv_window: jax.Array  # [B, W-1, 3, H, K]
    state: jax.Array  # [B, H, K, V] float32


class MLACache(NamedTuple):
    kv: jax.Array  # [B, L, R + P]


class ModelState(NamedTuple):
    length: jax.Array  # int32 []
    layers: tuple
    mtp: MLACache | None = None


class StagedState(NamedTuple):
    length: jax.Array  # int32 [], before the verified tokens
    layers: tuple  # KDAStaged | MLACache per layer
    mtp: MLACache | None = None


def kda_cache(cfg: LingConfig, batch: int, dtype) -> KDACache:
    H, K = cfg.num_heads, cfg.head_dim
    return KDACache(jnp.zeros((batch, cfg.conv_kernel_size - 1, 3, H, K), dtype),
                    jnp.zeros((batch, H, K, K), jnp.float32))


def mla_cache(cfg: LingConfig, batch: int, max_len: int, dtype) -> MLACache:
    return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype))


def init_state(cfg: LingConfig, batch: int, max_len: int, dtype, *, with_mtp: bool = False) -> ModelState:
    """Empty caches for sequences of up to `max_len` tokens."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}; shorten the prompt or the number of new tokens")
    layers = tuple(kda_cache(cfg, batch, dtype) if cfg.mixer_kind(i) == KDA else mla_cache(cfg, batch, max_len, dtype)
                   for i in range(cfg.num_layers))
    mtp = mla_cache(cfg, batch, max_len, dtype) if with_mtp and cfg.num_mtp_layers else None
    return ModelState(jnp.zeros((), jnp.int32), layers, mtp)


def max_len_of(state: ModelState) -> int:
    for entry in state.layers:
        if isinstance(entry, MLACache):
            return entry.kv.shape[1]
    raise ValueError("state has no MLA layer, so it has no length limit")


def commit(staged: StagedState, n: jax.Array) -> ModelState:
    """Keep the first `n` (device int32, 1 <= n <= T) verified positions."""
    n = jnp.asarray(n, jnp.int32)
    layers = tuple(KDACache(*kda_commit(e, n)) if isinstance(e, KDAStaged) else e for e in staged.layers)
    return ModelState(staged.length + n, layers, staged.mtp)
