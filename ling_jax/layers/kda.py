"""Kimi Delta Attention layer (docs/model.md §3.2): projections here, everything between them in pallas_kernels.kda.

The op boundary is the same for all modes: pre-conv q|k|v, gate input f, beta logits b and output gate z go in;
the gated-RMSNorm output comes back. So a fused decode kernel (conv + L2 norm + gate + delta step + norm) and the
chunked prefill can replace the reference one mode at a time.
"""

import functools

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling_jax.cache import KDACache
from ling_jax.config import LingConfig
from ling_jax.layers.linear import proj
from ling_jax.sharding import TP, per_shard
from pallas_kernels import kda as kda_ops

_MODES = {"prefill": kda_ops.kda_prefill, "decode": kda_ops.kda_decode, "verify": kda_ops.kda_verify}

# Every KDA head is independent, so a kernel runs per shard of heads. Layouts: qkv and conv window
# [B, T|W-1, 3, H, K]; f, z [B, T, H, K]; b [B, T, H]; state [B, H, K, V]; conv_w [W, 3, H, K]; A_log [H];
# dt_bias [H, K]; o_norm [K] (shared by heads).
_ROWS = P(None, None, None, TP, None)
_HEADS = P(None, None, TP, None)
_STATE = P(None, TP, None, None)
_IN_SPECS = (_ROWS, _HEADS, P(None, None, TP), _HEADS, _ROWS, _STATE, _HEADS, P(TP), P(TP, None), P())
_STAGED_SPEC = kda_ops.KDAStaged(_ROWS, states=P(None, None, TP, None, None), backend="pallas")


def kda_block(p: dict, x: jnp.ndarray, cache: KDACache, cfg: LingConfig, *, mode: str, backend: str):
    """x [B, T, D] -> (out [B, T, D], KDACache | KDAStaged)."""
    qkv = jnp.stack([proj("btd,dhk->bthk", x, p[w]) for w in ("w_q", "w_k", "w_v")], axis=2)  # [B, T, 3, H, K]
    f = proj("btd,dhk->bthk", x, p["w_f"])
    b = proj("btd,dh->bth", x, p["w_b"])
    z = proj("btd,dhk->bthk", x, p["w_g"])
    conv_w = jnp.stack([p["conv_q"], p["conv_k"], p["conv_v"]], axis=1)  # [W, 3, H, K]
    args = (qkv, f, b, z, cache.conv_window, cache.state, conv_w, p["A_log"], p["dt_bias"], p["o_norm"])
    op = functools.partial(_MODES[mode], lower_bound=cfg.kda_lower_bound, eps=cfg.rms_norm_eps, backend=backend)
    if backend == "pallas":
        out_specs = (_HEADS, _STAGED_SPEC) if mode == "verify" else (_HEADS, _ROWS, _STATE)
        op = per_shard(op, _IN_SPECS, out_specs)
    if mode == "verify":
        y, new_cache = op(*args)
    else:
        y, window, state = op(*args)
        new_cache = KDACache(window, state)
    return proj("bthk,hkd->btd", y, p["w_o"]), new_cache
