"""Checkpoint conversion: official layout -> params (exact), orbax round trip, synthetic checkpoints, bad inputs.

The transformers-written checkpoint is checked against transformers' *in-memory* weights, mapped to the params
layout by the transforms written out again below (independently of `conversion.hf`'s table), so a wrong table
entry cannot agree with itself.
"""

import json
import math
import shutil
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from conversion import CheckpointError, convert, hf, load_hf, load_params, save_params, synthetic, write_synthetic
from conversion.load import INDEX_NAME
from tests.hf_ref import MOD
from ling_jax.config import DENSE, KDA, MLA, MOE, ConfigError, from_hf, preset, to_hf_dict
from ling_jax.params import abstract_params, is_spec, param_specs


def leaves_by_path(tree) -> dict[str, jax.Array]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    return {hf.path_str(tuple(hf._key(k) for k in kp)): v for kp, v in flat}


# ---- a transformers-written checkpoint -------------------------------------------------------------------

HF_CONFIGS = {
    # KDA width H*K = 64 != hidden 48 and every MLA dim distinct, so a wrong transpose cannot keep its shape.
    "qnull": dict(num_hidden_layers=4, layer_group_size=2, q_lora_rank=None, first_k_dense_replace=1),
    "qlora": dict(num_hidden_layers=3, layer_group_size=3, q_lora_rank=24, first_k_dense_replace=0),
}


def hf_config(**kw):
    return MOD.BailingHybridConfig(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, pad_token_id=0, eos_token_id=1,
        num_mtp_layers=1, max_position_embeddings=128, **kw)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    """(dir, transformers config, state dict) of a random BailingHybridForCausalLM saved in several shards."""
    hcfg = hf_config(**HF_CONFIGS[request.param])
    torch.manual_seed(0)
    model = MOD.BailingHybridForCausalLM(hcfg)
    with torch.no_grad():  # transformers initialises norms to 1 and the bias to 0; randomise every tensor
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t))
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(path, max_shard_size="100KB")
    sd = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    return path, hcfg, sd


def expected_params(hcfg, sd) -> dict[str, np.ndarray]:
    """transformers' in-memory weights in the params layout (ling_jax.params docstring), written out by hand."""
    D, H, K, W = hcfg.hidden_size, hcfg.num_attention_heads, hcfg.linear_head_dim, hcfg.linear_conv_kernel_dim
    Dn, Dv, R, I = hcfg.qk_nope_head_dim, hcfg.v_head_dim, hcfg.kv_lora_rank, hcfg.moe_intermediate_size
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"],
           "lm_head": sd["lm_head.weight"].T}
    for l in range(hcfg.num_hidden_layers):
        src, dst = f"model.layers.{l}.", f"layers.{l}."
        a, m = src + "self_attn.", src + "mlp."
        out[dst + "input_norm"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_norm"] = sd[src + "post_attention_layernorm.weight"]
        if hcfg.layer_types[l] == "linear_attention":
            # w_in: per head h the columns [q | k | v | f | g] (K each) then b (1).
            proj = [sd[a + theirs + ".weight"].T.reshape(D, H, K)
                    for theirs in ("q_proj", "k_proj", "v_proj", "forget_gate.f_proj", "g_proj")]
            out[dst + "mixer.w_in"] = np.concatenate(proj + [sd[a + "b_proj.weight"].T[:, :, None]], axis=-1)
            conv = sd[a + "conv1d.weight"][:, 0, :]  # [3*H*K, W]: q | k | v channels
            out[dst + "mixer.conv_qkv"] = conv.reshape(3, H, K, W).transpose(3, 0, 1, 2)  # [W, 3 (q k v), H, K]
            out[dst + "mixer.A_log"] = sd[a + "forget_gate.A_log"]
            out[dst + "mixer.dt_bias"] = sd[a + "forget_gate.dt_bias"].reshape(H, K)
            out[dst + "mixer.o_norm"] = sd[a + "o_norm.weight"]
            out[dst + "mixer.w_o"] = sd[a + "o_proj.weight"].T.reshape(H, K, D)
        else:
            if hcfg.q_lora_rank is None:  # w_qg: per head h the query columns, then the gate's
                q = sd[a + "q_proj.weight"].T.reshape(D, H, Dn + hcfg.qk_rope_head_dim)
                out[dst + "mixer.w_qg"] = np.concatenate([q, sd[a + "g_proj.weight"].T[:, :, None]], axis=-1)
            else:
                out[dst + "mixer.w_q_a"] = sd[a + "q_a_proj.weight"].T
                out[dst + "mixer.q_a_norm"] = sd[a + "q_a_layernorm.weight"]
                out[dst + "mixer.w_q_b"] = sd[a + "q_b_proj.weight"].T.reshape(hcfg.q_lora_rank, H, -1)
                out[dst + "mixer.w_gate"] = sd[a + "g_proj.weight"].T
            out[dst + "mixer.w_kv_a"] = sd[a + "kv_a_proj_with_mqa.weight"].T
            out[dst + "mixer.kv_a_norm"] = sd[a + "kv_a_layernorm.weight"]
            kv_b = sd[a + "kv_b_proj.weight"].reshape(H, Dn + Dv, R)
            out[dst + "mixer.w_k_b"] = kv_b[:, :Dn].transpose(2, 0, 1)
            out[dst + "mixer.w_v_b"] = kv_b[:, Dn:].transpose(2, 0, 1)
            out[dst + "mixer.w_o"] = sd[a + "o_proj.weight"].T.reshape(H, Dv, D)
        if hcfg.mlp_layer_types[l] == "dense":
            for p in ("gate", "up", "down"):
                out[dst + f"ffn.w_{p}"] = sd[m + f"{p}_proj.weight"].T
        else:
            out[dst + "ffn.router"] = sd[m + "gate.weight"]  # [E, D]: torch's [out, in], kept
            out[dst + "ffn.expert_bias"] = sd[m + "gate.e_score_correction_bias"]
            # Expert matrices stay [out, in] (torch's layout) in ling-jax.
            gate_up = sd[m + "experts.gate_up_proj"]  # [E, 2I, D], gate rows first
            out[dst + "ffn.we_gate"] = gate_up[:, :I]
            out[dst + "ffn.we_up"] = gate_up[:, I:]
            out[dst + "ffn.we_down"] = sd[m + "experts.down_proj"]  # [E, D, I]
            for p in ("gate", "up", "down"):
                out[dst + f"ffn.ws_{p}"] = sd[m + f"shared_experts.{p}_proj.weight"]
    return out


def test_transformers_checkpoint_loads_exactly(hf_checkpoint):
    path, hcfg, sd = hf_checkpoint
    assert len(list(path.glob("*.safetensors"))) > 3
    with pytest.warns(UserWarning, match=r"no model\.layers\.\d+\.\* tensors .* loading without the MTP layer"):
        cfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    assert cfg.head_dim == hcfg.linear_head_dim and cfg.qk_rope_head_dim == hcfg.qk_rope_head_dim
    assert cfg.num_mtp_layers == 0 and "mtp" not in params
    assert jax.tree.structure(params) == jax.tree.structure(abstract_params(cfg, jnp.float32))

    got, want = leaves_by_path(params), expected_params(hcfg, sd)
    assert sorted(got) == sorted(want)
    for name, x in got.items():
        assert x.dtype == jnp.float32 and x.shape == want[name].shape, name
        np.testing.assert_array_equal(np.asarray(x), want[name], err_msg=name)


def test_transformers_checkpoint_bf16(hf_checkpoint):
    path, hcfg, sd = hf_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg, params = load_hf(path, dtype=jnp.bfloat16, progress=False)
    specs, want = leaves_by_path(param_specs(cfg)), expected_params(hcfg, sd)
    for name, x in leaves_by_path(params).items():
        assert x.dtype == specs[name].dtype(jnp.bfloat16), name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(jnp.asarray(want[name]).astype(x.dtype)), name)


