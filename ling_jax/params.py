"""Every parameter of the model, declared once: shape, dtype class, logical axes and initialiser.

`param_specs(cfg)` returns the params pytree with a `ParamSpec` at every leaf. Random init, shardings, the
checkpoint converter and the synthetic-checkpoint writer all derive from it, so nothing drifts.

Layout (ling-jax names; weights stored [in, out], unlike torch's [out, in], except the MoE router and every
expert matrix, stored [out, in] as in torch: the router [E, D], gate/up [.., Ie, D], down [.., D, Ie], so a
batch-1 router, gate/up or down program streams contiguous rows or D-splits of rows (pallas_kernels/moe/router.py,
experts.py)):

    embed [V, D] · final_norm [D] · lm_head [D, V]
    layers[i] = {input_norm, post_norm, mixer, ffn}
      mixer, KDA: w_in [D, H, 5K + 1] (per head q | k | v | f | g | b) · conv_qkv [W, 3, H, K] (fp32)
                  A_log [H] (fp32) · dt_bias [H, K] (fp32) · o_norm [K] · w_o [H, K, D]
      mixer, MLA: w_qg [D, H, Dqk + 1] (per head q | gate)  or  w_q_a [D, Rq] · q_a_norm [Rq] · w_q_b [Rq, H, Dqk]
                  · w_gate [D, H]
                  w_kv_a [D, R + P] · kv_a_norm [R] · w_k_b [R, H, Dn] · w_v_b [R, H, Dv] · w_o [H, Dv, D]
      ffn, dense: w_gate w_up [D, I] · w_down [I, D]
      ffn, MoE:   router [E, D] (fp32, or bf16 as stored) · expert_bias [E] (fp32)
                  we_gate we_up [E, Ie, D] · we_down [E, D, Ie]
                  ws_gate ws_up [Is, D] · ws_down [D, Is]   (shared expert; absent when num_shared_experts = 0)
                  (all [out, in]: the exception above)
    mtp (when num_mtp_layers = 1) = {enorm, hnorm [D], eh_proj [2D, D], final_norm [D], layer = MLA + MoE layer}

Letters: D hidden, H heads, K KDA head dim, W conv taps, R kv_lora_rank, P rope dims, Dn/Dv/Dqk MLA head dims,
I/Ie/Is dense/expert/shared intermediate, E experts, V vocab.

Fused projections (docs/model.md §4): the checkpoint's separate projections that read the same input are packed
at load time into one weight, so a decode step reads them in one GEMV launch. Packing is per head (the parts of
head h sit side by side) so that a shard of heads holds its heads' columns of every part. The MLA latent
projection w_kv_a stays apart: it is replicated under tensor parallelism while q and the gate split by head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import KDA, MLA, MOE, LingConfig

# Parameters kept in float32 whatever the compute dtype: every implementation keeps them so (docs/model.md §4), and
# transformers pins them with `_keep_in_fp32_modules_strict`.
FP32 = "fp32"
COMPUTE = "compute"
# bfloat16 whatever the compute dtype: the MoE router when the checkpoint stores it so (`router_weight_dtype`).
BF16 = "bf16"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axes, mapped to mesh axes by ling_jax.sharding.RULES
    dtype_class: str = COMPUTE
    init: str = "fan_in"  # fan_in | fan_in_last ([out, in] weights) | norm | A_log | dt_bias | small | conv | embed

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)

    def dtype(self, compute_dtype) -> jnp.dtype:
        fixed = {FP32: jnp.float32, BF16: jnp.bfloat16}
        return jnp.dtype(fixed.get(self.dtype_class, compute_dtype))


def _norm(n: int) -> ParamSpec:
    return ParamSpec((n,), (None,), init="norm")


def kda_in_parts(c: LingConfig) -> dict[str, int]:
    """Per-head widths of the parts of KDA's w_in, in their column order (q, k, v, f, the output gate g, beta b)."""
    K = c.head_dim
    return {"q": K, "k": K, "v": K, "f": K, "g": K, "b": 1}


