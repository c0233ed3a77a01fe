"""One table of malformed inputs (config fields, checkpoint files, CLI options, API arguments). Every row must stop
with one clear message that names what is wrong and how to fix it: never a traceback from deep inside, never a
hang (each row runs under an alarm), never a silent result (the call must raise)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conversion.load import INDEX_NAME, CheckpointError, load_hf
from conversion.orbax_io import load_params, save_params
from conversion.synthetic import write_synthetic
from ling_jax import model
from ling_jax.cache import commit
from ling_jax.cli import main
from ling_jax.config import ConfigError, LingConfig, from_hf, preset, to_hf_dict
from ling_jax.engine.generate import generate
from ling_jax.engine.sampling import Greedy, make_sampler
from ling_jax.params import init_params

SECONDS_PER_ROW = 60


@pytest.fixture(scope="module")
def toy():
    cfg = preset("toy")
    return cfg, init_params(cfg, jax.random.key(0), jnp.float32, with_mtp=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("hf"), preset("toy"), seed=5, max_shard_bytes=256 * 1024,
                           progress=False)


def _copy(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of checkpoint `src`, its config.json updated with `config` and every shard's tensors passed to
    `tensors(name -> array dict)`."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v != "<drop>"}))
    if tensors is not None:
        index = json.loads((dst / INDEX_NAME).read_text())
        for file in sorted(set(index["weight_map"].values())):
            shard = load_file(dst / file)
            tensors(shard)
            save_file(shard, dst / file, metadata={"format": "pt"})
        index["weight_map"] = {n: f for f in sorted(set(index["weight_map"].values())) for n in load_file(dst / f)}
        (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def _config(**changes):
    raw = {**to_hf_dict(preset("toy")), **changes}
    return lambda ctx: from_hf({k: v for k, v in raw.items() if v != "<drop>"})


def _load(**copy_kw):
    return lambda ctx: load_hf(_copy(ctx["checkpoint"], ctx["tmp"] / "ck", **copy_kw), progress=False)


def _cli(*args):
    def run(ctx):
        with pytest.raises(SystemExit) as exit_:
            main([str(a).replace("{ck}", str(ctx["checkpoint"])).replace("{tmp}", str(ctx["tmp"])) for a in args])
        assert exit_.value.code == 2
        raise _CliRefusal(ctx["capsys"].readouterr().err)
    return run


class _CliRefusal(Exception):
    """What the CLI printed when it refused (argparse exits; the table compares its message like an exception's)."""

    def __str__(self):
        lines = self.args[0].splitlines()
        return next(line.split(": error: ", 1)[1] for line in lines if ": error: " in line)


def _truncate(fraction):
    def cut(ctx):
        ck = _copy(ctx["checkpoint"], ctx["tmp"] / "ck")
        shard = sorted(ck.glob("*.safetensors"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[:int(len(data) * fraction)])
        return load_hf(ck, progress=False)
    return cut


def _api(fn):
    return lambda ctx: fn(*ctx["toy"])


def _prefilled(cfg, params, n=5):
    return model.prefill(params, jnp.asarray([[3, 1, 4, 1, 5][:n]]), cfg, max_len=32)[1]


def _rewrite(name, fn):
    return lambda shard: shard.update({name: fn(shard[name])}) if name in shard else None


Q = "model.layers.0.attention.q_proj.weight"
B_PROJ = "model.layers.0.attention.b_proj.weight"
EMBED = "model.word_embeddings.weight"

# (id, action, exception, fragments that must appear: the thing named and the fix)
ROWS = [
    # config.json fields
    ("config-hidden_act", _config(hidden_act="gelu"), ConfigError, ["hidden_act", "silu"]),
    ("config-score_function", _config(score_function="softmax"), ConfigError, ["score_function", "sigmoid"]),
    ("config-topk_method", _config(topk_method="greedy"), ConfigError, ["topk_method", "noaux_tc"]),
    ("config-attention_bias", _config(attention_bias=True), ConfigError, ["attention_bias"]),
    ("config-no_kda_lora", _config(no_kda_lora=False), ConfigError, ["no_kda_lora"]),
    ("config-rope_scaling", _config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ConfigError,
     ["yarn", "rope_scaling"]),
    ("config-string-int", _config(num_attention_heads="4"), ConfigError, ["num_attention_heads"]),
    ("config-bool-int", _config(num_experts=True), ConfigError, ["num_experts"]),
    ("config-list-float", _config(rms_norm_eps=[1e-6]), ConfigError, ["rms_norm_eps"]),
    ("config-missing-field", _config(hidden_size="<drop>"), ConfigError,
     ["config.json lacks 'hidden_size': every", "Ling-3"]),
    ("config-missing-aliased-field", _config(linear_head_dim="<drop>", head_dim="<drop>"), ConfigError,
     ["config.json lacks 'linear_head_dim' (also looked for 'head_dim'): every"]),
    ("config-zero-heads", _config(num_attention_heads=0), ConfigError, ["num_attention_heads", "positive"]),
    ("config-gate-bound", _config(kda_lower_bound=-7.0), ConfigError, ["kda_lower_bound", "[-5, 0)"]),
    ("config-groups", _config(n_group=5), ConfigError, ["n_group"]),
    ("config-topk-too-many", _config(num_experts_per_tok=40), ConfigError, ["num_experts_per_tok"]),
    ("config-limit-list-length", _config(expert_swiglu_limit_list=[4.0, 4.0]), ConfigError,
     ["expert_swiglu_limit_list", "2 entries"]),
    ("config-layer_types-length", _config(layer_types=["linear_attention"] * 5), ConfigError, ["layer_types"]),
    ("config-layer_types-value", _config(layer_types=["linear_attention"] * 5 + ["sliding"]), ConfigError,
     ["layer_types", "sliding", "full_attention"]),
    ("config-mlp_layer_types-value", _config(mlp_layer_types=["dense"] * 5 + ["moe"]), ConfigError,
     ["mlp_layer_types", "sparse"]),
    ("config-eos-outside-vocab", _config(eos_token_id=100000), ConfigError, ["100000", "vocab_size"]),
    ("config-kv-heads", _config(num_key_value_heads=2), ConfigError, ["num_key_value_heads"]),
    ("config-rotary_dim", _config(rotary_dim=32), ConfigError, ["rotary_dim", "qk_rope_head_dim"]),
    ("config-tied", _config(tie_word_embeddings=True), ConfigError, ["tie_word_embeddings"]),
    ("config-mtp-layers", _config(num_nextn_predict_layers=2), ConfigError, ["num_nextn_predict_layers"]),
    # checkpoint files
    ("ckpt-truncated-header", _truncate(0.0001), CheckpointError, ["re-download"]),
    ("ckpt-truncated-data", _truncate(0.5), CheckpointError, ["re-download"]),
    ("ckpt-int-tensor", _load(tensors=_rewrite(Q, lambda x: x.astype(np.int32))), CheckpointError,
     [Q, "I32"]),
    ("ckpt-transposed", _load(tensors=_rewrite(B_PROJ, lambda x: np.ascontiguousarray(x.T))), CheckpointError,
     [B_PROJ, "wrong shape", "expected [4, 128]"]),
    ("ckpt-vocab-rows", _load(tensors=_rewrite(EMBED, lambda x: x[:-3])), CheckpointError,
     ["vocab mismatch", EMBED]),
    ("ckpt-schedule-conflict", _load(config=dict(layer_types=["full_attention"] + ["linear_attention"] * 5)),
     CheckpointError, ["layer_types", "layer 0"]),
    ("ckpt-index-garbage", lambda ctx: load_hf(_write(_copy(ctx["checkpoint"], ctx["tmp"] / "ck"), INDEX_NAME,
                                                      "{not json"), progress=False),
     CheckpointError, [INDEX_NAME]),
    ("ckpt-config-garbage", lambda ctx: load_hf(_write(_copy(ctx["checkpoint"], ctx["tmp"] / "ck"), "config.json",
                                                       '{"model_type": "bailing_hybrid",'), progress=False),
     ConfigError, ["config.json", "line 1"]),
    ("ckpt-no-weights", lambda ctx: load_hf(_only_config(ctx), progress=False), CheckpointError,
     ["model.safetensors"]),
    ("orbax-on-hf-dir", lambda ctx: load_params(ctx["checkpoint"]), CheckpointError, ["load_hf"]),
    ("orbax-overwrite", lambda ctx: _save_twice(ctx), FileExistsError, ["force=True"]),
    # CLI options
    ("cli-top-p", _cli("generate", "--top-p", "1.5"), _CliRefusal, ["--top-p"]),
    ("cli-temperature", _cli("generate", "--temperature", "-0.5"), _CliRefusal, ["--temperature"]),
    ("cli-block-size", _cli("generate", "--block-size", "0"), _CliRefusal, ["--block-size"]),
    ("cli-prompt-ids", _cli("generate", "--prompt-ids", "1,two,3"), _CliRefusal, ["--prompt-ids", "1,2,3"]),
    ("cli-prompt-no-tokenizer", _cli("generate", "--prompt", "hello"), _CliRefusal, ["--tokenizer"]),
    ("cli-backend", _cli("generate", "--backend", "triton"), _CliRefusal, ["triton", "reference"]),
    ("cli-hf-dir-missing", _cli("generate", "--hf-dir", "{tmp}/nowhere"), _CliRefusal, ["--hf-dir", "nowhere"]),
    ("cli-checkpoint-hf", _cli("generate", "--checkpoint", "{ck}"), _CliRefusal, ["--hf-dir"]),
    ("cli-too-long", _cli("generate", "--max-new-tokens", "5000"), _CliRefusal, ["max_position_embeddings"]),
    ("cli-convert-into-source", _cli("convert", "--hf-dir", "{ck}", "--out", "{ck}"), _CliRefusal, ["--out"]),
    # API arguments
    ("api-prefill-empty", _api(lambda c, p: model.prefill(p, jnp.zeros((1, 0), jnp.int32), c, max_len=8)),
     ValueError, ["T >= 1"]),
    ("api-prefill-vocab", _api(lambda c, p: model.prefill(p, np.asarray([[1, 600]]), c, max_len=8)), ValueError,
     ["vocabulary is [0, 512)", "tokenizer"]),
    ("api-prefill-max_len", _api(lambda c, p: model.prefill(p, np.asarray([[1, 2, 3]]), c, max_len=2)),
     ValueError, ["max_len=2"]),
    ("api-decode-shape", _api(lambda c, p: model.decode(p, _prefilled(c, p), jnp.asarray([[7]]), c)), ValueError,
     ["[batch]"]),
    ("api-commit-count", _api(lambda c, p: commit(model.verify(p, _prefilled(c, p), jnp.asarray([[7, 8]]), c)[1],
                                                  jnp.asarray([1, 2]))), ValueError, ["one count"]),
    ("api-generate-ragged", _api(lambda c, p: generate(p, c, [[1, 2], [3]], max_new_tokens=2, sampler=Greedy())),
     ValueError, ["differ in length"]),
    ("api-generate-zero-new", _api(lambda c, p: generate(p, c, [[1, 2]], max_new_tokens=0, sampler=Greedy())),
     ValueError, ["max_new_tokens=0"]),
    ("api-pallas-sizes", _api(lambda c, p: model.prefill(p, np.asarray([[1, 2]]), c.replace(head_dim=24),
                                                        max_len=8, backend="pallas")), ConfigError,
     ["head_dim=24", "kda=reference"]),
    ("api-sampler", lambda ctx: make_sampler(0.7, 0.0), ValueError, ["top_p"]),
    ("api-preset", lambda ctx: preset("ling-4"), ConfigError, ["ling-4", "toy"]),
    ("api-config-type", lambda ctx: LingConfig(**{**_fields(preset("toy")), "expert_swiglu_limits": [4.0]}),
     ConfigError, ["expert_swiglu_limits", "tuple"]),
    ("api-router-dtype", lambda ctx: load_hf(ctx["checkpoint"], router_weight_dtype="bfloat16", progress=False),
     ValueError, ["router_weight_dtype"]),
    ("api-mtp-missing", _api(lambda c, p: model.mtp_forward(p, None, None, None, None, c, mode="decode")),
     ValueError, ["'mtp'", "with_mtp"]),
]


def _write(ck: Path, name: str, text: str) -> Path:
    (ck / name).write_text(text)
    return ck


def _only_config(ctx) -> Path:
    ck = ctx["tmp"] / "bare"
    ck.mkdir()
    shutil.copy(ctx["checkpoint"] / "config.json", ck / "config.json")
    return ck


def _save_twice(ctx):
    cfg, params = ctx["toy"]
    cfg = cfg.replace(num_mtp_layers=0)  # the fixture's params have no MTP layer
    save_params(ctx["tmp"] / "orbax", cfg, params)
    save_params(ctx["tmp"] / "orbax", cfg, params)


def _fields(cfg: LingConfig) -> dict:
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_the_table_is_broad():
    kinds = {row[0].split("-")[0] for row in ROWS}
    assert len(ROWS) >= 30 and kinds == {"config", "ckpt", "orbax", "cli", "api"}


def _alarm(signum, frame):
    raise TimeoutError(f"no answer within {SECONDS_PER_ROW} s")


@pytest.mark.parametrize("name, action, error, fragments", ROWS, ids=[row[0] for row in ROWS])
def test_malformed_input_stops_with_one_clear_message(name, action, error, fragments, toy, checkpoint, tmp_path,
                                                      capsys):
    ctx = dict(toy=toy, checkpoint=checkpoint, tmp=tmp_path, capsys=capsys)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_ROW)
    try:
        with pytest.raises(error) as raised:
            action(ctx)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message:\n{message}"
    if error is not CheckpointError:  # a checkpoint's problems come as one headed list; everything else is a line
        assert len(message.splitlines()) == 1, f"not one line:\n{message}"


def test_missing_shard_is_named_as_a_missing_file(checkpoint, tmp_path, capsys):
    """A shard the index names but the directory lacks is a copy problem: named with the fix, not listed as a
    mismatch between the checkpoint and its config.json."""
    ck = _copy(checkpoint, tmp_path / "ck")
    gone = sorted(ck.glob("*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(CheckpointError) as raised:
        load_hf(ck, progress=False)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--hf-dir", str(ck)])
    err = capsys.readouterr().err
    for message in (str(raised.value), err):
        assert f"1 shard file(s) named in {INDEX_NAME} are missing from {ck}" in message
        assert gone.name in message and "re-download or re-copy them" in message
        assert "config.json" not in message and "missing (" not in message
    assert exit_.value.code == 2 and "Traceback" not in err


@pytest.mark.parametrize("part, fragments", [
    ("state/d", ["its file params/state/d/", "is truncated or damaged"]),
    ("state/ocdbt.process_*/d", ["orbax cannot restore the stored array", "data files are truncated or damaged"]),
], ids=["index-file", "data-file"])
def test_truncated_orbax_file_is_one_message(part, fragments, toy, tmp_path):
    """A truncated file of an orbax checkpoint (its OCDBT index under params/state/d/, or the data beside it): one
    message naming it and the fix, and none of the reads orbax abandons reports after it."""
    from tests.cli_run import assert_refused, run_ling_jax

    cfg, params = toy
    ck = save_params(tmp_path / "orbax", cfg.replace(num_mtp_layers=0), params)
    victim = sorted((ck / "params").glob(f"{part}/*"))[0]
    victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
    result = run_ling_jax("generate", "--checkpoint", ck, "--max-new-tokens", "2", "--warmup", "0")
    assert_refused(result, f"{ck / 'params'}: ", *fragments, "copy the checkpoint again", "ling-jax convert")
    assert "Event loop is closed" not in result.stderr and "never retrieved" not in result.stderr, result.stderr