def test_fused_transforms_invert_and_pack_per_head():
    """Each fused leaf's parts come back exactly (to_params(to_hf(x)) == x, also slice by slice as the loader fills
    it), and each official part sits in its own columns of every head. Exact equality: the transforms only move
    values. Every size is distinct (D 56, H 3, K 20, W 5, Dqk 26) so that a swapped axis cannot keep its shape."""
    cfg = preset("toy").replace(hidden_size=56, num_heads=3, head_dim=20, conv_kernel_size=5, qk_nope_head_dim=18,
                                qk_rope_head_dim=8)
    D, H, K, W, Dqk = 56, 3, 20, 5, 26
    fused = {hf.path_str(e.paths[0]): e for e in hf.plan(cfg) if e.fused and e.paths[0][:2] in (("layers", 0),
                                                                                                 ("layers", 2))}
    assert sorted(fused) == ["layers.0.mixer.conv_qkv", "layers.0.mixer.w_in", "layers.2.mixer.w_qg"]
    rng = np.random.default_rng(0)
    parts = {}  # leaf name -> (random leaf, its official parts)
    for name, entry in fused.items():
        x = rng.standard_normal(entry.specs[0].shape).astype(np.float32)
        shapes = [p.shape for p in entry.pieces]
        official = entry.transform.to_hf(x, shapes)
        assert [p.shape for p in official] == [entry.source_shape(i) for i in range(len(entry.sources))], name
        np.testing.assert_array_equal(entry.transform.to_params(official, shapes), x, err_msg=name)
        filled = np.full_like(x, np.nan)
        for i, part in enumerate(official):
            filled[entry.slot(i)] = entry.source_to_params(i, part)[0]
        np.testing.assert_array_equal(filled, x, err_msg=name)
        parts[name] = (x, official)

    h = 1  # rows h*K..(h+1)*K of a [H*K, D] projection are head h's columns
    w_in, (q, k, v, f, g, b) = parts["layers.0.mixer.w_in"]
    assert w_in.shape == (D, H, 5 * K + 1) and b.shape == (H, D)
    for i, part in enumerate((q, k, v, f, g)):
        np.testing.assert_array_equal(part[h * K:(h + 1) * K].T, w_in[:, h, i * K:(i + 1) * K])
    np.testing.assert_array_equal(b[h], w_in[:, h, 5 * K])
    conv, (q_taps, k_taps, v_taps) = parts["layers.0.mixer.conv_qkv"]
    assert conv.shape == (W, 3, H, K) and k_taps.shape == (H * K, 1, W)
    for i, taps in enumerate((q_taps, k_taps, v_taps)):
        np.testing.assert_array_equal(taps[h * K + 7, 0], conv[:, i, h, 7])
    w_qg, (q, gate) = parts["layers.2.mixer.w_qg"]
    assert w_qg.shape == (D, H, Dqk + 1) and gate.shape == (H, D)
    np.testing.assert_array_equal(q[h * Dqk:(h + 1) * Dqk].T, w_qg[:, h, :Dqk])
    np.testing.assert_array_equal(gate[h], w_qg[:, h, Dqk])


