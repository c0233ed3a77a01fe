"""Block-FP8 weights end to end: quantisation bounds, the -fp8 checkpoint layout (load, validate, convert, orbax),
the model on FP8 params against the model on their dequantised values, and the memory plan that refuses what does
not fit.

Tolerances: FP8 params and their dequantised float32 copy hold the same values, so float32 logits differ only by
the order of fp32 sums (<= 1e-5). Greedy tokens through the Pallas kernels (interpret mode) equal the dequantised
reference's token for token.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conversion import fp8_blocks, hf
from conversion.load import CheckpointError, load_hf, read_catalog, validate
from conversion.orbax_io import convert, load_params, save_params
from conversion.synthetic import write_synthetic
from ling_jax import memory, model
from ling_jax.config import ConfigError, from_hf, preset, to_hf_dict
from ling_jax.engine.generate import generate
from ling_jax.engine.sampling import Greedy
from ling_jax.params import count_params, is_fp8, param_bytes, param_specs
from pallas_kernels.common import fp8
from tests.cli_run import assert_refused, run_ling_jax
from tests.numerics import input_seed, rel_err

TOY = preset("toy")
TOY_FP8 = TOY.replace(quantization="fp8")
PROMPT = np.array([[7, 41, 3, 99, 12, 250, 18, 5]], np.int32)


def _dequantized(params):
    return jax.tree.map(lambda w: fp8.dequantize(w, jnp.float32) if isinstance(w, fp8.Fp8Weight) else w, params,
                        is_leaf=lambda x: isinstance(x, fp8.Fp8Weight))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("fp8") / "ck", TOY_FP8, seed=input_seed(3), dtype="float32",
                           progress=False)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("f32") / "ck", TOY, seed=input_seed(4), dtype="float32",
                           progress=False)


def _e4m3_bound(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Round-to-nearest E4M3 of w / scale: half an ulp, 2^-4 relative for normals (3 mantissa bits), and half the
    smallest subnormal step (2^-10 of the scale) near zero."""
    return np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)


