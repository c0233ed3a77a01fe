"""LingConfig: exact presets, config.json names and aliases, and one clear error per invalid field."""

import json

import pytest

from ling_jax.config import ConfigError, KDA, MLA, from_hf, preset, to_hf_dict
from ling_jax.params import count_params


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
    (dict(num_experts_per_tok=40), "num_experts_per_tok=40 exceeds"),
    (dict(expert_swiglu_limit_list=[4.0] * 3), "expert_swiglu_limits has 3 entries"),
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
