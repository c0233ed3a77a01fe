"""Every parameter of the model, declared once: shape, dtype class, logical axes and initialiser.

`param_specs(cfg)` returns the params pytree with a `ParamSpec` at every leaf. Random init, shardings, the
checkpoint converter and the synthetic-checkpoint writer all derive from it, so nothing drifts.

Layout (ling-jax names; float weights stored [in, out], unlike torch's [out, in], except the MoE router and every
expert matrix, stored [out, in] as in torch: the router [E, D], gate/up [.., Ie, D], down [.., D, Ie], so a
batch-1 router, gate/up or down program streams contiguous rows or D-splits of rows (pallas_kernels/moe/router.py,
experts.py)). Block-FP8 projections (cfg.quantization "fp8") are stored [out, in] too, the shapes below with their
output axes first and their logical axes in that order (`fp8.ROWS`: w_in [H, 5K + 1, D], w_o [D, H, K], w_down
[D, I], ...; each scale [*out, ceil(In/128)], on the output axes and the first input axis), because the FP8 GEMV
streams each output row's contiguous inputs (pallas_kernels/gemv/rows.py; on the H200 it read KDA's w_in at
T = 1 in 22.5 µs against 29.9 for [in, out], and at T = 16 in 22.7 against 66.1):

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
head h sit side by side) so that a shard of heads holds its heads' columns (block-FP8: rows) of every part. The MLA
latent projection w_kv_a stays apart: it is replicated under tensor parallelism while q and the gate split by head.
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
from pallas_kernels.common.fp8 import FP8_DTYPE, IN_OUT, OUT_IN, ROWS, Fp8Weight, scale_shape

# Parameters kept in float32 whatever the compute dtype: every implementation keeps them so (docs/model.md §4), and
# transformers pins them with `_keep_in_fp32_modules_strict`.
FP32 = "fp32"
COMPUTE = "compute"
# bfloat16 whatever the compute dtype: the MoE router when the checkpoint stores it so (`router_weight_dtype`).
BF16 = "bf16"
# float8_e4m3fn: the values of a block-FP8 weight (cfg.quantization "fp8"), beside its float32 scale.
FP8 = "fp8"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axes, mapped to mesh axes by ling_jax.sharding.RULES
    dtype_class: str = COMPUTE
    # fan_in | fan_in_last ([out, in] weights) | norm | A_log | dt_bias | small | conv | embed | fp8_scale
    init: str = "fan_in"
    # The weight's input width where the shape does not say it: a ROWS projection's values (w_o [D, H, K] reads
    # H·K), and an fp8_scale, so that the dequantised weight keeps fan-in scaling. 0: from the shape (`_fan_in`).
    fan_in: int = 0

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)

    def dtype(self, compute_dtype) -> jnp.dtype:
        fixed = {FP32: jnp.float32, BF16: jnp.bfloat16, FP8: FP8_DTYPE}
        return jnp.dtype(fixed.get(self.dtype_class, compute_dtype))


def is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def is_leaf_spec(x) -> bool:
    """A params leaf's declaration: a ParamSpec, or the Fp8Weight of ParamSpecs of one quantised weight."""
    return is_spec(x) or is_fp8(x)


def weight_spec(spec) -> ParamSpec:
    """The spec of the weight's values: the ParamSpec itself, or an Fp8Weight spec's `q`."""
    return spec.q if is_fp8(spec) else spec


def param_axes(specs: dict[str, Any]) -> dict[str, tuple]:
    """{name: logical axes} of a dict of declarations (an FP8 weight's are its values' axes)."""
    return {name: weight_spec(s).axes for name, s in specs.items()}


def scale_axes(axes: tuple, layout: str, n_in: int = 1) -> tuple:
    """The logical axes of an FP8 weight's scale (pallas_kernels/common/fp8.py) from its values' `axes`: ROWS keeps
    the output axes and the first input axis (its 128-column blocks shard with it), IN_OUT the first input axis and
    the output axes; OUT_IN blocks every axis in place."""
    if layout == ROWS:
        return tuple(axes[:len(axes) - n_in]) + (axes[len(axes) - n_in],)
    return (axes[0],) + tuple(axes[n_in:]) if layout == IN_OUT else tuple(axes)


def _fp8(spec: ParamSpec, layout: str, n_in: int = 1) -> Fp8Weight:
    """The declaration of `spec` ([*in, *out] for a projection) stored block-FP8 in `layout`: its values (ROWS:
    the output axes first), and the float32 scale per block."""
    fan_in = _fan_in(spec)
    if layout == ROWS:
        order = tuple(range(n_in, len(spec.shape))) + tuple(range(n_in))
        spec = dataclasses.replace(spec, shape=tuple(spec.shape[i] for i in order),
                                   axes=tuple(spec.axes[i] for i in order), fan_in=fan_in)
    scale = ParamSpec(scale_shape(spec.shape, layout, n_in), scale_axes(spec.axes, layout, n_in), FP32,
                      init="fp8_scale", fan_in=fan_in)
    return Fp8Weight(dataclasses.replace(spec, dtype_class=FP8), scale, layout, n_in)


