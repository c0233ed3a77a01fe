"""The `ling-jax` command line: the embedded default, convert -> generate, and one clear error per bad input.

Bad inputs run the real entry point in a subprocess (`tests/cli_run.py`), so the test sees what a shell sees: the
exit code, one usage line at most, no traceback, and a message naming the option and the fix.
"""

import json
import re

import pytest

from conversion.load import CheckpointError
from ling_jax.cli import main
from ling_jax.config import preset, to_hf_dict
from tests.cli_run import assert_refused, run_ling_jax

TOY_VOCAB = preset("toy").vocab_size


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every file or directory the bad-input table points at, built once: a toy HF checkpoint, a ling-jax one, a
    tokenizer over the toy vocabulary, and the near misses."""
    from conversion.synthetic import write_synthetic
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("cli")
    cfg = preset("toy")
    write_synthetic(root / "hf", cfg, seed=1, dtype="float32", progress=False)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TOY_VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    (root / "not-a-tokenizer.json").write_text("this is not json\n")
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    (root / "empty").mkdir()
    for name in ("params-unreadable", "params-no-config", "out-taken"):
        (root / name / "params").mkdir(parents=True)
        (root / name / "params" / "junk").write_text("not an orbax checkpoint\n")
    for name in ("params-unreadable", "out-taken"):
        (root / name / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    (root / "odd-sizes").mkdir()
    (root / "odd-sizes" / "config.json").write_text(json.dumps(to_hf_dict(cfg.replace(head_dim=24))))
    (root / "odd-sizes" / "model.safetensors").write_bytes(b"")  # refused before the weights are opened
    (root / "bad-json").mkdir()
    (root / "bad-json" / "config.json").write_text("{ not json")
    llama = to_hf_dict(cfg) | {"model_type": "llama"}
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps(llama))
    _near_copy(root / "hf", root / "gelu", config={"hidden_act": "gelu"})
    _near_copy(root / "hf", root / "kda-first-says-mla", config={"layer_types": ["full_attention"] * 6})
    (root / "no-mtp").mkdir()
    (root / "no-mtp" / "config.json").write_text(json.dumps(to_hf_dict(cfg.replace(num_mtp_layers=0))))
    (root / "no-mtp" / "model.safetensors").write_bytes(b"")
    (root / "wide-vocab").mkdir()
    (root / "wide-vocab" / "config.json").write_text(json.dumps(to_hf_dict(cfg.replace(vocab_size=1024))))
    (root / "wide-vocab" / "model.safetensors").write_bytes(b"")  # refused before the weights are opened
    shard = sorted(_near_copy(root / "hf", root / "truncated").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return root


def _near_copy(src, dst, config=None):
    import shutil

    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(raw | config))
    return dst


def _expand(items, files):
    return [str(x).replace("{files}", str(files)) for x in items]


def test_embedded_default_is_toy_demo_and_says_random_weights():
    result = run_ling_jax("generate", "--max-new-tokens", "8", "--warmup", "0")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) <= 8 and "TPOT" in result.stderr and "backend reference" in result.stderr
    notice = [line for line in result.stderr.splitlines() if "random weights" in line]
    assert len(notice) == 1 and "preset toy" in notice[0]
    assert "--checkpoint DIR" in notice[0] and "--hf-dir DIR" in notice[0]


def test_json_output_and_seeded_sampling(capsys):
    args = ["generate", "--preset", "toy", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", "3", "--json", "--warmup", "0", "--ignore-eos"]
    code, out, err = run_cli(args, capsys)
    assert "random weights (preset toy)" in err and "--checkpoint DIR" in err
    first, second = json.loads(out), json.loads(run_cli(args, capsys)[1])
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 6
    assert first["tpot_ms"] > 0 and first["tokens_per_s"] > 0


def test_convert_then_generate_from_checkpoint(tmp_path, capsys):
    from conversion.synthetic import write_synthetic

    write_synthetic(tmp_path / "hf", preset("toy"), seed=1, dtype="float32", progress=False)
    assert main(["convert", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), "--dtype",
                 "float32"]) == 0
    capsys.readouterr()
    common = ["--max-new-tokens", "5", "--json", "--warmup", "0", "--ignore-eos", "--prompt-ids", "4,8,15,16,23"]
    from_ckpt = json.loads(run_cli(["generate", "--checkpoint", str(tmp_path / "ck"), *common], capsys)[1])
    from_hf = json.loads(run_cli(["generate", "--hf-dir", str(tmp_path / "hf"), "--dtype", "float32", *common],
                                 capsys)[1])
    as_stored = json.loads(run_cli(["generate", "--hf-dir", str(tmp_path / "hf"), *common], capsys)[1])
    assert from_ckpt["tokens"] == from_hf["tokens"] == as_stored["tokens"]


def test_hf_dir_without_dtype_asks_for_the_stored_dtype(monkeypatch, files):
    import conversion.load

    seen = {}

    def fake_load_hf(hf_dir, **kwargs):
        seen.update(kwargs)
        raise CheckpointError("stop after the call")

    monkeypatch.setattr(conversion.load, "load_hf", fake_load_hf)
    for flags, want in (([], None), (["--dtype", "bfloat16"], "bfloat16")):
        with pytest.raises(SystemExit):
            main(["generate", "--hf-dir", str(files / "hf"), "--max-new-tokens", "2", *flags])
        assert (seen["dtype"] if want is None else seen["dtype"].name) == want


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


def test_text_prompt_with_tokenizer(files, capsys):
    args = ["generate", "--preset", "toy", "--prompt", "w5 w9 w11", "--tokenizer", str(files / "tokenizer.json"),
            "--max-new-tokens", "4", "--warmup", "0", "--ignore-eos"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0 and all(w.startswith("w") for w in out.split()) and len(out.split()) == 4
    by_ids = json.loads(run_cli(["generate", "--preset", "toy", "--prompt-ids", "5,9,11", "--max-new-tokens", "4",
                                 "--warmup", "0", "--ignore-eos", "--json"], capsys)[1])
    assert out.split() == [f"w{t}" for t in by_ids["tokens"]]


# (args, fragments the message must hold: the option or file named, and the fix). "{files}" is the fixture's root.
BAD_INPUTS = [
    # argparse's own errors: one usage line, not the synopsis of every option
    (["bogus"], ["invalid choice: 'bogus'", "convert", "generate"]),
    (["generate", "--dtype", "float16"], ["--dtype", "invalid choice: 'float16'", "float32", "bfloat16"]),
    (["generate", "--preset", "toy", "--hf-dir", "x"], ["--hf-dir", "not allowed with argument --preset"]),
    (["generate", "--max-new-tokens", "ten"], ["--max-new-tokens", "invalid int value: 'ten'"]),
    (["convert", "--out", "x"], ["the following arguments are required: --hf-dir"]),
    # numbers
    (["generate", "--max-new-tokens", "0"], ["--max-new-tokens 0 must be >= 1"]),
    (["generate", "--max-new-tokens", "-1"], ["--max-new-tokens -1 must be >= 1"]),
    (["generate", "--block-size", "0"], ["--block-size 0 must be >= 1"]),
    (["generate", "--prefill-chunk", "0"], ["--prefill-chunk 0 must be >= 1"]),
    (["generate", "--warmup", "-1"], ["--warmup -1 must be >= 0"]),
    (["generate", "--temperature", "-1"], ["--temperature -1.0 must be a number >= 0"]),
    (["generate", "--temperature", "nan"], ["--temperature nan must be a number >= 0"]),
    (["generate", "--top-p", "0", "--temperature", "1"], ["--top-p 0.0 must lie in (0, 1]"]),
    (["generate", "--top-p", "1.5", "--temperature", "1"], ["--top-p 1.5 must lie in (0, 1]"]),
    (["generate", "--top-p", "0.5"], ["--top-p 0.5 has no effect with --temperature 0", "drop --top-p",
                                      "--temperature > 0"]),
    (["generate", "--max-new-tokens", "5000"], ["the prompt (12 tokens) + --max-new-tokens 5000",
                                                "max_position_embeddings=4096", "--max-new-tokens 4084 or fewer"]),
    # prompt
    (["generate", "--prompt-ids", "1,x"], ["--prompt-ids '1,x' must be comma-separated integers, e.g. 1,2,3"]),
    (["generate", "--prompt-ids", ""], ["--prompt-ids '' holds no token id", "e.g. 1,2,3"]),
    (["generate", "--prompt-ids", "1,512"], ["--prompt-ids", "[512]", "vocabulary [0, 512)", "pass ids in [0, 512)"]),
    (["generate", "--prompt-ids=-3,4"], ["--prompt-ids", "[-3]", "pass ids in [0, 512)"]),
    (["generate", "--prompt-ids", "-3,4"], ["--prompt-ids: expected one argument", "goes as --prompt-ids=VALUE"]),
    (["generate", "--prompt", "hello"], ["--prompt needs --tokenizer tokenizer.json", "--prompt-ids"]),
    (["generate", "--prompt", "", "--tokenizer", "{files}/tokenizer.json"],
     ["--prompt '' encodes to no tokens", "pass a prompt"]),
    (["generate", "--tokenizer", "{files}/missing.json"], ["--tokenizer {files}/missing.json does not exist",
                                                           "pass the tokenizer.json"]),
    (["generate", "--tokenizer", "{files}/not-a-tokenizer.json"],
     ["--tokenizer {files}/not-a-tokenizer.json is not a tokenizer.json", "pass the tokenizer.json"]),
    # model source
    (["generate", "--backend", "bogus"], ["--backend", "'bogus'", "'reference'", "op=choice"]),
    (["generate", "--hf-dir", "{files}/odd-sizes", "--backend", "pallas"],
     ["--backend", "head_dim=24", "kda=reference"]),
    (["generate", "--preset", "bogus"], ["--preset", "unknown preset 'bogus'", "toy"]),
    (["generate", "--hf-dir", "{files}/missing"], ["--hf-dir {files}/missing does not exist",
                                                   "config.json + *.safetensors"]),
    (["generate", "--hf-dir", "{files}/empty"], ["--hf-dir {files}/empty has no config.json",
                                                 "config.json + *.safetensors"]),
    (["generate", "--hf-dir", "{files}/config-only"], ["--hf-dir {files}/config-only has config.json but no",
                                                       "model.safetensors", "holds the weights"]),
    (["generate", "--hf-dir", "{files}/llama"], ["--hf-dir {files}/llama", "unknown model_type 'llama'",
                                                 "bailing_hybrid"]),
    (["generate", "--hf-dir", "{files}/gelu"], ["hidden_act=\"gelu\" is not supported", "hidden_act=\"silu\""]),
    (["generate", "--hf-dir", "{files}/kda-first-says-mla"],
     ["layer 0: config.json layer_types says full_attention (MLA) but the checkpoint holds KDA tensors",
      "fix: correct layer_types in config.json"]),
    (["generate", "--hf-dir", "{files}/truncated"], ["cannot be read (truncated or corrupt)", "re-download"]),
    (["generate", "--hf-dir", "{files}/bad-json"], ["--hf-dir {files}/bad-json", "config.json", "JSON"]),
    (["generate", "--hf-dir", "{files}/out-taken"], ["--hf-dir {files}/out-taken is a ling-jax (orbax) checkpoint",
                                                     "pass --checkpoint {files}/out-taken"]),
    (["generate", "--checkpoint", "{files}/missing"], ["--checkpoint", "{files}/missing does not exist",
                                                       "ling-jax convert --out"]),
    (["generate", "--checkpoint", "{files}/hf"], ["--checkpoint {files}/hf is an HF safetensors checkpoint",
                                                  "pass --hf-dir {files}/hf",
                                                  "ling-jax convert --hf-dir {files}/hf --out OUT"]),
    (["generate", "--checkpoint", "{files}/params-no-config"], ["--checkpoint", "params-no-config lacks config.json",
                                                                "ling-jax convert --hf-dir HF_DIR --out"]),
    (["generate", "--checkpoint", "{files}/empty"], ["{files}/empty lacks params/ and config.json"]),
    (["generate", "--checkpoint", "{files}/params-unreadable"],
     ["{files}/params-unreadable/params: orbax cannot read it", "convert the HF checkpoint again"]),
    # speculative decoding
    (["generate", "--num-draft", "3"], ["--num-draft needs --spec", "pass --spec"]),
    (["generate", "--spec", "mtp", "--num-draft", "0"], ["--num-draft 0 must lie in 1..16"]),
    (["generate", "--spec", "mtp", "--num-draft", "17"], ["--num-draft 17 must lie in 1..16"]),
    (["generate", "--spec", "oracle"], ["--spec oracle replays the continuation given by --oracle-ids"]),
    (["generate", "--spec", "oracle", "--oracle-ids", "1,999"], ["--oracle-ids [999]", "vocabulary [0, 512)"]),
    (["generate", "--spec", "model"], ["--spec model drafts with the model in --draft-checkpoint"]),
    (["generate", "--spec", "model", "--draft-checkpoint", "{files}/missing"],
     ["--draft-checkpoint {files}/missing does not exist"]),
    (["generate", "--spec", "model", "--draft-checkpoint", "{files}/wide-vocab"],
     ["vocab_size=1024 but the target has 512", "share the target's tokenizer"]),
    (["generate", "--hf-dir", "{files}/no-mtp", "--spec", "mtp"], ["--spec mtp", "NextN", "--spec suffix"]),
    (["generate", "--spec", "bogus"], ["--spec", "invalid choice: 'bogus'"]),
    # convert
    (["convert", "--hf-dir", "{files}/missing", "--out", "{files}/new"], ["--hf-dir {files}/missing does not exist"]),
    (["convert", "--hf-dir", "{files}/empty", "--out", "{files}/new"], ["--hf-dir {files}/empty has no config.json"]),
    (["convert", "--hf-dir", "{files}/out-taken", "--out", "{files}/new"],
     ["is a ling-jax (orbax) checkpoint", "ling-jax generate --checkpoint {files}/out-taken"]),
    (["convert", "--hf-dir", "{files}/hf", "--out", "{files}/out-taken"],
     ["--out {files}/out-taken already holds a ling-jax checkpoint", "pass --force"]),
    (["convert", "--hf-dir", "{files}/hf", "--out", "{files}/hf"], ["--out {files}/hf is the --hf-dir",
                                                                    "choose another --out"]),
]


@pytest.mark.parametrize("args, fragments", BAD_INPUTS, ids=[" ".join(args) for args, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line(args, fragments, files):
    result = run_ling_jax(*_expand(args, files))
    message = assert_refused(result, *_expand(fragments, files))
    command = f"ling-jax {args[0]}" if args[0] in ("generate", "convert") else "ling-jax"
    assert result.stderr.startswith(f"usage: {command}") and f"{command} --help lists them" in result.stderr
    # A checkpoint's problems come as one headed list (a line per layer or shard); everything else is one line.
    listing = message.splitlines()[0].endswith(":") and all(line.startswith("  ") for line in message.splitlines()[1:])
    assert len(message.strip().splitlines()) == 1 or listing, message


def test_convert_refuses_an_existing_out_before_loading(files):
    """The API checks before `load_hf`: a missing --hf-dir is not even looked at."""
    from conversion.orbax_io import convert

    with pytest.raises(FileExistsError, match="params exists; pass force=True"):
        convert(files / "missing", files / "out-taken")


def test_load_params_names_load_hf_for_an_hf_directory(files):
    from conversion.orbax_io import load_params

    with pytest.raises(CheckpointError, match=r"is an HF safetensors checkpoint(.|\n)*load_hf\("
                                              r"(.|\n)*ling-jax convert --hf-dir"):
        load_params(files / "hf")


@pytest.mark.parametrize("command", ["generate", "convert", "bench", None])
def test_help_shows_every_default(command):
    result = run_ling_jax(*([command] if command else []), "--help")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    entries = _option_entries(result.stdout)
    assert len(entries) >= (14 if command == "generate" else 6 if command else 1)
    for header, text in entries:
        is_flag = re.fullmatch(r"(-\w, )?--[\w-]+", header) is not None
        assert is_flag or "(default:" in text or "(required)" in text, f"{header}: no default in {text!r}"
    if command == "generate":
        dtype = dict(entries)["--dtype {float32,bfloat16,fp8}"]
        assert "float32 for --preset" in dtype and "stored in the safetensors for --hf-dir" in dtype
        assert "stored in the checkpoint for --checkpoint" in dtype


def _option_entries(help_text: str) -> list[tuple[str, str]]:
    """(option header, its help joined into one line) for each entry of the help's "options:" section."""
    entries: list[tuple[str, list[str]]] = []
    in_options = False
    for line in help_text.splitlines():
        if line and not line.startswith(" "):
            in_options = line == "options:"
        elif in_options and re.match(r"  -", line):
            header, _, text = line.strip().partition("  ")
            entries.append((header, [text]))
        elif in_options and entries and line.startswith("    "):
            entries[-1][1].append(line.strip())
    return [(header, " ".join(" ".join(parts).split())) for header, parts in entries]