def mla_qg_parts(c: LingConfig) -> dict[str, int]:
    """Per-head widths of MLA's w_qg (q_lora_rank null): the query [q_nope | q_rope], then the head-wise gate."""
    return {"q": c.qk_head_dim, "gate": 1}


def kda_specs(c: LingConfig) -> dict[str, ParamSpec]:
    D, H, K, W = c.hidden_size, c.num_heads, c.head_dim, c.conv_kernel_size
    return {
        "w_in": ParamSpec((D, H, sum(kda_in_parts(c).values())), ("embed", "heads", None)),
        "conv_qkv": ParamSpec((W, 3, H, K), (None, None, "heads", None), FP32, init="conv"),
        "A_log": ParamSpec((H,), ("heads",), FP32, init="A_log"),
        "dt_bias": ParamSpec((H, K), ("heads", None), FP32, init="dt_bias"),
        "o_norm": _norm(K),
        "w_o": ParamSpec((H, K, D), ("heads", None, "embed")),
    }


def mla_specs(c: LingConfig) -> dict[str, ParamSpec]:
    D, H, R, P = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
    specs: dict[str, ParamSpec] = {}
    if c.q_lora_rank is None:
        specs["w_qg"] = ParamSpec((D, H, sum(mla_qg_parts(c).values())), ("embed", "heads", None))
    else:
        specs["w_q_a"] = ParamSpec((D, c.q_lora_rank), ("embed", None))
        specs["q_a_norm"] = _norm(c.q_lora_rank)
        specs["w_q_b"] = ParamSpec((c.q_lora_rank, H, c.qk_head_dim), (None, "heads", None))
        specs["w_gate"] = ParamSpec((D, H), ("embed", "heads"))
    specs.update({
        "w_kv_a": ParamSpec((D, R + P), ("embed", None)),
        "kv_a_norm": _norm(R),
        "w_k_b": ParamSpec((R, H, c.qk_nope_head_dim), (None, "heads", None)),
        "w_v_b": ParamSpec((R, H, c.v_head_dim), (None, "heads", None)),
        "w_o": ParamSpec((H, c.v_head_dim, D), ("heads", None, "embed")),
    })
    return specs


def dense_specs(c: LingConfig) -> dict[str, ParamSpec]:
    D, I = c.hidden_size, c.intermediate_size
    return {"w_gate": ParamSpec((D, I), ("embed", "ffn")), "w_up": ParamSpec((D, I), ("embed", "ffn")),
            "w_down": ParamSpec((I, D), ("ffn", "embed"))}


def moe_specs(c: LingConfig) -> dict[str, ParamSpec]:
    D, E, Ie, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    specs = {
        # Router [E, D] (torch's [out, in]): a router GEMV program streams contiguous D-splits of expert rows. Held
        # in the checkpoint's dtype (fp32 products either way; ling_jax.config.LingConfig.router_weight_dtype).
        "router": ParamSpec((E, D), (None, "embed"), BF16 if c.router_weight_dtype == "bfloat16" else FP32,
                            init="fan_in_last"),
        "expert_bias": ParamSpec((E,), (None,), FP32, init="small"),
        # Expert matrices [out, in] (torch's layout; see the module docstring): init's fan-in is the last axis.
        "we_gate": ParamSpec((E, Ie, D), ("experts", "ffn", "embed"), init="fan_in_last"),
        "we_up": ParamSpec((E, Ie, D), ("experts", "ffn", "embed"), init="fan_in_last"),
        "we_down": ParamSpec((E, D, Ie), ("experts", "embed", "ffn"), init="fan_in_last"),
    }
    if c.num_shared_experts:
        out_in = functools.partial(ParamSpec, init="fan_in_last")
        specs.update({"ws_gate": out_in((Is, D), ("ffn", "embed")), "ws_up": out_in((Is, D), ("ffn", "embed")),
                      "ws_down": out_in((D, Is), ("embed", "ffn"))})
    return specs


