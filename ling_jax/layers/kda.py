"""Kimi Delta Attention layer (docs/model.md §3.2): projections here, everything between them in pallas_kernels.kda.

The op boundary is the same for all modes: pre-conv q|k|v, gate input f, beta logits b and output gate z go in;
the gated-RMSNorm output comes back. So a fused decode kernel (conv + L2 norm + gate + delta step + norm) and the
chunked prefill can replace the reference one mode at a time. Decode and verify pass the fused projection's
output packed as it is ([B, T, H, 5K+1]), which their kernel reads at each part's offset, so no slice or q|k|v
stack runs between the two launches; prefill and extend split it into the parts.
"""

import functools

import jax
import jax.numpy as jnp

from ling_jax.cache import KDACache, KDAStaged
from ling_jax.config import LingConfig
from ling_jax.layers.linear import dense
from ling_jax.params import kda_in_parts, kda_specs, param_axes
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
_PACKED = _PER_HEAD  # decode / verify's packed projection output [B, T, H, 5K+1]
_STATE = logical_to_spec((None, "heads", None, None))  # [B, H, K, V]
_STATES = logical_to_spec((None, None, "heads", None, None))  # verify's per-position states [B, T, H, K, V]


def _in_specs(cfg: LingConfig, packed: bool = False) -> tuple:
    """Specs of the op's arguments, in the order of the dispatch signature."""
    axes = param_axes(kda_specs(cfg))
    params = [logical_to_spec(axes[n]) for n in ("conv_qkv", "A_log", "dt_bias", "o_norm")]
    inputs = (_PACKED,) if packed else (_ROWS, _PER_HEAD, _BETA, _PER_HEAD)
    return (*inputs, _ROWS, _STATE, *params)


def split_inputs(y: jnp.ndarray, cfg: LingConfig) -> dict[str, jnp.ndarray]:
    """The fused projection's output [B, T, H, 5K + 1] -> its parts by name (q, k, v, f, g: [B, T, H, K]; b:
    [B, T, H, 1]), in w_in's per-head column order."""
    parts, start = {}, 0
    for name, width in kda_in_parts(cfg).items():
        parts[name] = y[..., start:start + width]
        start += width
    return parts


def kda_block(p: dict, h: jnp.ndarray, norm: tuple, cache: KDACache, cfg: LingConfig, *, mode: str, backend: str,
              gemv: str, residual: jnp.ndarray | None = None):
    """The block's input h [B, T, D], normalised by `norm` (weight, eps) -> (residual + out [B, T, D],
    KDACache | KDAStaged); `gemv` is the backend of the projections (ling_jax.layers.linear.dense)."""
    axes = param_axes(kda_specs(cfg))
    x = dense(h, p["w_in"], axes["w_in"], backend=gemv, norm=norm)  # [B, T, H, 5K + 1]
    packed = mode in ("decode", "verify")
    if packed:
        inputs = (x,)
    else:
        parts = split_inputs(x, cfg)
        qkv = jnp.stack([parts["q"], parts["k"], parts["v"]], axis=2)  # [B, T, 3, H, K]
        inputs = (qkv, parts["f"], parts["b"][..., 0], parts["g"])
    args = (*inputs, cache.conv_window, cache.state, p["conv_qkv"], p["A_log"], p["dt_bias"], p["o_norm"])
    op = functools.partial(_MODES[mode], lower_bound=cfg.kda_lower_bound, eps=cfg.rms_norm_eps, backend=backend)
    if backend == "pallas":
        y_spec = _PER_HEAD
        if packed:  # the gated norm's per-head RMS scale left to o_proj's GEMV prologue (a GroupRMS y): no launch
            op = functools.partial(op, defer_norm=True)
            y_spec = jax.tree.map(lambda _: _PER_HEAD, jax.eval_shape(op, *args)[0])  # its values and sums per head
        op = per_shard(op, _in_specs(cfg, packed), (y_spec, _ROWS, _STATES if mode == "verify" else _STATE))
    y, rows, state = op(*args)
    new_cache = KDAStaged(rows, state) if mode == "verify" else KDACache(rows, state)
    return dense(y, p["w_o"], axes["w_o"], n_in=2, backend=gemv, residual=residual), new_cache
