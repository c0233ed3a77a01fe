"""Kimi Delta Attention layer (SPEC §2.2): projections here, everything between them in pallas_kernels.kda.

The op boundary is the same for all modes: pre-conv q|k|v, gate input f, beta logits b and output gate z go in;
the gated-RMSNorm output comes back. So a fused decode kernel (conv + L2 norm + gate + delta step + norm) and the
chunked prefill can replace the reference one mode at a time.
"""

import jax.numpy as jnp

from ling_jax.cache import KDACache
from ling_jax.config import LingConfig
from ling_jax.layers.linear import proj
from pallas_kernels import kda as kda_ops

_MODES = {"prefill": kda_ops.kda_prefill, "decode": kda_ops.kda_decode, "verify": kda_ops.kda_verify}


def kda_block(p: dict, x: jnp.ndarray, cache: KDACache, cfg: LingConfig, *, mode: str, backend: str):
    """x [B, T, D] -> (out [B, T, D], KDACache | KDAStaged)."""
    qkv = jnp.stack([proj("btd,dhk->bthk", x, p[w]) for w in ("w_q", "w_k", "w_v")], axis=2)  # [B, T, 3, H, K]
    f = proj("btd,dhk->bthk", x, p["w_f"])
    b = proj("btd,dh->bth", x, p["w_b"])
    z = proj("btd,dhk->bthk", x, p["w_g"])
    conv_w = jnp.stack([p["conv_q"], p["conv_k"], p["conv_v"]], axis=1)  # [W, 3, H, K]
    args = (qkv, f, b, z, cache.conv_window, cache.state, conv_w, p["A_log"], p["dt_bias"], p["o_norm"])
    kw = dict(lower_bound=cfg.kda_lower_bound, eps=cfg.rms_norm_eps, backend=backend)
    if mode == "verify":
        y, new_cache = kda_ops.kda_verify(*args, **kw)
    else:
        y, window, state = _MODES[mode](*args, **kw)
        new_cache = KDACache(window, state)
    return proj("bthk,hkd->btd", y, p["w_o"]), new_cache
