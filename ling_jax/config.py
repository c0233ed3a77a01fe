"""`LingConfig`: every size and switch of a Ling-3 (`bailing_hybrid`) model, frozen and hashable.

It is a static argument of every jitted function, so it must hash; it holds tuples, never lists.
`from_hf` is the one place that reads a `config.json` (official names, DeepSeek-style aliases and the names
transformers writes); `PRESETS` holds `ling-3.0-flash` (exact, docs/model.md §2), `ling-3.0-tiny` (docs/model.md §2) and `toy`
(the same structure at tiny widths, MTP layer included; the embedded default).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"
# config.json's schedule vocabulary (transformers' `layer_types` / `mlp_layer_types`) for ling-jax's kinds.
HF_MIXER_NAMES = {MLA: "full_attention", KDA: "linear_attention"}
HF_FFN_NAMES = {DENSE: "dense", MOE: "sparse"}


ROUTER_WEIGHT_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config.json or preset that ling-jax cannot run; the message names the field and the fix."""


class DeviceMemoryError(MemoryError):
    """Work that does not fit the devices' free memory, refused before allocating; the message gives the sizes and
    the fix."""


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
    # On is SGLang's serving numerics and transformers >= 5.25's BailingHybrid; off reproduces transformers 5.24,
    # which ignores the limit lists (docs/model.md §6).
    apply_swiglu_clamps: bool = True
    # The dtype the MoE routers (`mlp.gate.weight`) are held in: the checkpoint's own, "bfloat16" or "float32"
    # (conversion's loaders read it from the stored tensors; config.json does not say). The router GEMV multiplies
    # in fp32 either way and a bf16 weight widens exactly, so both give the logits of transformers' fp32 router
    # over the stored values; bf16 reads half the bytes (2.6 MB per layer for Flash). It lives in the config, not
    # only in the arrays, because `params.param_specs(cfg)` declares every leaf's dtype before any array exists
    # (abstract init, orbax restore targets, the synthetic writer), and the router is the one leaf whose dtype is
    # the checkpoint's choice.
    router_weight_dtype: str = "float32"
    # The explicit schedule, one kind per main layer, from config.json's `layer_types` (KDA/MLA) and
    # `mlp_layer_types` (DENSE/MOE); () means the rule (docs/model.md §1). A schedule equal to the rule is stored as
    # (), so a config read back from disk equals its preset.
    mixer_schedule: tuple[str, ...] = ()
    ffn_schedule: tuple[str, ...] = ()
    # "fp8": the decoder layers' linear weights are block-FP8 (E4M3, one float32 scale per 128x128 block:
    # docs/model.md §4), from config.json's quantization_config; None: every weight in the compute dtype. It is a
    # config field, as the router's dtype is, because `param_specs(cfg)` declares each leaf's dtype and shape.
    quantization: str | None = None

    def __post_init__(self):
        _validate(self)
        # No clamp anywhere is stored as (), as transformers >= 5.25 writes zeros where older configs had null.
        for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
            if not any(getattr(self, name)):
                object.__setattr__(self, name, ())
        for name, rule in (("mixer_schedule", self.rule_mixer_kind), ("ffn_schedule", self.rule_ffn_kind)):
            if getattr(self, name) == tuple(rule(i) for i in range(self.num_layers)):
                object.__setattr__(self, name, ())

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
        """The explicit schedule where there is one, else the rule; the MTP layer (past num_layers) is MLA."""
        if layer < len(self.mixer_schedule):
            return self.mixer_schedule[layer]
        return self.rule_mixer_kind(layer)

    def ffn_kind(self, layer: int) -> str:
        if layer < len(self.ffn_schedule):
            return self.ffn_schedule[layer]
        return self.rule_ffn_kind(layer)

    def rule_mixer_kind(self, layer: int) -> str:
        """docs/model.md §1: MLA closes every group, and takes any trailing partial group."""
        g = self.layer_group_size
        full = (self.num_layers // g) * g
        return MLA if (layer + 1) % g == 0 or layer >= full else KDA

    def rule_ffn_kind(self, layer: int) -> str:
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

    def first_layers(self, n: int, **changes: Any) -> "LingConfig":
        """This config cut to its first n decoder layers and no MTP layer: each kept layer keeps its kinds and
        limits (the schedules are written out, since the rule's trailing partial group moves with num_layers);
        `changes` as in `replace`."""
        cut = {"num_layers": n, "num_mtp_layers": 0, "expert_swiglu_limits": self.expert_swiglu_limits[:n],
               "shared_swiglu_limits": self.shared_swiglu_limits[:n],
               "mixer_schedule": tuple(self.mixer_kind(i) for i in range(n)),
               "ffn_schedule": tuple(self.ffn_kind(i) for i in range(n))}
        return self.replace(**{**cut, **changes})


def _validate(c: LingConfig) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for name in ("vocab_size", "hidden_size", "num_layers", "layer_group_size", "num_heads", "head_dim",
                 "conv_kernel_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                 "topk_group", "max_position_embeddings"):
        value = getattr(c, name)
        need(_is_int(value) and value > 0, f"config field {name}={value!r} must be a positive integer")
    need(c.q_lora_rank is None or (_is_int(c.q_lora_rank) and c.q_lora_rank > 0),
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
        need(len(limits) in (0, c.num_layers, c.total_layers), _limit_list_message(c, name, len(limits)))
        need(all(v >= 0 for v in limits), f"config field {name} has a negative limit; 0 means no clamp")
    for name, kinds in (("mixer_schedule", (KDA, MLA)), ("ffn_schedule", (DENSE, MOE))):
        schedule = getattr(c, name)
        need(isinstance(schedule, tuple), f"config field {name} must be a tuple (LingConfig is hashed)")
        need(len(schedule) in (0, c.num_layers), f"config field {name} has {len(schedule)} entries; expected "
             f"num_hidden_layers={c.num_layers}, or none for the rule")
        for i, kind in enumerate(schedule):
            need(kind in kinds, f"config field {name}[{i}]={kind!r} must be one of {kinds}")
    need(c.router_weight_dtype in ROUTER_WEIGHT_DTYPES,
         f"router_weight_dtype={c.router_weight_dtype!r} must be one of {ROUTER_WEIGHT_DTYPES} (the dtype the "
         "checkpoint stores mlp.gate.weight in)")
    need(c.quantization in QUANTIZATIONS, f"config field quantization={c.quantization!r} must be one of "
         f"{QUANTIZATIONS} (None: unquantised weights; 'fp8': block-FP8 E4M3 with 128x128 scales)")
    for t in c.eos_token_ids + ((c.pad_token_id,) if c.pad_token_id is not None else ()):
        need(0 <= t < c.vocab_size, f"config eos/pad token id {t} lies outside vocab_size={c.vocab_size}")


def _limit_list_message(c: LingConfig, name: str, n: int) -> str:
    """What a limit list of n entries should have been: one limit per decoder layer, optionally the MTP layer's."""
    layers = f"num_hidden_layers={c.num_layers}"
    if c.num_mtp_layers:
        takes = f"{c.num_layers} (one per decoder layer), {c.total_layers} (the MTP layer's too) or none"
        shape = f"{layers} and {c.num_mtp_layers} MTP layer"
    else:
        takes = f"{c.num_layers} (one per decoder layer) or none"
        shape = f"{layers} and no MTP layer"
    return f"config field {name} has {n} entries, but a config of {shape} takes {takes}: {_CUT_HINT}"


# The fix for a LingConfig built in Python; from_hf names the config.json fix instead.
_CUT_HINT = "a config cut to fewer layers must cut its limit lists too (LingConfig.first_layers does both)"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    "expert_swiglu_limits": ("expert_swiglu_limit_list", "swiglu_limits"),
    "shared_swiglu_limits": ("share_expert_swiglu_limit_list", "swiglu_limits_shared"),
    "pad_token_id": ("pad_token_id",),
}
_HF_DEFAULTS = {"conv_kernel_size": 4, "kda_lower_bound": -5.0, "q_lora_rank": None, "rope_theta": 6_000_000.0,
                "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "num_shared_experts": 1,
                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_mtp_layers": 0, "n_group": 1,
                "topk_group": 1, "expert_swiglu_limits": None, "shared_swiglu_limits": None, "pad_token_id": None,
                "first_k_dense_replace": 0, "shared_expert_intermediate_size": None}
SUPPORTED_MODEL_TYPES = ("bailing_hybrid",)

# The JSON type each field's value must have; floats are stored as float, so 6000000 and 6e6 read the same.
_INT, _NUMBER, _BOOL, _NUMBERS = "an integer", "a number", "true or false", "a list of numbers"
_HF_TYPES = {name: _INT for name in _HF_NAMES} | {
    "kda_lower_bound": _NUMBER, "rope_theta": _NUMBER, "rms_norm_eps": _NUMBER, "routed_scaling_factor": _NUMBER,
    "norm_topk_prob": _BOOL, "expert_swiglu_limits": _NUMBERS, "shared_swiglu_limits": _NUMBERS}
# Aliases not compared when several are present: transformers overwrites head_dim with the rope dim, and
# model_max_length is a length limit that a tokenizer-side copy may set differently.
_ALIASES_MAY_DIFFER = ("head_dim", "max_position_embeddings")
_MIXER_VALUES = "'full_attention' (MLA) or 'linear_attention' (KDA)"
_FFN_VALUES = "'dense' (dense MLP) or 'sparse' (MoE)"


def read_json(path: Path, error: type[Exception], fix: str) -> Any:
    """The parsed JSON file at `path`, or `error` naming the file, where the text breaks, and `fix`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): {fix}") from None
    except UnicodeDecodeError:
        raise error(f"{path} is not UTF-8 text: {fix}") from None


def read_config_json(source: str | Path) -> dict:
    """The parsed config.json at `source`: the file itself or a checkpoint directory holding it."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}: pass a Ling-3 checkpoint directory or its config.json")
    raw = read_json(path, ConfigError, "fix it there, or copy config.json from the original checkpoint again")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds {_json_kind(raw)}, not a JSON object: copy config.json from the original "
                          "checkpoint again")
    return raw


