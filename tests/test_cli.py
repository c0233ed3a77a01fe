"""The `ling-jax` command line: the embedded default, convert -> generate, and one clear error per bad input."""

import json
import subprocess
import sys

import pytest

from ling_jax.cli import main
from ling_jax.config import preset, to_hf_dict


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_embedded_default_is_toy_demo(capsys):
    code, out, err = run_cli(["generate", "--max-new-tokens", "8", "--warmup", "0"], capsys)
    assert code == 0
    assert len(out.split()) <= 8 and "TPOT" in err and "backend reference" in err


def test_json_output_and_seeded_sampling(capsys):
    args = ["generate", "--preset", "toy", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", "3", "--json", "--warmup", "0", "--ignore-eos"]
    first = json.loads(run_cli(args, capsys)[1])
    second = json.loads(run_cli(args, capsys)[1])
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 6
    assert first["tpot_ms"] > 0 and first["tokens_per_s"] > 0


def test_convert_then_generate_from_checkpoint(tmp_path, capsys):
    from conversion.synthetic import write_synthetic

    cfg = preset("toy")
    write_synthetic(tmp_path / "hf", cfg, seed=1, dtype="float32", progress=False)
    assert main(["convert", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), "--dtype",
                 "float32"]) == 0
    capsys.readouterr()
    common = ["--max-new-tokens", "5", "--json", "--warmup", "0", "--ignore-eos", "--prompt-ids", "4,8,15,16,23"]
    from_ckpt = json.loads(run_cli(["generate", "--checkpoint", str(tmp_path / "ck"), *common], capsys)[1])
    from_hf = json.loads(run_cli(["generate", "--hf-dir", str(tmp_path / "hf"), "--dtype", "float32", *common],
                                 capsys)[1])
    assert from_ckpt["tokens"] == from_hf["tokens"]


def test_convert_keeps_a_bf16_router_unless_asked(tmp_path, capsys):
    from conversion.orbax_io import load_params
    from conversion.synthetic import write_synthetic

    write_synthetic(tmp_path / "hf", preset("toy", router_weight_dtype="bfloat16"), seed=1, progress=False)
    for flags, want in (([], "bfloat16"), (["--router-fp32"], "float32")):
        out = tmp_path / f"ck{len(flags)}"
        assert main(["convert", "--hf-dir", str(tmp_path / "hf"), "--out", str(out), *flags]) == 0
        cfg, params = load_params(out)
        assert cfg.router_weight_dtype == want and params["layers"][-1]["ffn"]["router"].dtype == want
    capsys.readouterr()


@pytest.mark.parametrize("args, message", [
    (["generate", "--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["generate", "--top-p", "1.5", "--temperature", "1"], "top_p=1.5 must lie in"),
    (["generate", "--top-p", "0.5"], "no effect with temperature 0"),
    (["generate", "--prompt", "hello"], "--prompt needs --tokenizer"),
    (["generate", "--prompt-ids", "1,x,3"], "must be comma-separated integers"),
    (["generate", "--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["generate", "--preset", "llama"], "unknown preset 'llama'"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["generate", "--dtype", "float16"], "invalid choice: 'float16'"),
    (["generate", "--preset", "toy", "--hf-dir", "x"], "not allowed with argument"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_options_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_checkpoints_are_named(tmp_path, capsys):
    bad = to_hf_dict(preset("toy"))
    bad["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit):
        main(["generate", "--hf-dir", str(tmp_path)])
    assert "unknown model_type 'llama'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--hf-dir", str(tmp_path / "nowhere")])
    assert "no config.json" in capsys.readouterr().err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "ling_jax.cli", "generate", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--max-new-tokens" in out and "--prompt-ids" in out


def test_text_prompt_with_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(preset("toy").vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    args = ["generate", "--preset", "toy", "--prompt", "w5 w9 w11", "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--max-new-tokens", "4", "--warmup", "0", "--ignore-eos"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0 and all(w.startswith("w") for w in out.split()) and len(out.split()) == 4
    by_ids = json.loads(run_cli(["generate", "--preset", "toy", "--prompt-ids", "5,9,11", "--max-new-tokens", "4",
                                 "--warmup", "0", "--ignore-eos", "--json"], capsys)[1])
    assert out.split() == [f"w{t}" for t in by_ids["tokens"]]
