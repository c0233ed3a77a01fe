"""LingConfig: exact presets, config.json names and aliases, and one clear error per invalid field."""

import json

import pytest

from ling_jax.config import ConfigError, DENSE, KDA, MLA, MOE, from_hf, preset, to_hf_dict
from ling_jax.params import count_params, param_specs


def test_flash_preset_is_exact():
    cfg = preset("ling-3.0-flash")
    assert cfg.mla_layers == (5, 11, 17, 23, 29, 35, 41) and len(cfg.kda_layers) == 35
    assert cfg.ffn_kind(1) == "dense" and cfg.ffn_kind(2) == "moe"
    assert cfg.swiglu_limits(34) == (0.0, 5.0) and cfg.swiglu_limits(35) == (4.0, 5.0)
    assert cfg.swiglu_limits(41) == (4.0, 7.0) and cfg.swiglu_limits(42) == (0.0, 0.0)  # MTP: out of range
    assert cfg.replace(apply_swiglu_clamps=False).swiglu_limits(41) == (0.0, 0.0)
    # docs/model.md §2: 124.4B without the MTP layer, 127.5B with it.
    assert round(count_params(cfg, with_mtp=False) / 1e9, 1) == 124.4
    assert round(count_params(cfg) / 1e9, 1) == 127.5
    assert round(count_params(preset("ling-3.0-tiny")) / 1e9, 2) == 7.89
    hash(cfg)


def test_trailing_partial_group_is_mla():
    cfg = preset("toy").replace(num_layers=7, expert_swiglu_limits=(), shared_swiglu_limits=())
    assert [cfg.mixer_kind(i) for i in range(7)] == [KDA, KDA, MLA, KDA, KDA, MLA, MLA]


@pytest.mark.parametrize("name", ["ling-3.0-flash", "ling-3.0-tiny", "toy"])
def test_hf_round_trip(name):
    cfg = preset(name)
    assert from_hf(to_hf_dict(cfg)) == cfg