def layer_specs(c: LingConfig, layer: int) -> dict[str, Any]:
    mixer, ffn = (c.mixer_kind(layer), c.ffn_kind(layer)) if layer < c.num_layers else (MLA, MOE)
    return {
        "input_norm": _norm(c.hidden_size),
        "post_norm": _norm(c.hidden_size),
        "mixer": kda_specs(c) if mixer == KDA else mla_specs(c),
        "ffn": moe_specs(c) if ffn == MOE else dense_specs(c),
    }


def mtp_specs(c: LingConfig) -> dict[str, Any]:
    D = c.hidden_size
    return {"enorm": _norm(D), "hnorm": _norm(D), "eh_proj": ParamSpec((2 * D, D), (None, "embed")),
            "final_norm": _norm(D), "layer": layer_specs(c, c.num_layers)}


LM_HEAD_AXES = ("embed", "vocab")


def param_specs(c: LingConfig, *, with_mtp: bool = True) -> dict[str, Any]:
    D, V = c.hidden_size, c.vocab_size
    specs: dict[str, Any] = {
        "embed": ParamSpec((V, D), (None, "embed"), init="embed"),
        "layers": [layer_specs(c, i) for i in range(c.num_layers)],
        "final_norm": _norm(D),
        "lm_head": ParamSpec((D, V), LM_HEAD_AXES),
    }
    if with_mtp and c.num_mtp_layers:
        specs["mtp"] = mtp_specs(c)
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(c: LingConfig, dtype=jnp.bfloat16, **kw) -> Any:
    """ShapeDtypeStructs of the params pytree."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype(dtype)), param_specs(c, **kw),
                        is_leaf=is_spec)


def init_value(spec: ParamSpec, key: jax.Array, dtype) -> jax.Array:
    """Random values that keep activations O(1) through the stack (so tests never run on near-zeros)."""
    out_dtype = spec.dtype(dtype)
    shape = spec.shape
    if spec.init == "norm":
        x = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif spec.init == "A_log":
        x = jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    elif spec.init == "dt_bias":
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
        x = dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus, as the reference initialiser
    elif spec.init == "small":
        x = 0.02 * jax.random.normal(key, shape, jnp.float32)
    elif spec.init == "conv":
        x = jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[0])
    elif spec.init == "embed":
        x = jax.random.normal(key, shape, jnp.float32)
    else:
        fan_in = _fan_in(spec)
        x = jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)
    return x.astype(out_dtype)


def _fan_in(spec: ParamSpec) -> int:
    """Input width of a weight: the dims before the first output-side axis ('heads' on w_o counts as input);
    the last dim for the [out, in] router and expert weights (init="fan_in_last")."""
    shape, axes = spec.shape, spec.axes
    if spec.init == "fan_in_last":
        return shape[-1]
    if axes[0] == "heads":  # w_o [H, K, D]
        return shape[0] * shape[1]
    return shape[0]


def init_params(c: LingConfig, key: jax.Array, dtype=jnp.float32, *, with_mtp: bool = True,
                shardings: Any = None) -> Any:
    """Random params for `c` (the `toy` preset's weights, benchmarks at full size)."""
    specs = param_specs(c, with_mtp=with_mtp)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out_shardings = None if shardings is None else jax.tree.leaves(shardings)

    def one(i: int, spec: ParamSpec):
        fn: Callable = lambda k: init_value(spec, k, dtype)
        if out_shardings is not None:
            fn = jax.jit(fn, out_shardings=out_shardings[i])
        return fn(keys[i])

    return jax.tree.unflatten(treedef, [one(i, s) for i, s in enumerate(leaves)])


def count_params(c: LingConfig, *, with_mtp: bool = True) -> int:
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_specs(c, with_mtp=with_mtp), is_leaf=is_spec))