# ---- synthetic checkpoints -------------------------------------------------------------------------------

def mid_config():
    """Tiny's widths (hidden 1536, head dims 128, q_lora 256, kv_lora 512) in 4 layers, 16 experts, plus MTP."""
    return preset("ling-3.0-tiny", num_layers=4, vocab_size=4096, num_experts=16, n_group=4, topk_group=2,
                  num_experts_per_tok=4, num_mtp_layers=1, first_k_dense_replace=1, moe_intermediate_size=256,
                  shared_expert_intermediate_size=256, eos_token_ids=(2,), pad_token_id=0)


@pytest.fixture(scope="module")
def toy_synthetic(tmp_path_factory):
    cfg = preset("toy")
    path = write_synthetic(tmp_path_factory.mktemp("toy_synth"), cfg, seed=3, max_shard_bytes=256 * 1024,
                           progress=False)
    return path, cfg


def test_synthetic_round_trip_toy(toy_synthetic):
    path, cfg = toy_synthetic
    assert from_hf(path) == cfg
    assert len(json.loads((path / INDEX_NAME).read_text())["weight_map"]) == sum(
        len(e.sources) for e in hf.plan(cfg))
    assert len(list(path.glob("*.safetensors"))) > 3
    loaded_cfg, params = load_hf(path, progress=False)
    assert loaded_cfg == cfg and "mtp" in params
    got = leaves_by_path(params)
    want = leaves_by_path(abstract_params(cfg, jnp.bfloat16))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    # Loaded params mapped back by the inverse transforms give exactly the generated tensors.
    for entry in hf.plan(cfg):
        xs = [np.asarray(got[hf.path_str(p)]) for p in entry.paths]
        for i in range(len(entry.sources)):
            np.testing.assert_array_equal(entry.hf_tensor(xs, i), synthetic.synthetic_tensor(entry, i, seed=3),
                                          entry.names[i])
    # Scales follow init_value: norms near 1, O(1) embeddings, fan-in-scaled projections.
    assert abs(float(jnp.mean(got["layers.0.input_norm"].astype(jnp.float32))) - 1.0) < 0.05
    assert 0.9 < float(jnp.std(got["embed"].astype(jnp.float32))) < 1.1
    for fused in ("layers.0.mixer.w_in", "layers.2.mixer.w_qg"):  # every part drawn with the fan-in D
        w = got[fused].astype(jnp.float32)
        assert abs(float(jnp.std(w)) * math.sqrt(cfg.hidden_size) - 1.0) < 0.1, fused
    taps = got["layers.0.mixer.conv_qkv"]
    assert abs(float(jnp.std(taps)) * math.sqrt(cfg.conv_kernel_size) - 1.0) < 0.1


def test_bf16_router_kept_as_stored(tmp_path):
    """Routers stored BF16 (as a BF16 checkpoint may store them) load as bf16, exactly as stored, through load_hf
    and an orbax round trip (with or without a dtype); router_weight_dtype="float32" widens them; any other storage
    loads float32."""
    from conversion.load import TensorInfo, stored_router_dtype

    cfg = preset("toy").replace(router_weight_dtype="bfloat16")
    path = write_synthetic(tmp_path / "hf", cfg, seed=5, progress=False)
    header = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    gates = [n for n in header if n.endswith(".mlp.gate.weight")]
    assert len(gates) == sum(1 for l in range(cfg.total_layers) if l >= cfg.first_k_dense_replace)
    loaded_cfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    assert loaded_cfg == cfg
    got = leaves_by_path(params)
    routers = {k: v for k, v in got.items() if k.endswith(".router")}
    assert routers and {v.dtype for v in routers.values()} == {jnp.dtype(jnp.bfloat16)}
    assert got["layers.1.ffn.expert_bias"].dtype == jnp.float32 and got["embed"].dtype == jnp.float32
    entry = next(e for e in hf.plan(cfg) if e.names[0] == gates[0])
    np.testing.assert_array_equal(np.asarray(got[hf.path_str(entry.paths[0])]).astype(np.float32),
                                  synthetic.synthetic_tensor(entry, 0, seed=5).astype(np.float32))

    cfg32, wide = load_hf(path, dtype=jnp.float32, progress=False, router_weight_dtype="float32")
    assert cfg32 == cfg.replace(router_weight_dtype="float32")
    for k, v in routers.items():
        w = leaves_by_path(wide)[k]
        assert w.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(w), np.asarray(v.astype(jnp.float32)))
    with pytest.raises(ValueError, match="router_weight_dtype='bfloat16' must be None .* or 'float32'"):
        load_hf(path, router_weight_dtype="bfloat16")

    save_params(tmp_path / "ck", loaded_cfg, params)
    for dtype in (None, jnp.bfloat16):
        cfg_back, restored = load_params(tmp_path / "ck", dtype=dtype)
        assert cfg_back == cfg
        for k, v in routers.items():
            r = leaves_by_path(restored)[k]
            assert r.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(r), np.asarray(v))

    # Mixed storage (a hand-edited checkpoint): every router comes back float32, as cfg then says.
    mixed_params = jax.tree.map(lambda x: x, params)
    moe_layers = [lay for lay in mixed_params["layers"] if "router" in lay["ffn"]]
    moe_layers[0]["ffn"]["router"] = moe_layers[0]["ffn"]["router"].astype(jnp.float32)
    save_params(tmp_path / "mixed", loaded_cfg, mixed_params)
    cfg_mixed, restored = load_params(tmp_path / "mixed")
    assert cfg_mixed.router_weight_dtype == "float32"
    assert {lay["ffn"]["router"].dtype for lay in restored["layers"] if "router" in lay["ffn"]} == {
        jnp.dtype(jnp.float32)}

    info = lambda dt: TensorInfo("a.safetensors", (4, 2), dt)  # noqa: E731
    assert stored_router_dtype({"model.layers.1.mlp.gate.weight": info("BF16")}) == "bfloat16"
    mixed = {"model.layers.1.mlp.gate.weight": info("BF16"), "model.layers.2.mlp.gate.weight": info("F32")}
    assert stored_router_dtype(mixed) == "float32"
    assert stored_router_dtype(mixed, ignore_prefix="model.layers.2.") == "bfloat16"
    assert stored_router_dtype({"model.layers.1.mlp.gate.weight": info("F16")}) == "float32"
    with pytest.raises(ConfigError, match="router_weight_dtype='float16' must be one of"):
        preset("toy", router_weight_dtype="float16")