def test_quantize_round_trip_within_e4m3_bound_per_block():
    rng = np.random.default_rng(input_seed(0))
    # Blocks of very different magnitudes, a ragged edge (300 x 200 is not a multiple of 128) and an all-zero block.
    w = rng.standard_normal((300, 200)).astype(np.float32) * np.exp(rng.uniform(-8, 4, (300, 1))).astype(np.float32)
    w[:128, :128] = 0.0
    q, scale_inv = fp8_blocks.quantize(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale_inv.shape == (3, 2) and scale_inv.dtype == np.float32
    expanded = np.repeat(np.repeat(scale_inv, 128, 0)[:300], 128, 1)[:, :200]
    back = fp8_blocks.dequantize(q, scale_inv)
    assert (np.abs(back - w) <= _e4m3_bound(w, expanded)).all()
    assert (back[:128, :128] == 0).all()
    # Each block's largest magnitude maps to E4M3's largest value, 448.
    blocks = np.abs(q.astype(np.float32))[128:256, :128]
    assert blocks.max() == 448.0
    # The kernels' jnp quantiser (IN_OUT: 128 rows x 1 column) keeps the same bound.
    wq = fp8.quantize(jnp.asarray(w.T), fp8.IN_OUT)
    got = np.asarray(fp8.dequantize(wq))
    assert (np.abs(got - w.T) <= _e4m3_bound(w.T, np.asarray(fp8.expanded_scale(wq)))).all()


def test_config_reads_and_writes_the_release_quantization_config():
    raw = to_hf_dict(TOY_FP8)
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    assert from_hf(raw) == TOY_FP8
    with pytest.raises(ConfigError, match='quant_method="awq" is not supported'):
        from_hf(raw | {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match=r"weight_block_size=\[64, 64\] is not supported"):
        from_hf(raw | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})


def test_specs_quantise_the_decoder_projections_and_experts_only():
    specs = param_specs(TOY_FP8)
    layer = specs["layers"][1]
    assert is_fp8(layer["mixer"]["w_o"]) and layer["mixer"]["w_o"].layout == fp8.IN_OUT
    assert layer["mixer"]["w_o"].n_in == 2
    assert is_fp8(layer["ffn"]["we_down"]) and layer["ffn"]["we_down"].layout == fp8.OUT_IN
    for kept in (specs["embed"], specs["lm_head"], layer["ffn"]["router"], specs["layers"][2]["mixer"]["kv_a_norm"],
                 specs["mtp"]["eh_proj"]):
        assert not is_fp8(kept)
    assert count_params(TOY_FP8) == count_params(TOY)
    flash = preset("ling-3.0-flash")
    # The full model in FP8 is ~129 GB (weights at one byte, their scales, the bf16 embedding and lm_head).
    assert 125e9 < param_bytes(flash.replace(quantization="fp8")) < 131e9 < 250e9 < param_bytes(flash)


def test_fp8_loader_gives_the_logits_of_the_dequantised_model(fp8_dir):
    cfg, params = load_hf(fp8_dir, dtype=jnp.float32, progress=False)
    assert cfg.quantization == "fp8" and isinstance(params["layers"][0]["mixer"]["w_in"], fp8.Fp8Weight)
    cfg_f, dequant_at_load = load_hf(fp8_dir, dtype=jnp.float32, progress=False, fp8=False)
    assert cfg_f.quantization is None
    # Dequantising the params' layout equals dequantising the checkpoint's blocks, value for value.
    for a, b in zip(jax.tree.leaves(_dequantized(params)), jax.tree.leaves(dequant_at_load)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = model.prefill(params, PROMPT, cfg, max_len=32, all_logits=True)[0]
    want = model.prefill(dequant_at_load, PROMPT, cfg_f, max_len=32, all_logits=True)[0]
    assert rel_err(got, want) <= 1e-5


def test_fp8_greedy_through_the_kernels_equals_the_dequantised_reference(fp8_dir):
    cfg, params = load_hf(fp8_dir, dtype=jnp.float32, progress=False)
    cfg_f, ref_params = load_hf(fp8_dir, dtype=jnp.float32, progress=False, fp8=False)
    kw = dict(max_new_tokens=9, sampler=Greedy(), block_size=4, ignore_eos=True)
    got = generate(params, cfg, PROMPT, backend="pallas", **kw).tokens
    want = generate(ref_params, cfg_f, PROMPT, backend="reference", **kw).tokens
    assert got == want


def test_convert_quantises_a_float_checkpoint_like_the_release(float_dir, tmp_path):
    cfg = convert(float_dir, tmp_path / "ck", fp8=True, dtype=jnp.float32, progress=False)
    assert cfg.quantization == "fp8"
    restored_cfg, restored = load_params(tmp_path / "ck")
    assert restored_cfg.quantization == "fp8"
    _, direct = load_hf(float_dir, dtype=jnp.float32, fp8=True, progress=False)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(direct)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # Quantising the float checkpoint block by block is what the synthetic writer's FP8 layout holds.
    w = restored["layers"][2]["ffn"]["we_gate"]
    assert w.q.dtype == fp8.FP8_DTYPE and w.scale.shape == (TOY.num_experts, 1, 1)


def test_orbax_round_trip_of_fp8_params(fp8_dir, tmp_path):
    cfg, params = load_hf(fp8_dir, progress=False)
    save_params(tmp_path / "ck", cfg, params)
    cfg2, back = load_params(tmp_path / "ck")
    assert cfg2 == cfg
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def _catalog_with(fp8_dir, change):
    catalog, problems = read_catalog(fp8_dir)
    change(catalog)
    cfg = from_hf(fp8_dir)
    return lambda: validate(cfg, catalog, hf.plan(cfg), problems=problems)


WEIGHT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop(fp8_blocks.scale_name(WEIGHT)), "weight_scale_inv: absent, but .* is F8_E4M3"),
    (lambda c: c.__setitem__(fp8_blocks.scale_name(WEIGHT),
                             dataclasses.replace(c[fp8_blocks.scale_name(WEIGHT)], shape=(2, 1))),
     r"expected \[1, 1\] \(ceil\(out/128\), ceil\(in/128\)"),
    (lambda c: c.__setitem__(fp8_blocks.scale_name(WEIGHT),
                             dataclasses.replace(c[fp8_blocks.scale_name(WEIGHT)], dtype="BF16")),
     "stored BF16; block scales are F32"),
], ids=["missing", "mis-shaped", "wrong-dtype"])
def test_scale_problems_are_named(fp8_dir, change, message):
    with pytest.raises(CheckpointError, match=message):
        _catalog_with(fp8_dir, change)()