def from_hf(source: str | Path | dict, **overrides: Any) -> LingConfig:
    """Build a LingConfig from a config.json path, a checkpoint directory, or its parsed dict."""
    raw = source if isinstance(source, dict) else read_config_json(source)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unknown model_type {model_type!r}: ling-jax runs Ling-3 checkpoints "
                          f"(model_type one of {SUPPORTED_MODEL_TYPES})")
    _check_unsupported(raw)
    values = {field: _read_field(raw, field, names) for field, names in _HF_NAMES.items()}
    if values["shared_expert_intermediate_size"] is None:
        values["shared_expert_intermediate_size"] = values["moe_intermediate_size"]
    values["shared_expert_intermediate_size"] *= max(values["num_shared_experts"], 1)
    for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
        values[name] = values[name] or ()
    values["eos_token_ids"] = _eos_token_ids(raw)
    values["rope_theta"] = _rope_theta(raw, values["rope_theta"])
    values["mixer_schedule"] = _schedule(raw, "layer_types", HF_MIXER_NAMES, _MIXER_VALUES, values["num_layers"],
                                         "layer_group_size")
    values["ffn_schedule"] = _schedule(raw, "mlp_layer_types", HF_FFN_NAMES, _FFN_VALUES, values["num_layers"],
                                       "first_k_dense_replace")
    _check_derived(raw, values)
    values["quantization"] = _quantization(raw)
    values.update(overrides)
    try:
        return LingConfig(**values)
    except TypeError as e:
        raise ConfigError(f"config.json field of the wrong type: {e}") from None
    except ConfigError as e:
        raise ConfigError(_with_json_names(str(e)).replace(_CUT_HINT, "correct the list in config.json")) from None