def test_synthetic_parallel_write_is_the_serial_bytes(toy_synthetic, tmp_path):
    """Shards written by worker processes are byte for byte the serial writer's, index and config included."""
    path, cfg = toy_synthetic
    out = write_synthetic(tmp_path / "parallel", cfg, seed=3, max_shard_bytes=256 * 1024, progress=False, workers=3)
    serial = sorted(p.name for p in path.iterdir())
    assert sorted(p.name for p in out.iterdir()) == serial and len(serial) > 4
    for name in serial:
        assert (out / name).read_bytes() == (path / name).read_bytes(), name


def test_synthetic_without_mtp_is_skipped_quietly(toy_synthetic):
    path, cfg = toy_synthetic
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg0, params = load_hf(path, with_mtp=False, progress=False)
    assert cfg0.num_mtp_layers == 0 and "mtp" not in params
    assert jax.tree.structure(params) == jax.tree.structure(abstract_params(cfg0))


def test_synthetic_mid_size_streams(tmp_path):
    cfg = mid_config()
    entries = hf.plan(cfg)
    largest = max(math.prod(e.source_shape(i)) * 4 for e in entries for i in range(len(e.sources)))  # float32
    tracemalloc.start()
    write_synthetic(tmp_path, cfg, max_shard_bytes=100 * 2**20, progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    total = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert total > 300 * 2**20 and len(list(tmp_path.glob("*.safetensors"))) >= 4
    # Holds about one tensor (float32 draw + bf16 copy), never a shard or the checkpoint.
    assert peak < 3 * largest < 100 * 2**20, (peak, largest)

    loaded_cfg, params = load_hf(tmp_path, progress=False)
    assert loaded_cfg == cfg
    got = leaves_by_path(params)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in leaves_by_path(abstract_params(cfg)).items()}
    assert got["mtp.layer.mixer.w_q_b"].shape == (256, 16, 192)
    entry = next(e for e in entries if e.paths[0] == ("mtp", "layer", "mixer", "w_k_b"))
    kv_b = entry.hf_tensor([np.asarray(got["mtp.layer.mixer.w_k_b"]), np.asarray(got["mtp.layer.mixer.w_v_b"])], 0)
    np.testing.assert_array_equal(kv_b, synthetic.synthetic_tensor(entry, 0))


def test_flash_layout_matches_spec():
    """docs/model.md §4/§5 names and shapes of the full preset, and its size, without writing ~255 GB."""
    cfg = preset("ling-3.0-flash")
    shapes = {n: e.source_shape(i) for e in hf.plan(cfg) for i, n in enumerate(e.names)}
    assert len(shapes) == 3 + 42 * 2 + 35 * 13 + 7 * 6 + 2 * 3 + 40 * (2 + 3 * 512 + 3) + (4 + 2 + 6 + 2 + 3 * 512 + 3)
    spec3 = {
        "model.word_embeddings.weight": (157184, 2560), "lm_head.weight": (157184, 2560),
        "model.layers.0.attention.q_proj.weight": (4096, 2560), "model.layers.0.attention.b_proj.weight": (32, 2560),
        "model.layers.0.attention.q_conv1d.weight": (4096, 1, 4), "model.layers.0.attention.A_log": (32,),
        "model.layers.0.attention.dt_bias": (4096,), "model.layers.0.attention.o_norm.weight": (128,),
        "model.layers.0.attention.o_proj.weight": (2560, 4096), "model.layers.1.mlp.gate_proj.weight": (6144, 2560),
        "model.layers.5.attention.q_proj.weight": (6144, 2560),
        "model.layers.5.attention.kv_a_proj_with_mqa.weight": (576, 2560),
        "model.layers.5.attention.kv_b_proj.weight": (8192, 512), "model.layers.5.attention.g_proj.weight": (32, 2560),
        "model.layers.5.attention.dense.weight": (2560, 4096), "model.layers.41.mlp.gate.weight": (512, 2560),
        "model.layers.41.mlp.gate.expert_bias": (512,), "model.layers.2.mlp.experts.511.down_proj.weight": (2560, 768),
        "model.layers.2.mlp.shared_experts.up_proj.weight": (768, 2560), "model.layers.42.eh_proj.weight": (2560, 5120),
        "model.layers.42.enorm.weight": (2560,), "model.layers.42.attention.kv_b_proj.weight": (8192, 512),
        "model.layers.42.mlp.experts.0.gate_proj.weight": (768, 2560),
    }
    assert {n: shapes[n] for n in spec3} == spec3
    shards = synthetic.shard_plan(cfg)
    total = sum(n for s in shards for _, _, n in s)
    assert 250e9 < total < 260e9 and len(shards) == math.ceil(total / synthetic.DEFAULT_MAX_SHARD_BYTES)