def test_transformers_names_and_aliases():
    raw = to_hf_dict(preset("toy"))
    raw["num_experts_per_token"] = raw.pop("num_experts_per_tok")
    raw["num_expert_group"] = raw.pop("n_group")
    raw["moe_renormalize"] = raw.pop("norm_topk_prob")
    raw["head_dim"], raw["linear_head_dim"] = 16, 32  # transformers overwrites head_dim with the rope dim
    cfg = from_hf(raw)
    assert (cfg.num_experts_per_tok, cfg.n_group, cfg.head_dim) == (4, 4, 32)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama"), "unknown model_type 'llama'"),
    (dict(kda_lower_bound=-8.0), "kda_lower_bound=-8.0 must lie in [-5, 0)"),
    (dict(num_experts=30), "num_experts=30 and n_group=4"),
    (dict(topk_group=9), "topk_group=9 must be <= n_group=4"),
    (dict(num_experts_per_tok=40), "num_experts_per_tok (config.json num_experts_per_token)=40 exceeds"),
    (dict(expert_swiglu_limit_list=[4.0] * 3), "expert_swiglu_limits (config.json expert_swiglu_limit_list) has 3 entries"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn' is not supported"),
    (dict(hidden_size=0), "hidden_size=0 must be a positive integer"),
    (dict(eos_token_id=4096), "eos/pad token id 4096 lies outside vocab_size=512"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=true is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_invalid_configs_name_the_field(change, message):
    raw = to_hf_dict(preset("toy"))
    raw.update(change)
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert message in str(e.value)


def test_missing_field_and_missing_file(tmp_path):
    raw = to_hf_dict(preset("toy"))
    del raw["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="lacks 'kv_lora_rank'"):
        from_hf(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        from_hf(tmp_path / "missing")
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("ling-4")


# ---- the layer schedule from config.json -------------------------------------------------------------------

CUSTOM_MIXERS = ["linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention",
                 "linear_attention"]
CUSTOM_FFNS = ["sparse", "dense", "sparse", "sparse", "dense", "sparse"]


def test_explicit_schedule_decides():
    raw = to_hf_dict(preset("toy"))
    raw.update(layer_types=CUSTOM_MIXERS, mlp_layer_types=CUSTOM_FFNS)
    cfg = from_hf(raw)
    assert cfg.layer_kinds == ((KDA, MOE), (MLA, DENSE), (MLA, MOE), (KDA, MOE), (KDA, DENSE), (KDA, MOE))
    assert cfg.mla_layers == (1, 2) and cfg.first_k_dense_replace == 1  # still read, overridden by the list
    assert (cfg.mixer_kind(6), cfg.ffn_kind(6)) == (MLA, MOE)  # the MTP layer, whatever the lists say
    mtp_mixer = param_specs(cfg)["mtp"]["layer"]["mixer"]
    assert mtp_mixer.keys() == param_specs(preset("toy"))["mtp"]["layer"]["mixer"].keys() and "w_kv_a" in mtp_mixer
    hash(cfg)
    written = to_hf_dict(cfg)
    assert (written["layer_types"], written["mlp_layer_types"]) == (CUSTOM_MIXERS, CUSTOM_FFNS)
    assert from_hf(written) == cfg


def test_schedule_equal_to_the_rule_is_stored_as_the_rule():
    cfg = preset("toy")
    raw = to_hf_dict(cfg)
    assert raw["layer_types"][2] == "full_attention" and raw["mlp_layer_types"][:2] == ["dense", "sparse"]
    assert from_hf(raw) == cfg and from_hf(raw).mixer_schedule == () == from_hf(raw).ffn_schedule
    del raw["layer_types"], raw["mlp_layer_types"]
    assert from_hf(raw) == cfg
    assert cfg.replace(mixer_schedule=tuple(k for k, _ in cfg.layer_kinds)) == cfg


def test_transformers_trailing_group_is_kda_when_listed():
    raw = to_hf_dict(preset("toy").replace(num_layers=7, expert_swiglu_limits=(), shared_swiglu_limits=()))
    assert raw["layer_types"][6] == "full_attention"  # ling-jax's rule
    raw["layer_types"][6] = "linear_attention"  # what transformers' rule writes
    cfg = from_hf(raw)
    assert cfg.mixer_kind(6) == KDA and cfg.mla_layers == (2, 5)
    assert cfg.mixer_kind(7) == MLA  # the MTP layer


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=CUSTOM_MIXERS[:5]), "config.json layer_types has 5 entries but num_hidden_layers=6: give one "
                                          "entry per main layer"),
    (dict(mlp_layer_types=CUSTOM_FFNS + ["sparse"]), "mlp_layer_types has 7 entries but num_hidden_layers=6"),
    (dict(layer_types=CUSTOM_MIXERS[:3] + ["sliding_attention"] + CUSTOM_MIXERS[4:]),
     "config.json layer_types[3]=\"sliding_attention\" is not a layer type ling-jax runs: use 'full_attention' (MLA) "
     "or 'linear_attention' (KDA)"),
    (dict(mlp_layer_types=CUSTOM_FFNS[:5] + ["moe"]),
     "config.json mlp_layer_types[5]=\"moe\" is not a layer type ling-jax runs: use 'dense' (dense MLP) or 'sparse' "
     "(MoE)"),
    (dict(layer_types=CUSTOM_MIXERS[:1] + [1] + CUSTOM_MIXERS[2:]), "layer_types[1]=1 is not a layer type"),
    (dict(layer_types="full_attention"), "config.json layer_types=\"full_attention\" is a string; it must be a list "
                                         "with one entry per layer"),
], ids=["short", "long", "mixer-value", "ffn-value", "mixer-int", "not-a-list"])
def test_bad_schedule_lists(change, message):
    raw = to_hf_dict(preset("toy"))
    raw.update(change)
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert message in str(e.value)


def test_schedule_fields_are_validated_directly():
    with pytest.raises(ConfigError, match=r"mixer_schedule has 2 entries; expected num_hidden_layers=6"):
        preset("toy", mixer_schedule=(KDA, MLA))
    with pytest.raises(ConfigError, match=r"ffn_schedule\[1\]='sparse' must be one of \('dense', 'moe'\)"):
        preset("toy", ffn_schedule=(MOE, "sparse", MOE, MOE, MOE, MOE))


# ---- the audit: values that would change the math ----------------------------------------------------------

@pytest.mark.parametrize("field, value, supported", [
    ("hidden_act", "gelu", '"silu"'),
    ("score_function", "softmax", '"sigmoid"'),
    ("scoring_func", "softmax", '"sigmoid"'),
    ("topk_method", "greedy", '"noaux_tc"'),
    ("moe_router_enable_expert_bias", False, "true"),
    ("router_dtype", "bf16", '"fp32"'),
    ("no_kda_lora", False, "true"),
    ("attention_bias", True, "false"),
    ("use_bias", True, "false"),
    ("use_qkv_bias", True, "false"),
    ("mtp_use_kda", True, "false"),
    ("kda_safe_gate", False, "true"),
    ("rope_interleave", False, "true"),
    ("tie_word_embeddings", True, "false"),
    ("gated_attention_proj_granularity_type", "token_wise", '"head_wise"'),
    ("kda_safe_gate", "false", "true"),  # a string is not the boolean
])
def test_refused_values_name_field_value_and_fix(field, value, supported):
    raw = to_hf_dict(preset("toy"))
    raw[field] = value
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert f"config.json {field}={json.dumps(value)} is not supported" in str(e.value)
    assert f"ling-jax runs {field}={supported}" in str(e.value)