def _with_json_names(message: str) -> str:
    """A LingConfig validation message, each field also named as config.json spells it (what the user edits)."""
    def name(m: re.Match) -> str:
        field = m.group(1)
        json_name = _HF_NAMES.get(field, (field,))[0]
        return m.group(0) if json_name == field else f"config field {field} (config.json {json_name})"
    return re.sub(r"config field (\w+)", name, message)


def _read_field(raw: dict, field: str, names: tuple[str, ...]) -> Any:
    """The field's value under the first of its names present (typed), its default, or a ConfigError."""
    found = [(n, raw[n]) for n in names if raw.get(n) is not None]
    if not found:
        if field in _HF_DEFAULTS:
            return _HF_DEFAULTS[field]
        aliases = f" (also looked for {', '.join(map(repr, names[1:]))})" if names[1:] else ""
        raise ConfigError(f"config.json lacks {names[0]!r}{aliases}: every Ling-3 config.json has it; is this a "
                          "Ling-3 checkpoint?")
    typed = [(n, _typed(n, v, _HF_TYPES[field])) for n, v in found]
    if field not in _ALIASES_MAY_DIFFER and any(v != typed[0][1] for _, v in typed[1:]):
        given = ", ".join(f"{n}={_json(v)}" for n, v in found)
        raise ConfigError(f"config.json gives {field} under two names with different values ({given}): they are "
                          "aliases; keep one")
    return typed[0][1]