@pytest.mark.parametrize("name", ["toy", "ling-3.0-tiny", "ling-3.0-flash"])
def test_config_json_round_trip(name):
    cfg = preset(name)
    assert from_hf(to_hf_dict(cfg)) == cfg


# ---- orbax -----------------------------------------------------------------------------------------------

def tp_shardings(cfg, mesh):
    """Split the first experts/heads/vocab/ffn axis that divides over the mesh; replicate the rest."""
    n = mesh.devices.size

    def one(spec):
        axes, used = [], False
        for dim, ax in zip(spec.shape, spec.axes):
            take = not used and ax in ("experts", "heads", "vocab", "ffn") and dim % n == 0
            axes.append("tp" if take else None)
            used |= take
        return NamedSharding(mesh, P(*axes))
    return jax.tree.map(one, param_specs(cfg), is_leaf=is_spec)


def test_orbax_round_trip_sharded(toy_synthetic, tmp_path):
    path, cfg = toy_synthetic
    mesh = jax.make_mesh((len(jax.devices()),), ("tp",))
    shardings = tp_shardings(cfg, mesh)
    cfg_in, params = load_hf(path, shardings=shardings, progress=False)
    assert params["layers"][1]["ffn"]["we_gate"].sharding == shardings["layers"][1]["ffn"]["we_gate"]
    n = mesh.devices.size  # conftest gives 4 host devices: the experts really are split
    assert params["layers"][1]["ffn"]["we_gate"].addressable_shards[0].data.shape == (32 // n, 64, 128)

    save_params(tmp_path / "ck", cfg_in, params)
    assert (tmp_path / "ck" / "config.json").is_file()
    cfg_out, restored = load_params(tmp_path / "ck", shardings=shardings)
    assert cfg_out == cfg_in
    for (name, a), b, s in zip(leaves_by_path(params).items(), jax.tree.leaves(restored), jax.tree.leaves(shardings)):
        assert a.dtype == b.dtype and b.sharding == s, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)

    _, as_f32 = load_params(tmp_path / "ck", dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(as_f32)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(as_f32["embed"]), np.asarray(params["embed"]).astype(np.float32))
    with pytest.raises(FileExistsError):
        save_params(tmp_path / "ck", cfg_in, params)


def test_convert(hf_checkpoint, tmp_path):
    path, hcfg, sd = hf_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = convert(path, tmp_path / "out", dtype=jnp.float32, progress=False)
    cfg2, params = load_params(tmp_path / "out")
    assert cfg2 == cfg
    want = expected_params(hcfg, sd)
    for name, x in leaves_by_path(params).items():
        np.testing.assert_array_equal(np.asarray(x), want[name], err_msg=name)


def test_orbax_structure_mismatch(toy_synthetic, tmp_path):
    path, cfg = toy_synthetic
    _, params = load_hf(path, progress=False)
    save_params(tmp_path / "ck", cfg, params)
    cfg_json = to_hf_dict(cfg.replace(hidden_size=64))
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(CheckpointError, match=r"wrong shape \(\d+\): embed: expected \[512, 64\], found \[512, 128\]"
                                              r"(.|\n)*run `ling-jax convert` on the HF checkpoint again"):
        load_params(tmp_path / "ck")


def test_orbax_old_down_layout(toy_synthetic, tmp_path, monkeypatch):
    """A checkpoint in the older expert layout holds every down projection [.., Ie, D]: loading names the tensors
    and the layout change."""
    from conversion import orbax_io

    path, cfg = toy_synthetic
    _, params = load_hf(path, progress=False)
    old = jax.tree_util.tree_map_with_path(
        lambda kp, x: jnp.swapaxes(x, -1, -2) if hf.path_str(tuple(hf._key(k) for k in kp)).endswith(
            ("we_down", "ws_down")) else x, params)
    with monkeypatch.context() as m:  # today's save_params refuses the old layout: write it as an old one did
        m.setattr(orbax_io, "_check_structure", lambda *a: None)
        save_params(tmp_path / "ck", cfg, old)
    with pytest.raises(CheckpointError, match=r"wrong shape \(\d+\): layers\.\d+\.ffn\.we_down: expected(.|\n)*"
                                              r"the expert down projections \[E, Ie, D\] before they became "
                                              r"\[E, D, Ie\]"):
        load_params(tmp_path / "ck")


