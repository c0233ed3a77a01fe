"""The `ling-jax` command line: the embedded default, convert -> generate, and one clear error per bad input.

Bad inputs run the real entry point in a subprocess (`tests/cli_run.py`), so the test sees what a shell sees: the
exit code, one usage line at most, no traceback, and a message naming the option and the fix.
"""

import contextlib
import io
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from conversion.load import CheckpointError
from ling_jax.cli import main
from ling_jax.config import preset, to_hf_dict
from tests.cli_run import REPO, assert_refused, run_ling_jax

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
    (["generate", "--spec", "suffix", "--max-new-tokens", "4084"],
     ["--max-new-tokens 4084 + --num-draft 3 + 1 exceeds", "max_position_embeddings=4096",
      "--max-new-tokens 4080 or fewer"]),
    # bench: SGLang's 8192 + 1024 against a small model's positions, --layers against the preset, where rows go
    (["bench", "--preset", "toy", "--random-weights"],
     ["--prompt-len 8192 + --output-len 1024 exceeds the model's max_position_embeddings=4096",
      "pass --prompt-len 3072 or less"]),
    (["bench", "--hf-dir", "{files}/hf"], ["--prompt-len 8192 + --output-len 1024 exceeds",
                                           "pass --prompt-len 3072 or less"]),
    (["bench", "--preset", "toy", "--random-weights", "--prompt-len", "3072", "--spec", "suffix"],
     ["--prompt-len 3072 + --output-len 1024 + --num-draft 3 + 1 exceeds", "pass --prompt-len 3068 or less"]),
    (["bench", "--preset", "toy", "--random-weights", "--output-len", "5000"],
     ["--output-len 5000 exceeds", "pass --output-len 4095 or less"]),
    (["bench", "--preset", "toy", "--random-weights", "--layers", "100"],
     ["--layers 100 must lie in 1..6", "preset toy has 6 layers", "leave --layers out"]),
    (["bench", "--preset", "ling-3.0-tiny", "--random-weights", "--layers", "30"],
     ["--layers 30 must lie in 1..24", "preset ling-3.0-tiny has 24 layers"]),
    (["bench", "--preset", "toy", "--random-weights", "--layers", "0"], ["--layers 0 must lie in 1..6"]),
    (["bench", "--preset", "toy", "--random-weights", "--prompt-len", "16", "--output-len", "4", "--results",
      "{files}/tokenizer.json/row.json"], ["--results {files}/tokenizer.json/row.json",
                                           "{files}/tokenizer.json cannot hold it", "writable directory"]),
    # tensor parallelism and several processes (the counts that need devices: TP_BAD_INPUTS)
    (["generate", "--tp", "0"], ["--tp 0 must be >= 1"]),
    (["generate", "--tp", "2"], ["--tp 2", "needs 2 devices; 1 are visible",
                                 "XLA_FLAGS=--xla_force_host_platform_device_count=2"]),
    (["bench", "--preset", "toy", "--random-weights", "--tp", "-2"], ["--tp -2 must be >= 1"]),
    (["convert", "--hf-dir", "{files}/hf", "--out", "{files}/new", "--tp", "0"], ["--tp 0 must be >= 1"]),
    (["generate", "--coordinator", "localhost:8476"], ["--coordinator needs", "--num-processes P and --process-id I",
                                                       "pass --num-processes and --process-id too"]),
    (["bench", "--preset", "toy", "--random-weights", "--num-processes", "2", "--process-id", "0"],
     ["pass --coordinator too"]),
    (["generate", "--coordinator", "localhost:8476", "--num-processes", "2", "--process-id", "2"],
     ["--process-id 2 must lie in 0..1"]),
    (["generate", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
     ["--coordinator 'localhost' must be HOST:PORT"]),
    (["generate", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1",
      "--coordinator-timeout", "1"], ["--coordinator 127.0.0.1:9 cannot be reached within 1 s",
                                      "start process 0 (--process-id 0)"]),
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
    command = f"ling-jax {args[0]}" if args[0] in ("generate", "convert", "bench") else "ling-jax"
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
        text = " ".join(result.stdout.split())
        assert "equals plain greedy token for token in float32" in text and "In bfloat16" in text and "drift" in text
    if command == "bench":
        assert "bench_<model>_<dtype>[_<spec><K>][_tp<N>].json in the current directory" in dict(entries)[
            "--results PATH"]


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


def test_tpot_counts_kept_tokens_and_is_none_without_a_decode_step(capsys):
    """TPOT is SGLang's, over the tokens kept: tokens/s and TPOT agree with each other, however large the block
    (capped at the tokens asked for); a single token has no decode step, so no TPOT and no accept length."""
    from ling_jax.engine.generate import generate
    from ling_jax.engine.sampling import Greedy
    from ling_jax.params import init_params

    common = ["generate", "--warmup", "0", "--ignore-eos"]
    code, out, _ = run_cli([*common, "--max-new-tokens", "4", "--block-size", "1000", "--json"], capsys)
    got, n = json.loads(out), 4
    assert code == 0 and len(got["tokens"]) == n
    assert got["tokens_per_s"] == pytest.approx(n / ((got["ttft_ms"] + (n - 1) * got["tpot_ms"]) / 1e3), rel=1e-6)
    cfg = preset("toy")
    params = init_params(cfg, jax.random.key(0), jax.numpy.float32, with_mtp=False)
    assert generate(params, cfg, [[1, 2, 3]], max_new_tokens=n, sampler=Greedy(), block_size=1000).steps == n - 1
    code, out, _ = run_cli([*common, "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["tpot_ms"] is None
    code, out, _ = run_cli([*common, "--max-new-tokens", "1", "--spec", "suffix", "--json"], capsys)
    assert code == 0 and json.loads(out)["tpot_ms"] is None and json.loads(out)["accept_length"] is None
    code, _, err = run_cli([*common, "--max-new-tokens", "1", "--spec", "suffix"], capsys)
    assert code == 0 and "TPOT n/a" in err and "accept length n/a" in err


def test_bench_writes_its_row_where_it_runs_not_in_the_source_tree(tmp_path):
    """Run from another directory, `bench` writes its row there, under the name its help gives, and says so; nothing
    lands in the source tree. Its TPOT, latency and tokens/s agree with each other."""
    def rows_in_tree():
        return {f: f.stat().st_mtime_ns for d in (REPO, REPO / "experiments" / "results", REPO / "ling_jax")
                for f in d.glob("bench_*.json")}

    before = rows_in_tree()
    result = run_ling_jax("bench", "--preset", "toy", "--random-weights", "--prompt-len", "16", "--output-len", "5",
                          "--block-size", "4", "--warmup", "0", "--repeats", "1", "--backend", "reference",
                          "--no-kernel-count", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    wrote = [line for line in result.stderr.splitlines() if line.startswith("ling-jax bench: wrote ")]
    target = tmp_path / "bench_toy_bfloat16.json"
    assert len(wrote) == 1 and Path(wrote[0].split("wrote ", 1)[1]).resolve() == target.resolve()
    row = json.loads(target.read_text())
    assert row == json.loads(result.stdout.strip().splitlines()[-1])
    assert rows_in_tree() == before
    assert row["latency_ms"] == pytest.approx(row["ttft_ms"] + 4 * row["tpot_ms_median"], rel=1e-9)
    assert row["output_tokens_per_s"] == pytest.approx(5 / (row["latency_ms"] / 1e3), rel=1e-9)


def test_bench_spec_oracle_is_planned_acceptance(tmp_path):
    """`bench --spec oracle --accept-length A` is the planned timing mode: its row says so, its accept length is the
    device's count and equals the plan's over the steps run, and it reports the natural agreement of the drafts
    with the verify's argmax (here the model's own greedy output, which bf16 verify roundings leave at times)."""
    from ling_jax.bench import planned_accept_length

    result = run_ling_jax("bench", "--preset", "toy", "--random-weights", "--prompt-len", "16", "--output-len", "40",
                          "--block-size", "4", "--warmup", "0", "--repeats", "1", "--backend", "reference",
                          "--no-kernel-count", "--spec", "oracle", "--num-draft", "3", "--accept-length", "2.5",
                          "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["acceptance"] == "planned (timing)" and 0.5 < row["agreement"] <= 1.0, row["agreement"]
    [steps] = row["verify_steps"]
    assert row["accept_length"] == pytest.approx(planned_accept_length(3, 2.5, steps), abs=1e-9)
    assert abs(row["accept_length"] - 2.5) < 0.1


def test_bench_spec_profile_profiles_the_spec_step(tmp_path, capsys, monkeypatch):
    """`bench --spec oracle --profile` profiles the speculative step the timed runs ran (its drafter, k, block and
    output length): the row's breakdown is that step's, against the decode time per spec step the device ran (the
    steps counted as the engine dispatched them), and the row sets the spec step beside its verify forward alone and
    the plain step. The CPU has no GPU events, so both profilers hand back synthetic families and record what they
    were asked for."""
    from ling_jax import bench, spec_profile
    from ling_jax.engine import speculative
    from ling_jax.engine.drafters import PlannedDrafter

    def fake(span, families, **more):
        return dict(backend="reference", span_us_per_step=span, busy_us_per_step=span, kernels_per_step=len(families),
                    families=[dict(kernel=k, us_per_step=us, exclusive_us_per_step=us, per_step=1.0, after=None)
                              for k, us in families], **more)

    asked = {}

    def spec_step(params, cfg, backend, prompt, block, **kw):
        asked["spec"] = dict(kw, block=block, prompt_len=np.shape(prompt)[1])
        return fake(1000.0, [("experts_fwd_kernel_gate_up", 600.0), ("kda_recurrent_verify", 300.0),
                             ("loop_select_fusion", 80.0)], k=kw["k"],
                    verify=fake(900.0, [("experts_fwd_kernel_gate_up", 600.0), ("kda_recurrent_verify", 300.0)]))

    def plain_step(params, cfg, backend, prompt, block, **kw):
        asked["plain"] = block
        return fake(400.0, [("experts_fwd_kernel_down_t1", 250.0), ("kda_recurrent_decode", 150.0)])

    def spec_block(*a, **kw):
        asked["blocks"] = asked.get("blocks", 0) + 1
        return real_spec_block(*a, **kw)

    real_spec_block = speculative.spec_block
    monkeypatch.setattr(spec_profile, "profile_spec_step", spec_step)
    monkeypatch.setattr(bench, "profile_step", plain_step)
    monkeypatch.setattr(speculative, "spec_block", spec_block)
    code, out, _ = run_cli(["bench", "--preset", "toy", "--layers", "2", "--random-weights", "--prompt-len", "16",
                            "--output-len", "24", "--block-size", "4", "--warmup", "0", "--repeats", "1",
                            "--backend", "reference", "--no-kernel-count", "--spec", "oracle", "--num-draft", "3",
                            "--accept-length", "2.5", "--profile", "--results", str(tmp_path / "row.json")], capsys)
    assert code == 0
    spec = asked["spec"]
    assert isinstance(spec["drafter"], PlannedDrafter) and spec["k"] == 3 and spec["block"] == 4
    assert spec["max_new"] == 24 and spec["prompt_len"] == 16 and spec["aux"][0].shape == (1, 24)
    assert spec["device"] is None  # one device: its whole timeline
    row = json.loads((tmp_path / "row.json").read_text())
    [verify_steps], [steps_run] = row["verify_steps"], row["steps_run"]
    assert steps_run == 4 * asked["blocks"] > verify_steps  # a block past the output's end runs, timed
    assert row["step_ms_median"] == pytest.approx(row["tpot_ms_median"] * (24 - 1) / steps_run, rel=1e-9)
    b = row["breakdown"]
    assert set(b["ops"]) == {"moe", "kda", "other"} and b["sum_us"] == 980.0
    assert b["step_us"] == round(row["step_ms_median"] * 1e3, 1)
    assert b["tpot_us"] == round(row["tpot_ms_median"] * 1e3, 1)
    assert row["spec_profile"] == dict(spec_step_us=1000.0, verify_forward_us=900.0, plain_step_us=400.0,
                                       outside_verify_us=100.0, outside_verify_pct=10.0)
    assert row["profile"]["plain"]["span_us_per_step"] == 400.0 and asked["plain"] == 4
    assert "spec step 1000.0 µs, verify forward over 4 positions alone 900.0 µs, plain decode step 400.0 µs" in out
    assert "sum 980.0 µs against the spec step's" in out


def test_bench_results_option_takes_a_file_or_a_directory(tmp_path):
    from ling_jax import bench_cli
    from ling_jax.cli import _parser

    parser = _parser()
    base = ["bench", "--preset", "toy", "--random-weights", "--dtype", "fp8", "--tp", "2", "--results"]
    cfg = preset("toy", quantization="fp8")
    for given, want in ((f"{tmp_path}/rows/", tmp_path / "rows" / "bench_toy_fp8_tp2.json"),
                        (str(tmp_path / "row.json"), tmp_path / "row.json")):
        assert bench_cli._results_path(parser.parse_args([*base, given]), cfg, parser) == want
    assert (tmp_path / "rows").is_dir()  # made before the run, so a bad path fails before it


def test_crosscheck_refuses_a_conversion_of_other_weights(files, tmp_path, capsys):
    """An orbax checkpoint converted from another checkpoint of the same config: refused by its fingerprint
    before anything is compared, not reported as a layer-0 error."""
    from conversion.synthetic import write_synthetic

    write_synthetic(tmp_path / "other", preset("toy"), seed=2, dtype="float32", progress=False)
    assert main(["convert", "--hf-dir", str(tmp_path / "other"), "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    result = run_ling_jax("crosscheck", "--hf-dir", files / "hf", "--checkpoint", tmp_path / "ck", timeout=300)
    assert_refused(result, f"--checkpoint {tmp_path / 'ck'} holds other weights than --hf-dir {files / 'hf'}",
                   "final_norm differs", "converted from another checkpoint", "ling-jax convert --hf-dir")


# --tp N: the CLI's sharded runs give the single-device greedy tokens (float32, so the all-reduces' summation order
# moves the logits by ~1e-7 and cannot flip an argmax that is not a tie).

TP_COMMON = ["--dtype", "float32", "--max-new-tokens", "12", "--json", "--warmup", "0", "--ignore-eos",
             "--prompt-ids", "9,41,3,99,12,250,18,5,77,201"]
needs_4_devices = pytest.mark.skipif(len(jax.devices()) < 4,
                                     reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")


@pytest.fixture(scope="module")
def tp_hf(tmp_path_factory):
    """A transformers-written float32 checkpoint whose head count, intermediate sizes and vocabulary divide by 4,
    and its greedy tokens from `generate --tp 1`."""
    from tests.hf_ref import SmallConfig, build

    small = SmallConfig("tp4", num_hidden_layers=2, layer_group_size=2, q_lora_rank=None, first_k_dense_replace=1,
                        num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, vocab_size=256)
    m32, _ = build(small, seed=7)
    hf_dir = tmp_path_factory.mktemp("tp-hf")
    m32.save_pretrained(hf_dir, max_shard_size="200KB")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--hf-dir", str(hf_dir), *TP_COMMON]) == 0
    tokens = json.loads(out.getvalue().strip().splitlines()[-1])["tokens"]
    assert len(set(tokens)) > 3, "the reference output should not be one repeated token"
    return hf_dir, tokens


def _tokens(args, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])["tokens"]


@needs_4_devices
def test_tp4_generate_equals_tp1_plain_and_speculative(tp_hf, capsys):
    hf_dir, single = tp_hf
    assert _tokens(["generate", "--hf-dir", str(hf_dir), *TP_COMMON, "--tp", "4"], capsys) == single
    assert _tokens(["generate", "--hf-dir", str(hf_dir), *TP_COMMON, "--tp", "4", "--spec", "suffix"],
                   capsys) == single


@needs_4_devices
def test_convert_tp4_checkpoint_equals_tp1_conversion(tp_hf, tmp_path, capsys):
    """The conversion only moves values: the tp4 checkpoint's leaves equal the tp1 one's exactly, and it generates
    the --hf-dir tokens on one device."""
    from conversion.orbax_io import load_params

    hf_dir, single = tp_hf
    for tp in ("1", "4"):
        assert main(["convert", "--hf-dir", str(hf_dir), "--out", str(tmp_path / f"tp{tp}"), "--tp", tp]) == 0
    capsys.readouterr()
    (cfg1, p1), (cfg4, p4) = load_params(tmp_path / "tp1"), load_params(tmp_path / "tp4")
    assert cfg1 == cfg4
    leaves1, leaves4 = jax.tree.leaves(p1), jax.tree.leaves(p4)
    assert len(leaves1) == len(leaves4) and all(np.array_equal(a, b) for a, b in zip(leaves1, leaves4))
    assert _tokens(["generate", "--checkpoint", str(tmp_path / "tp4"), *TP_COMMON, "--tp", "1"], capsys) == single


def two_layer_toy():
    """The toy preset cut to one KDA and one MLA layer (its MTP layer kept): the same code paths, a third of the
    compile time."""
    return preset("toy").replace(num_layers=2, layer_group_size=2, first_k_dense_replace=0,
                                 expert_swiglu_limits=(0.0, 4.0), shared_swiglu_limits=(0.0, 5.0))


@needs_4_devices
def test_tp4_mtp_speculation_equals_plain_greedy(tmp_path, capsys):
    """--spec mtp at --tp 4: the MTP layer's params are sharded too, and the output is plain single-device greedy."""
    from conversion.synthetic import write_synthetic

    write_synthetic(tmp_path / "hf", two_layer_toy(), seed=2, dtype="float32", progress=False)
    common = ["generate", "--hf-dir", str(tmp_path / "hf"), *TP_COMMON]
    plain = _tokens(common, capsys)
    assert len(set(plain)) > 3, "the reference output should not be one repeated token"
    assert _tokens([*common, "--tp", "4", "--spec", "mtp", "--num-draft", "2"], capsys) == plain


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_bench_tp2_runs_and_reports(tmp_path, capsys):
    """On 4 visible devices, --tp 2 runs on 2, and the table says 2."""
    code, out, _ = run_cli(["bench", "--preset", "toy", "--layers", "2", "--random-weights", "--tp", "2",
                            "--prompt-len", "16", "--output-len", "5", "--block-size", "4", "--warmup", "0",
                            "--repeats", "1", "--backend", "reference", "--no-kernel-count",
                            "--results", str(tmp_path / "row.json")], capsys)
    assert code == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["tp"] == 2 and row["layers"] == 2 and row["tpot_ms_median"] > 0 and row["ttft_ms"] > 0
    assert f"ours: {jax.devices()[0].device_kind} x 2)" in out


TP_BAD_INPUTS = [
    (["generate", "--tp", "3"], ["--tp 3", "divisible by 3", "'num_attention_heads': 4",
                                 "choose a device count that divides them"]),
    (["generate", "--tp", "8"], ["--tp 8", "needs 8 devices; 4 are visible"]),
    (["generate", "--preset", "ling-3.0-flash", "--dtype", "fp8", "--tp", "4"],
     ["--tp 4", "whole 128-row scale blocks", "'moe_intermediate_size / tp': 192"]),
    (["bench", "--preset", "toy", "--random-weights", "--prompt-len", "16", "--tp", "3"], ["--tp 3", "divisible by 3"]),
    (["convert", "--hf-dir", "{files}/hf", "--out", "{files}/tp3", "--tp", "3"], ["--tp 3", "divisible by 3"]),
]


@pytest.mark.parametrize("args, fragments", TP_BAD_INPUTS, ids=[" ".join(a) for a, _ in TP_BAD_INPUTS])
def test_bad_tp_is_named_before_loading(args, fragments, files):
    """On 4 devices: a count the sizes or the FP8 scale blocks do not take, or more devices than there are."""
    result = run_ling_jax(*_expand(args, files), env={"JAX_NUM_CPU_DEVICES": "4"})
    assert_refused(result, *fragments)
    assert not (files / "tp3").exists()
