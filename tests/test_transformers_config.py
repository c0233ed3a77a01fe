"""config.json as the installed transformers writes and reads it: BailingHybridConfig.save_pretrained loads into
ling-jax, `to_hf_dict` is what transformers reads back, and the SwiGLU limit lists keep their meaning both ways.

transformers 5.24 stores the limit lists as it was given them (null when absent); 5.25 writes one entry per decoder
layer (zeros when absent) and refuses any other length. The suite runs both (`make test` on the pinned set,
`make test-latest` on the newest), so each assertion holds for either.
"""

import dataclasses

import pytest

from ling_jax.config import ConfigError, from_hf, preset, to_hf_dict
from ling_jax.crosscheck import hf_config_dict

from tests.hf_ref import MOD, SmallConfig

ROUTED = (0.0, 0.0, 4.0, 4.0)
SHARED = (0.0, 5.0, 5.0, 7.0)
SMALL = SmallConfig("limits", num_hidden_layers=4, layer_group_size=2, q_lora_rank=None, first_k_dense_replace=1,
                    num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                    expert_swiglu_limit_list=ROUTED, share_expert_swiglu_limit_list=SHARED)


@pytest.mark.parametrize("with_lists", [True, False], ids=["limit-lists", "no-lists"])
def test_config_saved_by_transformers_loads(tmp_path, with_lists):
    small = SMALL if with_lists else dataclasses.replace(SMALL, expert_swiglu_limit_list=None,
                                                         share_expert_swiglu_limit_list=None)
    small.hf().save_pretrained(tmp_path)
    cfg = from_hf(tmp_path)
    assert cfg.num_layers == 4 and cfg.num_mtp_layers == 0
    assert (cfg.expert_swiglu_limits, cfg.shared_swiglu_limits) == ((ROUTED, SHARED) if with_lists else ((), ()))
    assert cfg.swiglu_limits(2) == ((4.0, 5.0) if with_lists else (0.0, 0.0))


@pytest.mark.parametrize("name", ["toy", "ling-3.0-flash", "ling-3.0-tiny"])
def test_to_hf_dict_is_what_transformers_reads_back(tmp_path, name):
    """Written by ling-jax, read by transformers (its validation included), saved again by transformers, and read by
    ling-jax: the same config, limits included."""
    cfg = preset(name)
    hf = MOD.BailingHybridConfig.from_dict(to_hf_dict(cfg))
    routed = list(cfg.expert_swiglu_limits) or [0.0] * cfg.num_layers
    assert [float(v) for v in hf.expert_swiglu_limit_list] == routed
    hf.save_pretrained(tmp_path)
    assert from_hf(tmp_path, router_weight_dtype=cfg.router_weight_dtype) == cfg


def test_limit_lists_with_the_mtp_layer_load_and_cut_for_transformers():
    """A list with one more entry, the MTP layer's, is a real checkpoint's choice: ling-jax reads it, and the
    cross-check hands transformers (which runs no MTP layer, and from 5.25 on refuses the extra entry) the decoder
    layers' part."""
    raw = to_hf_dict(preset("toy"))
    raw["expert_swiglu_limit_list"] = [0.0] * 4 + [4.0, 4.0, 3.0]
    cfg = from_hf(raw)
    assert cfg.swiglu_limits(6) == (3.0, 0.0)
    assert to_hf_dict(cfg)["expert_swiglu_limit_list"] == raw["expert_swiglu_limit_list"]
    hf = MOD.BailingHybridConfig.from_dict(hf_config_dict(raw))
    assert [float(v) for v in hf.expert_swiglu_limit_list] == [0.0] * 4 + [4.0, 4.0]


@pytest.mark.parametrize("n", [1, 5, 8])
def test_other_limit_list_lengths_are_refused_by_name(n):
    raw = to_hf_dict(preset("toy"))  # 6 decoder layers and an MTP layer
    raw["share_expert_swiglu_limit_list"] = [1.0] * n
    with pytest.raises(ConfigError) as e:
        from_hf(raw)
    assert (f"shared_swiglu_limits (config.json share_expert_swiglu_limit_list) has {n} entries, but a config of "
            "num_hidden_layers=6 and 1 MTP layer takes 6 (one per decoder layer), 7 (the MTP layer's too) or none"
            in str(e.value))


def test_a_cut_config_names_the_lengths_it_takes():
    with pytest.raises(ConfigError) as e:
        preset("toy").replace(num_layers=2, layer_group_size=2, num_mtp_layers=0)
    message = str(e.value)
    assert "has 6 entries, but a config of num_hidden_layers=2 and no MTP layer takes 2 (one per decoder layer) or " \
           "none" in message and "LingConfig.first_layers" in message
    cut = preset("toy").first_layers(2)
    assert cut.layer_kinds == preset("toy").layer_kinds[:2] and cut.swiglu_limits(1) == (0.0, 0.0)