def test_orbax_old_separate_projections(toy_synthetic, tmp_path, monkeypatch):
    """A checkpoint from before the fused projections (KDA mixer.w_q .. w_b and conv_q .. conv_v, MLA w_q and
    w_gate) is named as that older layout, with the fix."""
    from conversion import orbax_io

    path, cfg = toy_synthetic
    _, params = load_hf(path, progress=False)
    K, Dqk = cfg.head_dim, cfg.qk_head_dim

    def separate(mixer):
        if "w_in" in mixer:
            w_in, conv = mixer.pop("w_in"), mixer.pop("conv_qkv")
            for i, name in enumerate(("w_q", "w_k", "w_v", "w_f", "w_g")):
                mixer[name] = w_in[..., i * K:(i + 1) * K]
            mixer["w_b"] = w_in[..., 5 * K]
            for i, name in enumerate(("conv_q", "conv_k", "conv_v")):
                mixer[name] = conv[:, i]
        else:
            w_qg = mixer.pop("w_qg")
            mixer["w_q"], mixer["w_gate"] = w_qg[..., :Dqk], w_qg[..., Dqk]

    old = jax.tree.map(lambda x: x, params)  # new containers: `params` keeps its leaves
    for layer in old["layers"] + [old["mtp"]["layer"]]:
        separate(layer["mixer"])
    with monkeypatch.context() as m:  # today's save_params refuses the old layout: write it as an old one did
        m.setattr(orbax_io, "_check_structure", lambda *a: None)
        save_params(tmp_path / "ck", cfg, old)
    with pytest.raises(CheckpointError) as info:
        load_params(tmp_path / "ck")
    msg = str(info.value)
    for part in ("missing (", "layers.0.mixer.w_in", "layers.2.mixer.w_qg", "unexpected (", "layers.0.mixer.conv_q",
                 "it holds the separate-projection layout of an older ling-jax",
                 "run `ling-jax convert` on the HF checkpoint again"):
        assert part in msg, f"{part!r} not in:\n{msg}"
    assert "MoE router [D, E]" not in msg  # no leaf changed shape: that hint would mislead


# ---- bad inputs ------------------------------------------------------------------------------------------

