"""Block-FP8 weights end to end: quantisation bounds, the -fp8 checkpoint layout (load, validate, convert, orbax),
the ROWS projections against the IN_OUT leaves they replaced (bit for bit, and an older orbax checkpoint refused),
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
from ling_jax.backends import check_config, resolve, w8a8_limits, with_fp8_activations
from ling_jax.config import ConfigError, from_hf, preset, to_hf_dict
from ling_jax.engine.generate import generate
from ling_jax.engine.sampling import Greedy
from ling_jax.params import count_params, is_fp8, param_bytes, param_specs
from pallas_kernels.common import fp8
from pallas_kernels.gemv import w8a8
from tests.cli_run import assert_refused, run_ling_jax
from tests.numerics import input_seed, rel_err

TOY = preset("toy")
TOY_FP8 = TOY.replace(quantization="fp8")
PROMPT = np.array([[7, 41, 3, 99, 12, 250, 18, 5]], np.int32)


def _dequantized(params):
    """Every FP8 leaf as the float array the unquantised params hold there: [*in, *out] for a ROWS projection."""
    def dense(w):
        return fp8.dequantize(w, jnp.float32) if w.layout == fp8.OUT_IN else fp8.as_in_out(w, jnp.float32)
    return jax.tree.map(lambda w: dense(w) if isinstance(w, fp8.Fp8Weight) else w, params,
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
    w_o = layer["mixer"]["w_o"]  # ROWS: [D, H, K], its scale one per output row and 128 of the H·K inputs
    assert is_fp8(w_o) and w_o.layout == fp8.ROWS and w_o.n_in == 2
    assert (w_o.q.shape, w_o.q.axes) == ((TOY.hidden_size, TOY.num_heads, TOY.head_dim), ("embed", "heads", None))
    assert (w_o.scale.shape, w_o.scale.axes) == ((TOY.hidden_size, 1), ("embed", "heads"))
    assert w_o.q.fan_in == w_o.scale.fan_in == TOY.num_heads * TOY.head_dim
    w_in = specs["layers"][0]["mixer"]["w_in"]
    assert (w_in.layout, w_in.q.axes, w_in.scale.axes) == (fp8.ROWS, ("heads", None, "embed"), ("heads", None, "embed"))
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


def test_kda_norm_scale_runs_in_o_proj_prologue(monkeypatch):
    """At Flash's head_dim of 128 a KDA layer's decode leaves each head's RMS scale to o_proj's rows-GEMV prologue
    (a GroupRMS, no XLA fusion between the two kernels), and the router norms the MoE input in its GEMV prologue.
    The Pallas decode step's logits match the reference backend's from the same state within 1e-4 (float32: the
    kernels sum in other orders, measured 7.8e-7)."""
    from ling_jax.params import init_params
    from pallas_kernels.gemv import rows

    cfg = TOY_FP8.replace(head_dim=128, num_heads=2)
    params = init_params(cfg, jax.random.key(input_seed(5)), jnp.float32, with_mtp=False)
    taken = []
    monkeypatch.setattr(rows, "takes_group_rms", lambda x, f=rows.takes_group_rms: taken.append(f(x)) or taken[-1])
    logits = {}
    for backend in ("reference", "pallas"):
        _, state, _ = model.prefill(params, jnp.asarray(PROMPT), cfg, max_len=32)
        logits[backend] = model.decode(params, state, jnp.asarray([17], jnp.int32), cfg, backend=backend)[0]
    assert taken and all(taken)  # every KDA layer's o_proj took it in the prologue
    assert rel_err(logits["pallas"], logits["reference"]) <= 1e-4


def test_fp8_activations_run_the_w8a8_kernel_as_its_reference(fp8_dir, monkeypatch):
    """`--fp8-activations` (gemv=w8a8): the decode step's FP8 projections (mixers, dense MLP; not the experts) go
    through the W8A8 kernel, whose logits equal the model run with `w8a8.reference` in its place (float32: fp32
    summation order only, 1e-5). The distance from the weight-only path and the greedy agreement over 16 steps are
    printed, not bounded: E4M3 activations move each projection ~2.5e-2 (tests/ops/test_gemv_w8a8.py), and on
    random weights that flips routes and near-ties (measured on this toy model: logits 0.36 apart, 1 of 16 tokens
    equal)."""
    cfg, params = load_hf(fp8_dir, dtype=jnp.float32, progress=False)
    w8a8_backend = with_fp8_activations("pallas")
    state = model.prefill(params, PROMPT, cfg, max_len=32, backend="pallas")[1]
    token = jnp.asarray(PROMPT[:, -1])
    got = model.decode_forward(params, state, token, cfg, backend=w8a8_backend)[0]
    weight_only = model.decode_forward(params, state, token, cfg, backend="pallas")[0]
    monkeypatch.setattr(w8a8, "gemv", w8a8.reference)
    assert rel_err(got, model.decode_forward(params, state, token, cfg, backend=w8a8_backend)[0]) <= 1e-5
    monkeypatch.undo()
    assert rel_err(got, weight_only) > 1e-3  # the activations really were quantised
    kw = dict(max_new_tokens=16, sampler=Greedy(), block_size=8, ignore_eos=True)
    tokens = generate(params, cfg, PROMPT, backend=w8a8_backend, **kw).tokens
    agree = np.mean(np.array(tokens) == np.array(generate(params, cfg, PROMPT, backend="pallas", **kw).tokens))
    print(f"W8A8 against the weight-only path: decode logits {rel_err(got, weight_only):.2e} apart, greedy "
          f"agreement {agree:.0%} of 16 tokens")


def test_fp8_activations_are_refused_where_they_cannot_run():
    assert resolve("gemv=w8a8")["gemv"] == "w8a8"
    assert resolve(with_fp8_activations("fast")) == {**resolve("fast"), "gemv": "w8a8"}
    with pytest.raises(ValueError, match="gemv also 'w8a8'"):
        resolve("kda=w8a8")
    with pytest.raises(ValueError, match="--fp8-activations runs the W8A8 GEMV kernel.*--backend fast or pallas"):
        with_fp8_activations("reference")
    assert_refused(run_ling_jax("generate", "--preset", "toy", "--fp8-activations", "--backend", "pallas",
                                timeout=120), "--fp8-activations", "not FP8", "--dtype fp8")
    assert_refused(run_ling_jax("bench", "--preset", "toy", "--random-weights", "--dtype", "fp8",
                                "--fp8-activations", "--backend", "reference", timeout=120),
                   "--fp8-activations", "gemv=reference", "--backend fast or pallas")
    with pytest.raises(ConfigError, match="gemv=w8a8 quantises the activations of block-FP8 projections"):
        check_config(TOY, "gemv=w8a8")
    with pytest.raises(ConfigError, match="intermediate_size = 200 .not a multiple of 128.: use gemv=pallas"):
        check_config(TOY_FP8.replace(intermediate_size=200), "gemv=w8a8")
    check_config(TOY_FP8, "gemv=w8a8")
    assert w8a8_limits(TOY) == [] and w8a8_limits(preset("ling-3.0-flash")) == []
    assert w8a8_limits(TOY.replace(intermediate_size=200)) == ["intermediate_size = 200 (not a multiple of 128)"]


def _official(hf_dir, quantise: bool):
    """name -> (q [out, in] float32 of E4M3 values, scale_inv [ceil(out/128), ceil(in/128)]) of a checkpoint's
    projections: as stored (F8_E4M3), or its float tensors quantised as the release does (`quantise`)."""
    catalog, _ = read_catalog(hf_dir)

    def read(name):
        info = catalog[name]
        dtype = fp8_blocks.FP8_NP if info.dtype == "F8_E4M3" else np.dtype(np.float32)
        return fp8_blocks.read_raw(Path(hf_dir) / info.file, name, info.shape, dtype)

    def one(name):
        q, s = fp8_blocks.quantize(read(name)) if quantise else (read(name), read(fp8_blocks.scale_name(name)))
        return q.astype(np.float32), s
    return one


def _in_out_leaves(cfg, official) -> dict[str, fp8.Fp8Weight]:
    """Every block-FP8 projection of `cfg` in the layout ling-jax stored before ROWS (IN_OUT: q [*in, *out], the
    checkpoint's block scale repeated over its 128 output rows then transposed, [ceil(In/128), *out]), written out
    by hand from the official tensors (docs/model.md §4), independently of conversion/hf.py."""
    D, H, K, R = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_lora_rank
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim

    def io(name, in_shape, out_shape):  # [out, in] -> [*in, *out], its scale [ceil(In/128), *out]
        q, s = official(name)
        rows = np.repeat(s, fp8.BLOCK, axis=0)[:q.shape[0]]
        return q.T.reshape(*in_shape, *out_shape), rows.T.reshape(s.shape[1], *out_shape)

    def packed(names, widths):  # per head h the parts' columns side by side
        parts = [io(n, (D,), (H, w)) for n, w in zip(names, widths)]
        return tuple(np.concatenate([p[j] for p in parts], axis=-1) for j in range(2))

    def kv_b(name, which):  # rows head-major, [k_nope | v] per head -> [R, H, Dn] or [R, H, Dv]
        q, s = official(name)
        cut = slice(0, Dn) if which == "k" else slice(Dn, Dn + Dv)
        rows = np.repeat(s, fp8.BLOCK, axis=0)[:q.shape[0]]
        return tuple(a.reshape(H, Dn + Dv, -1)[:, cut].transpose(2, 0, 1) for a in (q, rows))

    out = {}
    for layer in range(cfg.num_layers + cfg.num_mtp_layers):
        src, dst = f"model.layers.{layer}.", "mtp.layer." if layer == cfg.num_layers else f"layers.{layer}."
        a = src + "attention."
        mtp = layer == cfg.num_layers
        if not mtp and cfg.mixer_kind(layer) == "kda":
            out[dst + "mixer.w_in"] = packed([a + f"{p}_proj.weight" for p in "qkvfgb"], [K] * 5 + [1]), 1
            out[dst + "mixer.w_o"] = io(a + "o_proj.weight", (H, K), (D,)), 2
        else:
            out[dst + "mixer.w_qg"] = packed([a + "q_proj.weight", a + "g_proj.weight"], [cfg.qk_head_dim, 1]), 1
            out[dst + "mixer.w_kv_a"] = io(a + "kv_a_proj_with_mqa.weight", (D,), (R + cfg.qk_rope_head_dim,)), 1
            out[dst + "mixer.w_k_b"] = kv_b(a + "kv_b_proj.weight", "k"), 1
            out[dst + "mixer.w_v_b"] = kv_b(a + "kv_b_proj.weight", "v"), 1
            out[dst + "mixer.w_o"] = io(a + "dense.weight", (H, Dv), (D,)), 2
        if not mtp and cfg.ffn_kind(layer) == "dense":
            I = cfg.intermediate_size
            for p, shapes in (("gate", ((D,), (I,))), ("up", ((D,), (I,))), ("down", ((I,), (D,)))):
                out[dst + f"ffn.w_{p}"] = io(src + f"mlp.{p}_proj.weight", *shapes), 1
    return {path: fp8.Fp8Weight(jnp.asarray(q.astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(s, jnp.float32),
                                fp8.IN_OUT, n_in) for path, ((q, s), n_in) in out.items()}


@pytest.mark.parametrize("stored", ["fp8", "float"], ids=["fp8-as-stored", "quantised-at-load"])
def test_every_rows_projection_is_the_older_in_out_leaf_converted(fp8_dir, float_dir, stored):
    """Each block-FP8 projection ling-jax loads (ROWS) is, bit for bit, `fp8.convert_layout` of the IN_OUT leaf the
    same checkpoint gave before the layout changed: the FP8 release's tensors as stored, and a float checkpoint
    quantised at load (the same E4M3 values and block scales; only the order differs)."""
    hf_dir = fp8_dir if stored == "fp8" else float_dir
    cfg, params = load_hf(hf_dir, dtype=jnp.float32, fp8=True, progress=False)
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)
    rows = {hf.path_str(tuple(hf._key(k) for k in kp)): w for kp, w in flat
            if is_fp8(w) and w.layout == fp8.ROWS}
    old = _in_out_leaves(cfg, _official(hf_dir, quantise=stored == "float"))
    assert sorted(rows) == sorted(old)  # every projection, the MTP layer's included
    for path, w in rows.items():
        want = fp8.convert_layout(old[path], fp8.ROWS)
        assert (w.n_in, w.q.shape, w.scale.shape) == (want.n_in, want.q.shape, want.scale.shape), path
        assert np.array_equal(np.asarray(w.q).view(np.uint8), np.asarray(want.q).view(np.uint8)), path
        assert np.array_equal(np.asarray(w.scale), np.asarray(want.scale)), path


def test_synthetic_fp8_checkpoint_is_its_rows_leaves_in_the_official_layout(fp8_dir):
    """The synthetic writer draws each FP8 projection as its ROWS leaf and writes it [out, in]: the loaded leaves
    mapped back by each entry's inverse transforms give the stored E4M3 bytes and block scales exactly, and the
    dequantised projections keep fan-in scaling (w_o reads H·K inputs, w_down I)."""
    cfg, params = load_hf(fp8_dir, dtype=jnp.float32, progress=False)
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)
    got = {tuple(hf._key(k) for k in kp): w for kp, w in flat}
    official = _official(fp8_dir, quantise=False)
    entries = [e for e in hf.plan(cfg) if e.fp8 and e.fp8[0] == fp8.ROWS]
    assert {p for e in entries for p in e.paths} == {p for p, w in got.items() if is_fp8(w) and w.layout == fp8.ROWS}
    for entry in entries:
        ws = [got[p] for p in entry.paths]
        for i, name in enumerate(entry.names):
            q, s = official(name)
            assert np.array_equal(entry.hf_tensor([np.asarray(w.q, np.float32) for w in ws], i), q), name
            # The scale [*out, ceil(In/128)]: the block scale on each of its 128 rows (w_o's two input axes are one
            # block axis in it, so it is [D, ceil(H·K/128)] already).
            per_row = (entry.hf_tensor([np.asarray(w.scale) for w in ws], i) if entry.fp8[1] == 1
                       else np.asarray(ws[0].scale))
            assert np.array_equal(per_row, np.repeat(s, fp8.BLOCK, axis=0)[:q.shape[0]]), name
    for path, fan_in in ((("layers", 0, "mixer", "w_o"), TOY.num_heads * TOY.head_dim),
                         (("layers", 0, "ffn", "w_down"), TOY.intermediate_size)):
        std = float(jnp.std(fp8.dequantize(got[path])))
        assert abs(std * np.sqrt(fan_in) - 1.0) < 0.1, (path, std)


def test_an_orbax_checkpoint_of_in_out_projections_is_refused_with_the_fix(fp8_dir, tmp_path, monkeypatch):
    """An orbax checkpoint written while the FP8 projections were IN_OUT ([in, out]) does not load: one message
    names a leaf, both layouts and the fix."""
    from conversion import orbax_io

    cfg, params = load_hf(fp8_dir, progress=False)
    old = jax.tree.map(lambda w: fp8.convert_layout(w, fp8.IN_OUT) if is_fp8(w) and w.layout == fp8.ROWS else w,
                       params, is_leaf=is_fp8)
    with monkeypatch.context() as m:  # today's save_params refuses the old layout: write it as an old one did
        m.setattr(orbax_io, "_check_structure", lambda *a: None)
        save_params(tmp_path / "ck", cfg, old)
    D, I = TOY.hidden_size, TOY.intermediate_size  # the first projection in params order: the dense down
    with pytest.raises(CheckpointError, match=(
            r"wrong shape(.|\n)*block-FP8 projections of an older ling-jax, stored \[in, out\](.|\n)*"
            rf"layers\.0\.ffn\.w_down\.q \[{I}, {D}\] where \[out, in\] is \[{D}, {I}\](.|\n)*"
            r"run `ling-jax convert` on the HF checkpoint again")) as info:
        load_params(tmp_path / "ck")
    assert "MoE router [D, E]" not in str(info.value)  # the generic older-layout hint would mislead


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