def _typed(name: str, value: Any, kind: str) -> Any:
    """`value` checked against `kind` (numbers widened to float); a ConfigError naming `name` otherwise."""
    if kind == _INT and _is_int(value):
        return value
    if kind == _NUMBER and _is_number(value):
        return float(value)
    if kind == _BOOL and isinstance(value, bool):
        return value
    if kind == _NUMBERS and isinstance(value, list) and all(_is_number(v) for v in value):
        return tuple(float(v) for v in value)
    raise ConfigError(f"config.json {name}={_json(value)} is {_json_kind(value)}; it must be {kind}: correct it in "
                      "config.json (the official Ling-3 config.json has " + kind + " there)")


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(type(value), "a value")


def _eos_token_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(_is_int(t) for t in ids):
        raise ConfigError(f"config.json eos_token_id={_json(eos)} must be a token id or a list of token ids "
                          "(integers): correct it in config.json")
    return tuple(ids)


def _object(raw: dict, name: str) -> dict:
    value = raw.get(name)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"config.json {name}={_json(value)} is {_json_kind(value)}; it must be an object or null: "
                          "correct it in config.json")
    return value or {}


def _rope_theta(raw: dict, theta: float) -> float:
    """rope_theta, or transformers' newer rope_parameters.rope_theta; both present, they must agree."""
    params = _object(raw, "rope_parameters")
    if params.get("rope_theta") is None:
        return theta
    nested = _typed("rope_parameters.rope_theta", params["rope_theta"], _NUMBER)
    if raw.get("rope_theta") is None:
        return nested
    if nested != theta:
        raise ConfigError(f"config.json rope_theta={_json(raw['rope_theta'])} and rope_parameters.rope_theta="
                          f"{_json(params['rope_theta'])} differ (transformers reads the second, other readers the "
                          "first): make them equal")
    return theta


def _schedule(raw: dict, name: str, hf_names: dict[str, str], accepted: str, num_layers: int,
              rule: str) -> tuple[str, ...]:
    """config.json's per-layer list `name` in ling-jax's kinds; () when absent (the `rule` decides)."""
    value = raw.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"config.json {name}={_json(value)} is {_json_kind(value)}; it must be a list with one "
                          f"entry per layer, each {accepted}")
    if len(value) != num_layers:
        raise ConfigError(f"config.json {name} has {len(value)} entries but num_hidden_layers={num_layers}: give one "
                          f"entry per main layer (the MTP layer is not listed), or remove {name} to use the "
                          f"{rule} rule")
    kinds = {hf: kind for kind, hf in hf_names.items()}
    for i, entry in enumerate(value):
        if not isinstance(entry, str) or entry not in kinds:
            raise ConfigError(f"config.json {name}[{i}]={_json(entry)} is not a layer type ling-jax runs: use "
                              f"{accepted}")
    return tuple(kinds[entry] for entry in value)


# Fields that every Ling-3 config.json holds at one value: any other changes the math, and ling-jax implements only
# that value (absent or null is fine). Each: the accepted values, then why.
_FIXED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "the KDA short convolution and every SwiGLU use SiLU"),
    "score_function": (("sigmoid",), "the MoE router scores experts by sigmoid"),
    "scoring_func": (("sigmoid",), "the MoE router scores experts by sigmoid"),
    "topk_method": (("noaux_tc",), "the router selects by bias-corrected grouped top-k"),
    "router_dtype": (("fp32", "float32"), "the router computes in fp32"),
    "moe_router_enable_expert_bias": ((True,), "the router selects with mlp.gate.expert_bias"),
    "gated_attention_proj_granularity_type": (("head_wise",), "the MLA output gate has one value per head"),
    "kda_safe_gate": ((True,), "Ling-3 uses the lower-bounded gate"),
    "no_kda_lora": ((True,), "ling-jax has full-rank KDA f_proj and g_proj only"),
    "rope_interleave": ((True,), "Ling-3 MLA rotates interleaved pairs"),
    "tie_word_embeddings": ((False,), "Ling-3 has an untied lm_head"),
    "attention_bias": ((False,), "Ling-3 linear layers have no bias"),
    "use_bias": ((False,), "Ling-3 linear layers have no bias"),
    "use_qkv_bias": ((False,), "Ling-3 linear layers have no bias"),
    "mtp_use_kda": ((False,), "the MTP layer is MLA + MoE"),
}


QUANTIZATIONS = (None, "fp8")
# What the `-fp8` release's config.json says (docs/model.md §4); anything else is refused by name.
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}