def _quantised(c: LingConfig, specs: dict[str, Any], two_in: tuple[str, ...] = ()) -> dict[str, Any]:
    """`specs` with every linear weight in block-FP8 when the config says so (docs/model.md §4: the release
    quantises the decoder layers' projections and experts; norms, convs, A_log, dt_bias and the router stay): the
    projections ROWS (`two_in`: those with two input axes), the experts OUT_IN."""
    if c.quantization != "fp8":
        return specs
    keep = {"conv_qkv", "A_log", "dt_bias", "o_norm", "q_a_norm", "kv_a_norm", "router", "expert_bias"}
    return {name: s if name in keep else _fp8(s, OUT_IN if name.startswith(("we_", "ws_")) else ROWS,
                                               2 if name in two_in else 1)
            for name, s in specs.items()}


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
    return _quantised(c, {
        "w_in": ParamSpec((D, H, sum(kda_in_parts(c).values())), ("embed", "heads", None)),
        "conv_qkv": ParamSpec((W, 3, H, K), (None, None, "heads", None), FP32, init="conv"),
        "A_log": ParamSpec((H,), ("heads",), FP32, init="A_log"),
        "dt_bias": ParamSpec((H, K), ("heads", None), FP32, init="dt_bias"),
        "o_norm": _norm(K),
        "w_o": ParamSpec((H, K, D), ("heads", None, "embed")),
    }, two_in=("w_o",))


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
    return _quantised(c, specs, two_in=("w_o",))


def dense_specs(c: LingConfig) -> dict[str, ParamSpec]:
    D, I = c.hidden_size, c.intermediate_size
    return _quantised(c, {"w_gate": ParamSpec((D, I), ("embed", "ffn")), "w_up": ParamSpec((D, I), ("embed", "ffn")),
                          "w_down": ParamSpec((I, D), ("ffn", "embed"))})


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
    return _quantised(c, specs)


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


def param_bytes(c: LingConfig, dtype=jnp.bfloat16, **kw) -> int:
    """Bytes of the params (FP8 values and their scales counted as stored)."""
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype(dtype)).itemsize
               for s in jax.tree.leaves(param_specs(c, **kw), is_leaf=is_spec))


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
    elif spec.dtype_class == FP8:  # E4M3 values spread over its range (|x| <= 448), not all at one exponent
        x = jnp.clip(_FP8_SPREAD * jax.random.normal(key, shape, jnp.float32), -448.0, 448.0)
    elif spec.init == "fp8_scale":  # scales that vary by block, giving the dequantised weight fan-in scaling
        x = jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) / (_FP8_SPREAD * math.sqrt(spec.fan_in))
    else:
        fan_in = _fan_in(spec)
        x = jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)
    return x.astype(out_dtype)


_FP8_SPREAD = 32.0  # random FP8 values ~ N(0, 32²): most of E4M3's exponents, few clipped at 448


def _fan_in(spec: ParamSpec) -> int:
    """Input width of a weight: `spec.fan_in` when declared (ROWS projections); the last dim for the [out, in]
    router and expert weights (init="fan_in_last"); else the dims before the first output-side axis of an
    [in, out] weight ('heads' on w_o counts as input)."""
    shape, axes = spec.shape, spec.axes
    if spec.fan_in:
        return spec.fan_in
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
        if out_shardings is None:
            return init_value(spec, keys[i], dtype)
        return _jitted_init(spec, jnp.dtype(dtype), out_shardings[i])(keys[i])

    return jax.tree.unflatten(treedef, [one(i, s) for i, s in enumerate(leaves)])


@functools.lru_cache(maxsize=None)
def _jitted_init(spec: ParamSpec, dtype, sharding) -> Callable:
    """One compiled initialiser per distinct leaf (the full model's ~700 leaves have a few dozen kinds), writing
    its output straight into `sharding`."""
    return jax.jit(lambda k: init_value(spec, k, dtype), out_shardings=sharding)


def count_params(c: LingConfig, *, with_mtp: bool = True) -> int:
    """The weights' values (an FP8 weight's scales are not parameters)."""
    return sum(int(np.prod(weight_spec(s).shape))
               for s in jax.tree.leaves(param_specs(c, with_mtp=with_mtp), is_leaf=is_leaf_spec))


def as_params(x: Any) -> Any:
    """The params pytree of `x`: `x` itself, or a model object's (`flax_model.LingForCausalLM.as_params`), so that
    every function taking params takes the Flax model too."""
    to_params = getattr(x, "as_params", None)
    return to_params() if callable(to_params) else x
