"""`LingConfig`: every size and switch of a Ling-3 (`bailing_hybrid`) model, frozen and hashable.

It is a static argument of every jitted function, so it must hash; it holds tuples, never lists.
`from_hf` is the one place that reads a `config.json` (official names, DeepSeek-style aliases and the names
transformers writes); `PRESETS` holds `ling-3.0-flash` (exact, docs/model.md §2), `ling-3.0-tiny` (docs/model.md §2) and `toy`
(the same structure at tiny widths, MTP layer included; the embedded default).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"


ROUTER_WEIGHT_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config.json or preset that ling-jax cannot run; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class LingConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_group_size: int
    num_heads: int  # KDA heads and MLA heads alike
    head_dim: int  # KDA head dim, K = V
    conv_kernel_size: int
    kda_lower_bound: float
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_mtp_layers: int
    # One entry per layer including the MTP layers; 0 means no clamp (docs/model.md §3.5).
    expert_swiglu_limits: tuple[float, ...]
    shared_swiglu_limits: tuple[float, ...]
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # Off reproduces transformers' BailingHybrid (which ignores the limit lists); on is SGLang's serving numerics.
    apply_swiglu_clamps: bool = True
    # The dtype the MoE routers (`mlp.gate.weight`) are held in: the checkpoint's own, "bfloat16" or "float32"
    # (conversion's loaders read it from the stored tensors; config.json does not say). The router GEMV multiplies
    # in fp32 either way and a bf16 weight widens exactly, so both give the logits of transformers' fp32 router
    # over the stored values; bf16 reads half the bytes (2.6 MB per layer for Flash). It lives in the config, not
    # only in the arrays, because `params.param_specs(cfg)` declares every leaf's dtype before any array exists
    # (abstract init, orbax restore targets, the synthetic writer), and the router is the one leaf whose dtype is
    # the checkpoint's choice.
    router_weight_dtype: str = "float32"

    def __post_init__(self):
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_mtp_layers

    def mixer_kind(self, layer: int) -> str:
        """docs/model.md §1: MLA closes every group, and takes any trailing partial group."""
        g = self.layer_group_size
        full = (self.num_layers // g) * g
        return MLA if (layer + 1) % g == 0 or layer >= full else KDA

    def ffn_kind(self, layer: int) -> str:
        return DENSE if layer < self.first_k_dense_replace else MOE

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple((self.mixer_kind(i), self.ffn_kind(i)) for i in range(self.num_layers))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.mixer_kind(i) == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.mixer_kind(i) == MLA)

    def swiglu_limits(self, layer: int) -> tuple[float, float]:
        """(routed, shared) clamp limits for `layer` (MTP layers index past num_layers); 0 = off."""
        if not self.apply_swiglu_clamps:
            return 0.0, 0.0
        routed = self.expert_swiglu_limits[layer] if layer < len(self.expert_swiglu_limits) else 0.0
        shared = self.shared_swiglu_limits[layer] if layer < len(self.shared_swiglu_limits) else 0.0
        return float(routed), float(shared)

    def replace(self, **changes: Any) -> "LingConfig":
        return dataclasses.replace(self, **changes)


def _validate(c: LingConfig) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for name in ("vocab_size", "hidden_size", "num_layers", "layer_group_size", "num_heads", "head_dim",
                 "conv_kernel_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                 "topk_group", "max_position_embeddings"):
        value = getattr(c, name)
        need(isinstance(value, int) and value > 0, f"config field {name}={value!r} must be a positive integer")
    need(c.q_lora_rank is None or (isinstance(c.q_lora_rank, int) and c.q_lora_rank > 0),
         f"config field q_lora_rank={c.q_lora_rank!r} must be null or a positive integer")
    need(c.qk_rope_head_dim % 2 == 0, f"config field qk_rope_head_dim={c.qk_rope_head_dim} must be even (RoPE pairs)")
    need(-5.0 <= c.kda_lower_bound < 0.0,
         f"config field kda_lower_bound={c.kda_lower_bound} must lie in [-5, 0): the chunked KDA prefill is only "
         "numerically safe for gates down to -5")
    need(c.num_experts % c.n_group == 0,
         f"config fields num_experts={c.num_experts} and n_group={c.n_group}: num_experts must divide into n_group "
         "equal groups")
    need(c.num_experts // c.n_group >= 2,
         f"config field n_group={c.n_group}: each group needs >= 2 experts (group score = sum of top-2)")
    need(c.topk_group <= c.n_group, f"config field topk_group={c.topk_group} must be <= n_group={c.n_group}")
    need(c.num_experts_per_tok <= c.topk_group * (c.num_experts // c.n_group),
         f"config field num_experts_per_tok={c.num_experts_per_tok} exceeds the experts in the kept groups "
         f"({c.topk_group} groups x {c.num_experts // c.n_group})")
    need(0 <= c.first_k_dense_replace <= c.num_layers,
         f"config field first_k_dense_replace={c.first_k_dense_replace} must lie in [0, num_hidden_layers]")
    need(c.num_shared_experts in (0, 1), f"config field num_shared_experts={c.num_shared_experts}: ling-jax "
         "supports 0 or 1 shared expert (Ling-3 has 1)")
    need(c.num_mtp_layers in (0, 1), f"config field num_nextn_predict_layers={c.num_mtp_layers}: ling-jax supports "
         "0 or 1 MTP layer (Ling-3.0-flash has 1)")
    need(c.rms_norm_eps > 0, f"config field rms_norm_eps={c.rms_norm_eps} must be > 0")
    for name in ("expert_swiglu_limits", "shared_swiglu_limits", "eos_token_ids"):
        need(isinstance(getattr(c, name), tuple), f"config field {name} must be a tuple (LingConfig is hashed)")
    for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
        limits = getattr(c, name)
        need(len(limits) in (0, c.num_layers, c.total_layers),
             f"config field {name} has {len(limits)} entries; expected num_hidden_layers={c.num_layers} "
             f"(or {c.total_layers} with the MTP layer)")
        need(all(v >= 0 for v in limits), f"config field {name} has a negative limit; 0 means no clamp")
    need(c.router_weight_dtype in ROUTER_WEIGHT_DTYPES,
         f"router_weight_dtype={c.router_weight_dtype!r} must be one of {ROUTER_WEIGHT_DTYPES} (the dtype the "
         "checkpoint stores mlp.gate.weight in)")
    for t in c.eos_token_ids + ((c.pad_token_id,) if c.pad_token_id is not None else ()):
        need(0 <= t < c.vocab_size, f"config eos/pad token id {t} lies outside vocab_size={c.vocab_size}")


# ---- config.json -------------------------------------------------------------------------------------------

# Each LingConfig field: the config.json names that may hold it, first match wins. transformers' BailingHybrid
# overwrites `head_dim` with qk_rope_head_dim when it saves, and keeps the KDA value in `linear_head_dim`.
_HF_NAMES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "layer_group_size": ("layer_group_size",),
    "num_heads": ("num_attention_heads",),
    "head_dim": ("linear_head_dim", "head_dim"),
    "conv_kernel_size": ("short_conv_kernel_size", "linear_conv_kernel_dim"),
    "kda_lower_bound": ("kda_lower_bound",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "rope_theta": ("rope_theta",),
    "max_position_embeddings": ("max_position_embeddings", "model_max_length"),
    "rms_norm_eps": ("rms_norm_eps",),
    "intermediate_size": ("intermediate_size",),
    "first_k_dense_replace": ("first_k_dense_replace",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size",),
    "n_group": ("num_expert_group", "n_group"),
    "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
    "num_mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers"),
    "expert_swiglu_limits": ("expert_swiglu_limit_list",),
    "shared_swiglu_limits": ("share_expert_swiglu_limit_list",),
    "pad_token_id": ("pad_token_id",),
}
_HF_DEFAULTS = {"conv_kernel_size": 4, "kda_lower_bound": -5.0, "q_lora_rank": None, "rope_theta": 6_000_000.0,
                "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "num_shared_experts": 1,
                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_mtp_layers": 0, "n_group": 1,
                "topk_group": 1, "expert_swiglu_limits": None, "shared_swiglu_limits": None, "pad_token_id": None,
                "first_k_dense_replace": 0, "shared_expert_intermediate_size": None}
SUPPORTED_MODEL_TYPES = ("bailing_hybrid",)


def from_hf(source: str | Path | dict, **overrides: Any) -> LingConfig:
    """Build a LingConfig from a config.json path, a checkpoint directory, or its parsed dict."""
    if isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}: pass a Ling-3 checkpoint directory or its config.json")
        raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unknown model_type {model_type!r}: ling-jax runs Ling-3 checkpoints "
                          f"(model_type one of {SUPPORTED_MODEL_TYPES})")
    _check_unsupported(raw)
    values: dict[str, Any] = {}
    for field, names in _HF_NAMES.items():
        found = [raw[n] for n in names if n in raw and raw[n] is not None]
        if found:
            values[field] = found[0]
        elif field in _HF_DEFAULTS:
            values[field] = _HF_DEFAULTS[field]
        else:
            raise ConfigError(f"config.json lacks {names[0]!r} (also looked for {list(names[1:])}): every Ling-3 "
                              "config.json has it; is this a Ling-3 checkpoint?")
    if values["shared_expert_intermediate_size"] is None:
        values["shared_expert_intermediate_size"] = values["moe_intermediate_size"]
    values["shared_expert_intermediate_size"] *= max(values["num_shared_experts"], 1)
    for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
        values[name] = tuple(float(v) for v in (values[name] or ()))
    eos = raw.get("eos_token_id")
    values["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_params = raw.get("rope_parameters") or {}
    if "rope_theta" not in raw and "rope_theta" in rope_params:  # transformers' newer layout
        values["rope_theta"] = rope_params["rope_theta"]
    values.update(overrides)
    try:
        return LingConfig(**values)
    except TypeError as e:
        raise ConfigError(f"config.json field of the wrong type: {e}") from None


def _check_unsupported(raw: dict) -> None:
    rope = raw.get("rope_scaling") or {}
    params = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type not in (None, "default"):
        raise ConfigError(f"config rope type {rope_type!r} is not supported: ling-jax implements default RoPE "
                          "(rope_scaling null, as Ling-3.0-flash ships); remove rope_scaling to run")
    if raw.get("kda_safe_gate") is False:
        raise ConfigError("config kda_safe_gate=false is not supported: Ling-3 uses the lower-bounded gate")
    if raw.get("rope_interleave") is False:
        raise ConfigError("config rope_interleave=false is not supported: Ling-3 MLA rotates interleaved pairs")
    if raw.get("tie_word_embeddings"):
        raise ConfigError("config tie_word_embeddings=true is not supported: Ling-3 has an untied lm_head")
    head_wise = raw.get("gated_attention_proj_granularity_type", "head_wise")
    if head_wise != "head_wise":
        raise ConfigError(f"config gated_attention_proj_granularity_type={head_wise!r} is not supported "
                          "(Ling-3 uses head_wise)")
    dims = raw.get("num_key_value_heads"), raw.get("num_attention_heads")
    if raw.get("num_key_value_heads") not in (None, raw.get("num_attention_heads")):
        raise ConfigError(f"config num_key_value_heads={dims[0]} != num_attention_heads={dims[1]}: ling-jax "
                          "supports KDA/MLA with one KV group per head, as Ling-3 has")


def to_hf_dict(cfg: LingConfig) -> dict:
    """The official config.json for `cfg` (what conversion.synthetic writes)."""
    return {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "layer_group_size": cfg.layer_group_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "head_dim": cfg.head_dim,
        "short_conv_kernel_size": cfg.conv_kernel_size, "no_kda_lora": True, "kda_safe_gate": True,
        "kda_lower_bound": cfg.kda_lower_bound, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "gated_attention_proj_granularity_type": "head_wise",
        "rope_theta": cfg.rope_theta, "rope_interleave": True, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "intermediate_size": cfg.intermediate_size, "first_k_dense_replace": cfg.first_k_dense_replace,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size // max(cfg.num_shared_experts, 1),
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "router_dtype": "fp32",
        "expert_swiglu_limit_list": list(cfg.expert_swiglu_limits),
        "share_expert_swiglu_limit_list": list(cfg.shared_swiglu_limits),
        "tie_word_embeddings": False, "num_nextn_predict_layers": cfg.num_mtp_layers,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
        "pad_token_id": cfg.pad_token_id, "torch_dtype": "bfloat16",
    }


# ---- presets -----------------------------------------------------------------------------------------------

def _flash() -> LingConfig:
    return LingConfig(
        vocab_size=157184, hidden_size=2560, num_layers=42, layer_group_size=6, num_heads=32, head_dim=128,
        conv_kernel_size=4, kda_lower_bound=-5.0, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=6_000_000.0, max_position_embeddings=262144,
        rms_norm_eps=1e-6, intermediate_size=6144, first_k_dense_replace=2, num_experts=512,
        num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=768,
        shared_expert_intermediate_size=768, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_mtp_layers=1,
        expert_swiglu_limits=tuple([0.0] * 35 + [4.0] * 7),
        shared_swiglu_limits=tuple([0.0] * 34 + [5.0] * 6 + [7.0] * 2),
        eos_token_ids=(156895,), pad_token_id=156892)


def _tiny() -> LingConfig:
    return LingConfig(
        vocab_size=157184, hidden_size=1536, num_layers=24, layer_group_size=4, num_heads=16, head_dim=128,
        conv_kernel_size=4, kda_lower_bound=-5.0, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=6_000_000.0, max_position_embeddings=131072,
        rms_norm_eps=1e-6, intermediate_size=4608, first_k_dense_replace=1, num_experts=128,
        num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_mtp_layers=0, expert_swiglu_limits=(), shared_swiglu_limits=(),
        eos_token_ids=(156895,), pad_token_id=156892)


def _toy() -> LingConfig:
    """Flash's structure at tiny widths: KDA groups closed by MLA (2 + 1 here), dense then MoE, grouped routing,
    clamps on the last layers, an MTP layer."""
    return LingConfig(
        vocab_size=512, hidden_size=128, num_layers=6, layer_group_size=3, num_heads=4, head_dim=32,
        conv_kernel_size=4, kda_lower_bound=-5.0, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, rope_theta=6_000_000.0, max_position_embeddings=4096,
        rms_norm_eps=1e-6, intermediate_size=256, first_k_dense_replace=1, num_experts=32,
        num_experts_per_tok=4, num_shared_experts=1, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_mtp_layers=1,
        expert_swiglu_limits=(0.0, 0.0, 0.0, 0.0, 4.0, 4.0), shared_swiglu_limits=(0.0, 0.0, 0.0, 5.0, 5.0, 7.0),
        eos_token_ids=(2,), pad_token_id=0)


PRESETS = {"ling-3.0-flash": _flash, "ling-3.0-tiny": _tiny, "toy": _toy}


def preset(name: str, **overrides: Any) -> LingConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides) if overrides else PRESETS[name]()
