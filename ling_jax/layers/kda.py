"""Kimi Delta Attention layer (docs/model.md §3.2): projections here, everything between them in pallas_kernels.kda.

The op boundary is the same for all modes: pre-conv q|k|v, gate input f, beta logits b and output gate z go in;
the gated-RMSNorm output comes back. So a fused decode kernel (conv + L2 norm + gate + delta step + norm) and the
chunked prefill can replace the reference one mode at a time.
"""

import functools

import jax.numpy as jnp

from ling_jax.cache import KDACache, KDAStaged
from ling_jax.config import LingConfig
from ling_jax.layers.linear import proj
from ling_jax.params import kda_specs
from ling_jax.sharding import logical_to_spec, per_shard
from pallas_kernels import kda as kda_ops

# A later prefill chunk ("extend") is the chunked prefill from the state and window the previous chunk left.
_MODES = {"prefill": kda_ops.kda_prefill, "extend": kda_ops.kda_prefill, "decode": kda_ops.kda_decode,
          "verify": kda_ops.kda_verify}

# Every KDA head is independent, so a kernel runs per shard of heads. The activations' and states' layouts (the
# params' come from their declared axes):
_ROWS = logical_to_spec((None, None, None, "heads", None))  # qkv, conv window, conv_rows [B, T | W-1 | W-1+T, 3, H, K]
_PER_HEAD = logical_to_spec((None, None, "heads", None))  # f, z, y [B, T, H, K]
_BETA = logical_to_spec((None, None, "heads"))  # b [B, T, H]
_STATE = logical_to_spec((None, "heads", None, None))  # [B, H, K, V]
_STATES = logical_to_spec((None, None, "heads", None, None))  # verify's per-position states [B, T, H, K, V]


def _in_specs(cfg: LingConfig) -> tuple:
    """Specs of the op's arguments, in the order of the dispatch signature."""
    axes = {name: spec.axes for name, spec in kda_specs(cfg).items()}
    taps = axes["conv_q"]  # [W, H, K]; the op takes q|k|v stacked at axis 1
    params = [logical_to_spec(taps[:1] + (None,) + taps[1:])] + [logical_to_spec(axes[n])
                                                                 for n in ("A_log", "dt_bias", "o_norm")]
    return (_ROWS, _PER_HEAD, _BETA, _PER_HEAD, _ROWS, _STATE, *params)


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
        out_specs = (_PER_HEAD, _ROWS, _STATES if mode == "verify" else _STATE)
        op = per_shard(op, _in_specs(cfg), out_specs)
    y, rows, state = op(*args)
    new_cache = KDAStaged(rows, state) if mode == "verify" else KDACache(rows, state)
    return proj("bthk,hkd->btd", y, p["w_o"]), new_cache