def _quantization(raw: dict) -> str | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config.json quantization_config holds {_json_kind(q)}, not a JSON object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config.json quantization_config.quant_method={_json(method)} is not supported: ling-jax "
                          "loads unquantised checkpoints and the block-FP8 release (quant_method 'fp8'); convert "
                          "from the bf16 release instead")
    for key in ("fmt", "weight_block_size"):
        if key in q and q[key] != FP8_QUANTIZATION_CONFIG[key]:
            raise ConfigError(f"config.json quantization_config.{key}={_json(q[key])} is not supported: ling-jax's "
                              f"FP8 path is {key}={_json(FP8_QUANTIZATION_CONFIG[key])} (the -fp8 release's)")
    return "fp8"


def _check_unsupported(raw: dict) -> None:
    for name, (accepted, why) in _FIXED_VALUES.items():
        value = raw.get(name)
        if value is not None and not any(value == a and type(value) is type(a) for a in accepted):
            raise ConfigError(f"config.json {name}={_json(value)} is not supported: {why}; ling-jax runs "
                              f"{name}={_json(accepted[0])} (or leave the field out)")
    rope, params = _object(raw, "rope_scaling"), _object(raw, "rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type not in (None, "default"):
        raise ConfigError(f"config.json rope type {rope_type!r} is not supported: ling-jax implements default RoPE "
                          "(rope_scaling null, as Ling-3.0-flash ships); remove rope_scaling to run")
    dims = raw.get("num_key_value_heads"), raw.get("num_attention_heads")
    heads_valid = type(dims[1]) is int and dims[1] > 0  # else the field check names num_attention_heads itself
    if heads_valid and dims[0] not in (None, dims[1]):
        raise ConfigError(f"config.json num_key_value_heads={dims[0]} != num_attention_heads={dims[1]}: ling-jax "
                          "supports KDA/MLA with one KV group per head, as Ling-3 has")


def _check_derived(raw: dict, values: dict) -> None:
    """Fields that restate others (transformers writes some of them): they must agree with what ling-jax runs."""
    derived = {"rotary_dim": ("qk_rope_head_dim", values["qk_rope_head_dim"],
                              "MLA rotates all qk_rope_head_dim dims"),
               "qk_head_dim": ("qk_nope_head_dim + qk_rope_head_dim",
                               values["qk_nope_head_dim"] + values["qk_rope_head_dim"], "the MLA query/key width"),
               "linear_num_heads": ("num_attention_heads", values["num_heads"],
                                    "KDA and MLA have the same head count in Ling-3")}
    for name, (source, want, why) in derived.items():
        value = raw.get(name)
        if value is not None and _typed(name, value, _INT) != want:
            raise ConfigError(f"config.json {name}={_json(value)} != {source} = {want} ({why}): set {name} to "
                              f"{want} or remove it")


def _hf_limit_list(cfg: LingConfig, limits: tuple[float, ...]) -> list[float]:
    """A limit list as transformers >= 5.25 reads it back, one entry per decoder layer (it refuses other lengths):
    none means zeros, and the MTP layer's entry, which transformers never runs, is written only when it clamps."""
    if not limits:
        return [0.0] * cfg.num_layers
    return list(limits if any(limits[cfg.num_layers:]) else limits[:cfg.num_layers])


def to_hf_dict(cfg: LingConfig) -> dict:
    """The official config.json for `cfg` (what conversion.synthetic writes), with the schedule spelled out in
    `layer_types` / `mlp_layer_types` so that transformers reads the same layers as ling-jax."""
    return {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "layer_group_size": cfg.layer_group_size,
        "layer_types": [HF_MIXER_NAMES[cfg.mixer_kind(i)] for i in range(cfg.num_layers)],
        "mlp_layer_types": [HF_FFN_NAMES[cfg.ffn_kind(i)] for i in range(cfg.num_layers)],
        "num_attention_heads": cfg.num_heads,
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
        "expert_swiglu_limit_list": _hf_limit_list(cfg, cfg.expert_swiglu_limits),
        "share_expert_swiglu_limit_list": _hf_limit_list(cfg, cfg.shared_swiglu_limits),
        "tie_word_embeddings": False, "num_nextn_predict_layers": cfg.num_mtp_layers,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
        "pad_token_id": cfg.pad_token_id, "torch_dtype": "bfloat16",
    } | ({"quantization_config": dict(FP8_QUANTIZATION_CONFIG)} if cfg.quantization == "fp8" else {})


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