def mutate(src, dst, fn, config=None):
    """Copy checkpoint `src` to `dst`, rewriting every shard's {name: array} with `fn(name, tensors)`."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(dst / file)
        fn(file, tensors)
        save_file(tensors, dst / file, metadata={"format": "pt"})
    index["weight_map"] = {n: f for f in sorted(set(index["weight_map"].values())) for n in load_file(dst / f)}
    (dst / INDEX_NAME).write_text(json.dumps(index))
    if config:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def expect_error(path, *patterns, error=CheckpointError):
    with pytest.raises(error) as info:
        load_hf(path, progress=False)
    for p in patterns:
        assert p in str(info.value), f"{p!r} not in:\n{info.value}"
    return str(info.value)


Q = "model.layers.0.attention.q_proj.weight"


def test_missing_tensor(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    bad = mutate(path, tmp_path / "ck", lambda f, t: t.pop(Q, None))
    expect_error(bad, f"missing (1):\n      {Q}")


def test_missing_experts_are_folded(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    drop = lambda f, t: [t.pop(n) for n in list(t) if n.startswith("model.layers.2.mlp.experts.")]
    bad = mutate(path, tmp_path / "ck", drop)
    expect_error(bad, "missing (96):", "model.layers.2.mlp.experts.{0-31}.gate_proj.weight",
                 "model.layers.2.mlp.experts.{0-31}.down_proj.weight")


def test_unexpected_tensor(toy_synthetic, tmp_path):
    path, _ = toy_synthetic

    def add(file, t):
        if Q in t:
            t["model.layers.0.attention.bogus.weight"] = np.zeros(3, np.float32)
            t["model.layers.0.attention.kv_b_proj.weight"] = np.zeros(3, np.float32)
            t["model.layers.1.mlp.experts.32.up_proj.weight"] = np.zeros(3, np.float32)
    bad = mutate(path, tmp_path / "ck", add)
    expect_error(bad, "unexpected (3):", "model.layers.0.attention.bogus.weight",
                 "model.layers.0.attention.kv_b_proj.weight  [a mla name, but layer 0 is kda + dense]",
                 "model.layers.1.mlp.experts.32.up_proj.weight  [expert 32 >= num_experts = 32]")


def test_wrong_shape(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    names = ("model.layers.0.attention.b_proj.weight", "model.layers.2.attention.kv_b_proj.weight")
    bad = mutate(path, tmp_path / "ck", lambda f, t: t.update(
        {n: np.ascontiguousarray(x.T) for n, x in t.items() if n in names}))
    expect_error(bad, "wrong shape (2):",
                 f"{names[0]}: expected [4, 128] (for layers.0.mixer.w_in), found [128, 4]",
                 f"{names[1]}: expected [256, 64] (for layers.2.mixer.w_k_b + layers.2.mixer.w_v_b), found [64, 256]")


def test_fused_part_missing_or_mis_shaped(toy_synthetic, tmp_path):
    """A missing or mis-shaped part of a fused leaf is named by its official name and the leaf it feeds."""
    path, _ = toy_synthetic
    k_proj, g_proj = "model.layers.0.attention.k_proj.weight", "model.layers.2.attention.g_proj.weight"
    k_conv = "model.layers.1.attention.k_conv1d.weight"

    def damage(file, t):
        t.pop(k_proj, None)
        t.pop(g_proj, None)
        if k_conv in t:
            t[k_conv] = np.ascontiguousarray(t[k_conv][:, :, 1:])
    bad = mutate(path, tmp_path / "ck", damage)
    expect_error(bad, f"missing (2):\n      {k_proj}  [one of the 6 tensors packed into layers.0.mixer.w_in]\n"
                      f"      {g_proj}  [one of the 2 tensors packed into layers.2.mixer.w_qg]",
                 f"wrong shape (1):\n      {k_conv}: expected [128, 1, 4] (for layers.1.mixer.conv_qkv), "
                 "found [128, 1, 3]")


def test_unknown_model_type(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    bad = mutate(path, tmp_path / "ck", lambda f, t: None, config={"model_type": "llama"})
    msg = expect_error(bad, "unknown model_type 'llama'", error=ConfigError)
    assert "bailing_hybrid" in msg


def test_vocab_mismatch(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    bad = mutate(path, tmp_path / "ck", lambda f, t: None, config={"vocab_size": 500})
    msg = expect_error(bad, "vocab mismatch: model.word_embeddings.weight has 512 rows but config.json vocab_size=500",
                       "vocab mismatch: lm_head.weight has 512 rows")
    assert "wrong shape" not in msg


def test_duplicates(toy_synthetic, tmp_path):
    path, _ = toy_synthetic
    bias = "model.layers.1.mlp.gate.expert_bias"

    def dup(file, t):
        if bias in t:
            t["model.layers.1.mlp.gate.e_score_correction_bias"] = t[bias]
    bad = mutate(path, tmp_path / "ck", dup)
    expect_error(bad, f"duplicate (two names for one tensor) (1):\n      {bias} and "
                      "model.layers.1.mlp.gate.e_score_correction_bias (both name layers.1.ffn.expert_bias)")

    bad2 = tmp_path / "ck2"
    shutil.copytree(path, bad2)
    index = json.loads((bad2 / INDEX_NAME).read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    t = load_file(bad2 / second)
    t["model.norm.weight"] = np.ones(128, np.float32)
    save_file(t, bad2 / second)
    expect_error(bad2, "duplicate tensor model.norm.weight in shards")


def test_all_problems_in_one_error(toy_synthetic, tmp_path):
    path, _ = toy_synthetic

    def many(file, t):
        t.pop(Q, None)
        t.pop("model.layers.6.eh_proj.weight", None)  # a partial MTP layer is an error, not a warning
        if "model.norm.weight" in t:
            t["model.norm.weight"] = np.ones(7, np.float32)
            t["extra.weight"] = np.ones(1, np.float32)
    bad = mutate(path, tmp_path / "ck", many, config={"vocab_size": 500})
    expect_error(bad, "vocab mismatch",
                 f"missing (2):\n      {Q}  [one of the 6 tensors packed into layers.0.mixer.w_in]\n"
                 "      model.layers.6.eh_proj.weight",
                 "unexpected (1):\n      extra.weight", "model.norm.weight: expected [128]")


def test_alias_and_single_file(toy_synthetic, tmp_path):
    """`e_score_correction_bias` alone and KDA `dense` (what transformers writes) load; so does one unsharded file."""
    path, cfg = toy_synthetic
    _, ref = load_hf(path, progress=False)
    renames = {"model.layers.1.mlp.gate.expert_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
               "model.layers.0.attention.o_proj.weight": "model.layers.0.attention.dense.weight"}
    one = tmp_path / "one"
    one.mkdir()
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
    save_file({renames.get(n, n): x for n, x in tensors.items()}, one / "model.safetensors")
    shutil.copy(path / "config.json", one / "config.json")
    _, params = load_hf(one, progress=False)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the layer schedule against the tensors --------------------------------------------------------------

def edit_config(src, dst, **changes):
    """Copy checkpoint `src` to `dst` with config.json entries changed (None deletes one)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for name, value in changes.items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_schedule_conflict_comes_first_and_names_the_list(toy_synthetic, tmp_path):
    path, cfg = toy_synthetic
    mixers = ["linear_attention", "linear_attention", "linear_attention", "linear_attention", "linear_attention",
              "full_attention"]  # layer 2 holds MLA tensors
    ffns = ["dense", "sparse", "sparse", "dense", "sparse", "sparse"]  # layer 3 holds MoE tensors
    bad = edit_config(path, tmp_path / "ck", layer_types=mixers, mlp_layer_types=ffns)
    msg = expect_error(
        bad, "layer 2: config.json layer_types says linear_attention (KDA) but the checkpoint holds MLA tensors",
        "layer 3: config.json mlp_layer_types says dense (dense MLP) but the checkpoint holds MoE tensors",
        'fix: correct layer_types in config.json: layer_types[2] = "full_attention"',
        'fix: correct mlp_layer_types in config.json: mlp_layer_types[3] = "sparse"')
    body = msg.splitlines()
    assert body[1].strip().startswith("layer schedule of config.json differs from the tensors")
    assert msg.index("layer 2: config.json") < msg.index("missing (") < msg.index("unexpected (")  # listing kept
    assert "layer 0:" not in msg and "layer 6:" not in msg  # agreeing layers and the MTP layer are not named