def test_a_float_tensor_for_an_fp8_leaf_is_quantised_with_a_warning(fp8_dir):
    def to_bf16(c):
        c[WEIGHT] = dataclasses.replace(c[WEIGHT], dtype="BF16")
        del c[fp8_blocks.scale_name(WEIGHT)]
    check = _catalog_with(fp8_dir, to_bf16)
    with pytest.warns(UserWarning, match=r"stored as floats though the leaves they feed are block-FP8(.|\n)*"
                                         r"down_proj.weight: BF16"):
        check()


def test_a_truncated_fp8_shard_is_named(fp8_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fp8_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"][WEIGHT]
    data = shard.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    end = 8 + header_len + header[WEIGHT]["data_offsets"][1]
    shard.write_bytes(data[:end - 1])
    with pytest.raises(CheckpointError):
        load_hf(broken, progress=False)


def test_memory_plan_refuses_the_bf16_full_model_on_one_h200():
    flash = preset("ling-3.0-flash")
    kw = dict(dtype=jnp.bfloat16, prompt_len=8192, max_new_tokens=1024, chunk=8192, capacity=int(141e9 * 0.95))
    assert memory.plan(flash.replace(quantization="fp8"), **kw).fits
    bf16 = memory.plan(flash, **kw)
    assert not bf16.fits
    with pytest.raises(memory.MemoryPlanError, match=r"does not fit.*--dtype fp8.*which fits.*tensor parallelism"):
        memory.check(bf16, flash, jnp.bfloat16)


def test_bench_cli_refuses_the_bf16_full_model_before_allocating():
    result = run_ling_jax("bench", "--preset", "ling-3.0-flash", "--random-weights", "--dtype", "bfloat16",
                          "--device-memory-gb", "141", timeout=120)
    assert_refused(result, "does not fit", "weights 237.6", "--dtype fp8", "param_shardings")


@pytest.mark.parametrize("args, fragments", [
    (("--preset", "toy"), ("--random-weights", "--checkpoint")),
    (("--preset", "toy", "--random-weights", "--layers", "2", "--spec", "mtp"), ("--spec mtp", "MTP layer")),
    (("--preset", "toy", "--random-weights", "--accept-length", "2"), ("--accept-length 2.0", "--spec oracle")),
    (("--preset", "toy", "--random-weights", "--output-len", "1"), ("--output-len 1", ">= 2")),
], ids=["random-weights-unsaid", "mtp-without-mtp-layer", "accept-length-without-oracle", "one-output-token"])
def test_bench_cli_refuses_bad_options(args, fragments):
    assert_refused(run_ling_jax("bench", *args, timeout=120), *fragments)


def test_bench_cli_runs_sglangs_metrics_on_the_toy_preset(tmp_path):
    out = tmp_path / "row.json"
    result = run_ling_jax("bench", "--preset", "toy", "--random-weights", "--dtype", "fp8", "--prompt-len", "12",
                          "--output-len", "9", "--block-size", "4", "--warmup", "0", "--repeats", "1",
                          "--backend", "reference", "--results", out, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row == {k: v for k, v in json.loads(out.read_text()).items() if k != "profile"}
    assert row["quantization"] == "fp8" and row["layers"] == TOY.num_layers and row["output_len"] == 9
    assert row["tpot_ms_median"] > 0 and row["ttft_ms"] > 0 and row["kernels_per_step"] > 0
    assert row["bytes_per_token"] == sum(row["bytes_by_part"].values())
    assert 0 < row["frac_of_floor"] < 1


def test_router_prefetch_names_an_fp8_weight():
    from pallas_kernels.moe import route

    x = jnp.ones((1, 128), jnp.float32) * jnp.arange(128) / 128
    router, bias = jnp.ones((8, 128)) / jnp.arange(1, 9)[:, None], jnp.zeros(8)
    w = fp8.quantize(jnp.ones((64, 128)) * jnp.arange(128), fp8.OUT_IN)
    with pytest.raises(ValueError, match=r"prefetch\[0\] is an Fp8Weight; pass its values \(w.q"):
        route(x, router, bias, n_group=2, topk_group=1, top_k=2, routed_scaling_factor=1.0, prefetch=(w,))


def test_tensor_parallel_fp8_needs_whole_scale_blocks_per_device():
    from ling_jax.sharding import check_divisible

    flash = preset("ling-3.0-flash", quantization="fp8")
    check_divisible(flash, 2)  # 384 expert rows per device: three whole blocks
    with pytest.raises(ValueError, match=r"whole 128-row scale blocks.*'moe_intermediate_size / tp': 192"):
        check_divisible(flash, 4)