def test_times_that_include_compilation_are_flagged():
    """With --warmup 0 the timed run is the compiling one: the reported times say so on stderr."""
    cold = run_ling_jax("generate", "--max-new-tokens", "2", "--warmup", "0", "--json")
    assert cold.returncode == 0, cold.stderr
    assert "the timed run compiled" in cold.stderr and "pass --warmup 1" in cold.stderr
    warm = run_ling_jax("generate", "--max-new-tokens", "2", "--warmup", "1", "--json")
    assert warm.returncode == 0 and "the timed run compiled" not in warm.stderr, warm.stderr


def test_speculative_generate_reports_acceptance_and_equals_plain_greedy():
    common = ["generate", "--max-new-tokens", "24", "--json", "--warmup", "0", "--ignore-eos"]
    plain = json.loads(run_ling_jax(*common).stdout)
    for spec in (["--spec", "suffix", "--num-draft", "4"], ["--spec", "mtp"],
                 ["--spec", "oracle", "--oracle-ids", ",".join(map(str, plain["tokens"]))]):
        result = run_ling_jax(*common, *spec)
        assert result.returncode == 0, result.stderr
        got = json.loads(result.stdout)
        assert got["tokens"] == plain["tokens"]
        assert {"accept_length", "verify_steps", "drafted", "accepted"} <= set(got)
        assert got["accept_length"] == (got["accepted"] + got["verify_steps"]) / got["verify_steps"]
    assert got["accept_length"] == 4  # the oracle with the true continuation: k + 1 every step