@pytest.mark.parametrize("change, message", [
    (dict(rotary_dim=8), "rotary_dim=8 != qk_rope_head_dim = 16 (MLA rotates all qk_rope_head_dim dims): set "
                         "rotary_dim to 16"),
    (dict(qk_head_dim=32), "qk_head_dim=32 != qk_nope_head_dim + qk_rope_head_dim = 48"),
    (dict(linear_num_heads=8), "linear_num_heads=8 != num_attention_heads = 4"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000}),
     "rope_theta=6000000.0 and rope_parameters.rope_theta=10000 differ"),
    (dict(num_experts_per_token=3), "gives num_experts_per_tok under two names with different values "
                                    "(num_experts_per_token=3, num_experts_per_tok=4)"),
])
def test_restated_fields_must_agree(change, message):
    raw = to_hf_dict(preset("toy"))
    raw.update(change)
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert message in str(e.value)


def official_tiny_config() -> dict:
    """Ling-3.0-tiny's config.json as shipped: no schedule lists, integers where floats go, and every vestigial,
    restated and training field (docs/model.md §2)."""
    raw = to_hf_dict(preset("ling-3.0-tiny"))
    del raw["layer_types"], raw["mlp_layer_types"]
    raw.update(
        kda_lower_bound=-5, rope_theta=6000000, partial_rotary_factor=0.5, rotary_dim=64, qk_head_dim=192,
        rope_parameters={"partial_rotary_factor": 0.5, "rope_theta": 6000000, "rope_type": "default"},
        hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc", use_bias=False, use_qkv_bias=False,
        mtp_use_kda=False, use_qk_norm=True, linear_silu=True, group_norm_size=1, num_kv_heads_for_linear_attn=0,
        use_mla_nope=False, use_kda_lora=False, scale_router_input=False, seq_aux=True, value_norm=False,
        up_proj_norm=False, use_nGPT=False, max_window_layers=20, expert_swiglu_limit_list=None,
        share_expert_swiglu_limit_list=None, attention_dropout=0.0, embedding_dropout=0.0, output_dropout=0.0,
        initializer_range=0.02, mtp_loss_scaling_factor=0, output_router_logits=False, use_cache=False,
        dtype="bfloat16")
    return raw


def test_official_values_are_accepted():
    assert from_hf(official_tiny_config()) == preset("ling-3.0-tiny")


@pytest.mark.parametrize("field, value, kind", [
    ("hidden_size", "128", "an integer"),
    ("num_hidden_layers", True, "an integer"),
    ("num_experts", [32], "an integer"),
    ("q_lora_rank", 1.5, "an integer"),
    ("kda_lower_bound", "-5", "a number"),
    ("rope_theta", [6e6], "a number"),
    ("routed_scaling_factor", True, "a number"),
    ("norm_topk_prob", "true", "true or false"),
    ("expert_swiglu_limit_list", "4.0", "a list of numbers"),
    ("share_expert_swiglu_limit_list", [0, "5"] + [0] * 4, "a list of numbers"),
    ("rope_scaling", "yarn", "an object or null"),
    ("rope_parameters", 6e6, "an object or null"),
    ("rotary_dim", "16", "an integer"),
])
def test_wrong_typed_fields_are_named(field, value, kind):
    raw = to_hf_dict(preset("toy"))
    raw[field] = value
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert f"config.json {field}={json.dumps(value)} is " in str(e.value) and f"it must be {kind}" in str(e.value)


def test_wrong_typed_eos_and_nested_theta():
    raw = to_hf_dict(preset("toy"))
    raw["eos_token_id"] = ["2"]
    with pytest.raises(ConfigError, match=r'eos_token_id=\["2"\] must be a token id or a list of token ids'):
        from_hf(raw)
    raw = to_hf_dict(preset("toy"))
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_theta": "6e6"}
    with pytest.raises(ConfigError, match=r'rope_parameters.rope_theta="6e6" is a string; it must be a number'):
        from_hf(raw)


def test_invalid_json_names_file_line_and_column(tmp_path):
    text = json.dumps(to_hf_dict(preset("toy")), indent=2).replace('"hidden_size": 128,', '"hidden_size": 128,,')
    (tmp_path / "config.json").write_text(text)
    line = text.splitlines().index('  "hidden_size": 128,,') + 1
    with pytest.raises(ConfigError) as e:
        from_hf(tmp_path)
    msg = str(e.value)
    assert f"{tmp_path / 'config.json'} is not valid JSON" in msg and f"at line {line}, column 22" in msg
    assert "copy config.json from the original checkpoint again" in msg
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list, not a JSON object"):
        from_hf(tmp_path)