def test_schedule_conflict_from_the_rule(toy_synthetic, tmp_path):
    """Without layer_types the layer_group_size rule decides, and the message says so."""
    path, cfg = toy_synthetic
    bad = edit_config(path, tmp_path / "ck", layer_types=None, layer_group_size=2)
    expect_error(bad, "layer 1: the layer_group_size=2 rule (config.json has no layer_types) says full_attention "
                      "(MLA) but the checkpoint holds KDA tensors",
                 "layer 2: the layer_group_size=2 rule (config.json has no layer_types) says linear_attention (KDA) "
                 "but the checkpoint holds MLA tensors",
                 "fix: add layer_types to config.json (one entry per main layer) with "
                 'layer_types[1] = "linear_attention", layer_types[2] = "full_attention", '
                 'layer_types[3] = "linear_attention"')


def test_custom_schedule_round_trip(tmp_path):
    """A dense layer after MoE ones and MLA twice in a row: written, read back and loaded exactly."""
    cfg = preset("toy").replace(mixer_schedule=(KDA, MLA, MLA, KDA, KDA, KDA),
                                ffn_schedule=(MOE, DENSE, MOE, MOE, DENSE, MOE))
    path = write_synthetic(tmp_path / "hf", cfg, seed=4, progress=False)
    assert from_hf(path) == cfg
    loaded_cfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    assert loaded_cfg == cfg
    assert "router" in params["layers"][0]["ffn"] and "w_gate" in params["layers"][1]["ffn"]
    assert "w_kv_a" in params["layers"][2]["mixer"] and "w_in" in params["layers"][5]["mixer"]
    got = leaves_by_path(params)
    for entry in hf.plan(cfg):
        xs = [np.asarray(got[hf.path_str(p)]) for p in entry.paths]
        for i in range(len(entry.sources) if entry.fused else 1):
            np.testing.assert_array_equal(entry.hf_tensor(xs, i).astype(np.float32),
                                          synthetic.synthetic_tensor(entry, i, seed=4).astype(np.float32),
                                          entry.names[i])


# ---- unreadable files ------------------------------------------------------------------------------------

def first_shard(path):
    return sorted(path.glob("*.safetensors"))[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage-header"])
def test_corrupt_shard_is_named(toy_synthetic, tmp_path, damage):
    path, _ = toy_synthetic
    bad = tmp_path / "ck"
    shutil.copytree(path, bad)
    shard = first_shard(bad)
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:
        data[8:40] = bytes(range(200, 232))  # not UTF-8, inside the JSON header
    shard.write_bytes(bytes(data))
    expect_error(bad, f"{shard.name}: Error while deserializing header", "re-download or re-copy these shard files",
                 "cannot be read (truncated or corrupt)")


def test_shard_damaged_after_the_headers_were_read(toy_synthetic, tmp_path, monkeypatch):
    """A shard that breaks between the header check and the tensor read is named too."""
    from conversion import load

    path, _ = toy_synthetic
    bad = tmp_path / "ck"
    shutil.copytree(path, bad)
    catalog = load.read_catalog(bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    monkeypatch.setattr(load, "read_catalog", lambda hf_dir: catalog)
    expect_error(bad, f"shard {shard.name} in {bad} cannot be read", "re-download or re-copy that shard file")


@pytest.mark.parametrize("index_text, message", [
    ('{"weight_map": {"a": "b",}}', "is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
    ('{"metadata": {}}', 'has no "weight_map" object of tensor name -> shard file'),
    ('{"weight_map": ["model-00001.safetensors"]}', 'has no "weight_map" object'),
], ids=["invalid-json", "no-weight-map", "weight-map-list"])
def test_bad_index_is_named(toy_synthetic, tmp_path, index_text, message):
    path, _ = toy_synthetic
    bad = tmp_path / "ck"
    shutil.copytree(path, bad)
    (bad / INDEX_NAME).write_text(index_text)
    expect_error(bad, f"{bad / INDEX_NAME} {message}", "re-download or re-copy it")


# ---- the dtype of the checkpoint -------------------------------------------------------------------------

def test_default_dtype_is_the_stored_one(toy_synthetic, tmp_path):
    path, cfg = toy_synthetic  # stored BF16
    _, params = load_hf(path, progress=False)
    specs = leaves_by_path(param_specs(cfg))
    assert {k: v.dtype for k, v in leaves_by_path(params).items()} == {
        k: s.dtype(jnp.bfloat16) for k, s in specs.items()}
    assert params["embed"].dtype == jnp.bfloat16

    f16 = write_synthetic(tmp_path / "f16", cfg, dtype="float16", progress=False)
    expect_error(f16, "model.word_embeddings.weight is stored F16", "pass dtype=jnp.bfloat16 or dtype=jnp.float32 "
                      "to load_hf (--dtype bfloat16 or --dtype float32)")
    _, params16 = load_hf(f16, dtype=jnp.float32, progress=False)
    assert params16["embed"].dtype == jnp.float32


def test_default_dtype_of_a_transformers_checkpoint(hf_checkpoint):
    path, _, _ = hf_checkpoint  # transformers saved a float32 model: every tensor F32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, params = load_hf(path, progress=False)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
