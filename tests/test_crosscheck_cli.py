"""`ling-jax crosscheck` (ling_jax/cli.py, ling_jax.crosscheck.stream): ling-jax against transformers,
streamed layer by layer.

On transformers-written checkpoints every layer's hidden state after the mixer and after the FFN, in float32, is
within 1e-5 of transformers' float32 run and the expert sets agree; an expert permuted in one layer of the
ling-jax side (an orbax --checkpoint) is named at that layer and not before, and the command fails; greedy decoding
agrees over 32 steps; --json carries the rows; a 2.4 GB checkpoint is checked in host memory bounded by its largest
layer. The prompt is 70 tokens: the chunked KDA runs a full 64-token chunk and a partial one.
"""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from conversion.load import load_hf
from conversion.orbax_io import save_params
from ling_jax import crosscheck
from ling_jax.config import MOE
from ling_jax import cli

from tests.cli_run import REPO
from tests.hf_ref import CONFIGS, SCHEDULE_CONFIGS, saved_checkpoint
from tests.numerics import input_seed

T_PROMPT = 70
TOL_F32 = 1e-5  # both sides compute the same float32 math; they differ only in summation order (~1e-7 measured)
# q_lora_rank null with a dense layer; q_lora_rank set with non-default theta and eps; a trailing partial group.
CASES = [CONFIGS[0], CONFIGS[1], SCHEDULE_CONFIGS[0]]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def case(request, tmp_path_factory):
    small = request.param
    _, _, hf_dir = saved_checkpoint(small, tmp_path_factory)
    ids = np.random.default_rng(input_seed(CONFIGS.index(small))).integers(2, small.vocab_size, size=T_PROMPT)
    return dict(small=small, hf_dir=hf_dir, ids=",".join(map(str, ids)))


def main(argv: list[str]) -> int:
    return cli.main(["crosscheck", *argv])


def _run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # what came before (input_seed prints the seed it drew)
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


def test_every_layer_within_float32_tolerance(case, capsys):
    """Every layer is reported, each error within 1e-5 and each MoE layer's expert sets all agreeing; the logits
    too; the JSON output carries it all and the command exits 0."""
    code, out = _run(capsys, "--hf-dir", case["hf_dir"], "--prompt-ids", case["ids"], "--decode-steps", 2, "--json")
    report = json.loads(out)
    n = case["small"].num_hidden_layers
    assert [r["layer"] for r in report["rows"]] == list(range(n))
    for row in report["rows"]:
        assert row["mixer"] <= TOL_F32 and row["ffn"] <= TOL_F32 and row["ok"], row
        assert (row["experts"] == 1.0) if row["kind"].endswith(MOE) else row["experts"] is None, row
    assert report["logits"]["error"] <= TOL_F32 and report["logits"]["top1"] == 1.0
    assert report["ok"] and report["first_failure"] is None and code == 0


def test_bfloat16_is_held_to_transformers_own_bf16_spread(capsys):
    """--dtype bfloat16: each row carries transformers' own bf16 error (the spread) and a tolerance of 3x it;
    ling-jax's bf16 stays within it (measured 0.8-1.0x the spread) and the command exits 0."""
    small = CONFIGS[0]
    ids = np.random.default_rng(input_seed(0)).integers(2, small.vocab_size, size=T_PROMPT)
    code, out = _run(capsys, "--hf-dir", _checkpoint(small), "--prompt-ids", ",".join(map(str, ids)),
                     "--dtype", "bfloat16", "--decode-steps", 1, "--json")
    report = json.loads(out)
    for row in report["rows"]:
        for q in ("mixer", "ffn"):
            assert 1e-4 < row["spread"][q] < 5e-2, row  # bf16 rounding, neither absent nor chaotic
            assert row[f"{q}_tolerance"] == pytest.approx(3 * row["spread"][q]) and row[q] <= row[f"{q}_tolerance"]
        assert (row["experts_min"] is None) == (row["experts"] is None) and (row["experts_min"] or 0) >= 0
    assert report["ok"] and code == 0


def test_greedy_agreement_over_32_decode_steps(capsys):
    small = CONFIGS[0]
    hf_dir = _checkpoint(small)
    ids = np.random.default_rng(input_seed(0)).integers(2, small.vocab_size, size=T_PROMPT)
    code, out = _run(capsys, "--hf-dir", hf_dir, "--prompt-ids", ",".join(map(str, ids)), "--decode-steps", 32)
    assert code == 0, out
    assert "decode: greedy agreement 32/32 steps" in out
    assert "every check within tolerance" in out


_CHECKPOINTS = {}


def _checkpoint(small):
    if small.name not in _CHECKPOINTS:
        import tempfile
        from pathlib import Path

        from tests.hf_ref import build

        m32, _ = build(small, seed=CONFIGS.index(small))
        out = Path(tempfile.mkdtemp(prefix="crosscheck-"))
        m32.save_pretrained(out, max_shard_size="200KB")
        _CHECKPOINTS[small.name] = out
    return _CHECKPOINTS[small.name]


def test_permuted_expert_is_named_at_its_layer(tmp_path, capsys):
    """Two experts swapped in one MoE layer of the ling-jax side (an orbax --checkpoint converted from the same HF
    directory): the layers before it pass, that layer's FFN fails (its mixer still passes), the summary names it and
    the command exits 1."""
    small = CONFIGS[1]
    hf_dir = _checkpoint(small)
    cfg, params = load_hf(hf_dir, dtype=jnp.float32, progress=False)
    k = 3
    assert cfg.layer_kinds[k][1] == MOE
    ffn = params["layers"][k]["ffn"]
    swap = jnp.array([1, 0] + list(range(2, cfg.num_experts)))
    for name in ("we_gate", "we_up", "we_down"):
        ffn[name] = ffn[name][swap]
    save_params(tmp_path / "orbax", cfg, params)
    ids = np.random.default_rng(input_seed(1)).integers(2, small.vocab_size, size=T_PROMPT)
    code, out = _run(capsys, "--hf-dir", hf_dir, "--checkpoint", tmp_path / "orbax", "--prompt-ids",
                     ",".join(map(str, ids)), "--decode-steps", 1, "--json")
    report = json.loads(out)
    rows = report["rows"]
    assert all(r["ok"] for r in rows[:k]), rows[:k]
    assert rows[k]["mixer"] <= TOL_F32 and rows[k]["ffn"] > 100 * TOL_F32, rows[k]
    assert report["first_failure"].startswith(f"layer {k} (kda+moe) ffn"), report["first_failure"]
    assert code == 1


def test_window_checks_only_its_layers(capsys):
    small = CONFIGS[1]
    ids = ",".join(map(str, range(2, 30)))
    code, out = _run(capsys, "--hf-dir", _checkpoint(small), "--prompt-ids", ids, "--layers", "2:4",
                     "--decode-steps", 1, "--json")
    report = json.loads(out)
    assert [r["layer"] for r in report["rows"]] == [2, 3] and report["layers"] == [2, 4]
    assert report["ok"] and code == 0


def test_without_torch_says_what_to_install(monkeypatch, capsys):
    hf_dir = _checkpoint(CONFIGS[0])  # written with torch, before it goes
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as stop:
        main(["--hf-dir", str(hf_dir), "--prompt-ids", "2,3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert 'pip install "ling-jax[crosscheck]"' in err and "Traceback" not in err


@pytest.mark.parametrize("window", ["4:2", "0:99", "x:1", "3"])
def test_bad_window_is_refused(window, capsys):
    small = CONFIGS[0]
    with pytest.raises(SystemExit) as stop:
        main(["--hf-dir", str(_checkpoint(small)), "--layers", window])
    assert stop.value.code == 2
    assert f"--layers {window!r} must be A:B with 0 <= A < B <= {small.num_hidden_layers}" in capsys.readouterr().err


def test_backend_whose_kernels_do_not_fit_is_refused(capsys):
    """The test configs' MLA head dims are below what the Pallas prefill kernel takes: refused before any layer."""
    with pytest.raises(SystemExit) as stop:
        main(["--hf-dir", str(_checkpoint(CONFIGS[0])), "--prompt-ids", "2,3", "--backend", "pallas"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--backend: " in err and "Traceback" not in err


def test_unexplained_flips_allow_only_near_ties():
    """A differing argmax passes when the reference's gap is within 2 tolerance ||ref||, and fails beyond it."""
    ref = np.array([[3.0, 1.0, 2.999], [3.0, 1.0, 2.0]])
    ours = np.array([[2.998, 1.0, 3.0], [2.0, 1.0, 3.0]])
    bound = 1e-3 / (2 * np.linalg.norm(ref[0]))  # the first row's gap 1e-3 sits at this tolerance
    assert crosscheck.unexplained_flips(ours, ref, 1.01 * bound) == [1]
    assert crosscheck.unexplained_flips(ours, ref, 0.99 * bound) == [0, 1]


# A checkpoint of few wide layers: 3 MoE layers of 64 experts of 1024 x 1024, float32 on disk: 2.4 GB. The shared
# expert is as wide as a routed one, as transformers builds it.
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from conversion.synthetic import write_synthetic
    from ling_jax.config import preset
    cfg = preset("toy", num_layers=3, layer_group_size=3, hidden_size=1024, num_experts=64, moe_intermediate_size=1024,
                 shared_expert_intermediate_size=1024, intermediate_size=256, first_k_dense_replace=0,
                 num_mtp_layers=0, expert_swiglu_limits=(), shared_swiglu_limits=())
    write_synthetic(sys.argv[1], cfg, dtype="float32", progress=False)

    import ling_jax.cli, ling_jax.crosscheck, torch, transformers  # noqa: the baseline holds the imports
    ling_jax.crosscheck.import_reference_model()
    import jax.numpy
    jax.numpy.zeros(1).block_until_ready()

    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

    import gc; gc.collect()
    import ctypes; ctypes.CDLL(None).malloc_trim(0)
    base = status("VmRSS:")
    code = ling_jax.cli.main(["crosscheck", "--hf-dir", sys.argv[1], "--prompt-ids", "5,6,7,8,9,10,11,12",
                              "--decode-steps", "1", "--json"])
    print(json.dumps(dict(code=code, base=base, peak=status("VmHWM:"))), file=sys.stderr)
""")


def test_streamed_memory_stays_near_two_layers(tmp_path):
    """The whole check (prefill and a decode step) of a 2.4 GB checkpoint raises the process's peak RSS (VmHWM) by
    less than 3x its largest layer + 500 MB over the RSS after the imports: each side holds one layer (2x), and
    reading a stacked expert leaf holds one more copy of it while it is placed (a third of a layer), beside the
    activations and JAX's compiled ops (the 500 MB). The whole model loaded would be 3x the largest layer per side."""
    ckpt = tmp_path / "wide"
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(ckpt)], capture_output=True, text=True,
                            cwd=REPO, timeout=600, env={**_cpu_env(), "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    report = json.loads(result.stdout)
    assert report["ok"] and stats["code"] == 0, result.stdout[-2000:]
    total = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    layer = _largest_layer_bytes(ckpt)
    assert total >= 2e9 and layer >= 0.8e9, (total, layer)
    grown = stats["peak"] - stats["base"]
    print(f"checkpoint {total / 1e9:.2f} GB, largest layer {layer / 1e9:.2f} GB, peak RSS grew {grown / 1e9:.2f} GB")
    assert grown < 3 * layer + 500e6, f"peak grew {grown / 1e9:.2f} GB over the imports; layer {layer / 1e9:.2f} GB"


def _largest_layer_bytes(ckpt) -> int:
    from conversion.load import read_catalog

    catalog, _ = read_catalog(ckpt)
    sizes = {}
    for name, info in catalog.items():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            sizes[layer] = sizes.get(layer, 0) + info.nbytes
    return max(sizes.values())


def _cpu_env() -> dict:
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_shared_expert_transformers_cannot_build_is_refused(tmp_path, capsys):
    """transformers sizes the shared expert from moe_intermediate_size: a checkpoint with another width stops with
    that named, before either side loads a layer."""
    from conversion.synthetic import write_synthetic
    from ling_jax.config import preset

    cfg = preset("toy", num_layers=2, layer_group_size=2, hidden_size=64, num_experts=8, moe_intermediate_size=64,
                 shared_expert_intermediate_size=32, intermediate_size=32, first_k_dense_replace=0,
                 num_mtp_layers=0, expert_swiglu_limits=(), shared_swiglu_limits=())
    write_synthetic(tmp_path / "narrow", cfg, dtype="float32", progress=False)
    with pytest.raises(SystemExit) as stop:
        main(["--hf-dir", str(tmp_path / "narrow"), "--prompt-ids", "2,3,4"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "shared expert is 32 wide but transformers builds it" in err and "Traceback" not in err


def test_fp8_checkpoint_both_sides_dequantise_the_blocks(tmp_path, capsys):
    """A block-FP8 checkpoint (the -fp8 release's layout): transformers gets the blocks dequantised, ling-jax
    dequantises them in its loader; in float32 every layer agrees within 1e-5."""
    from conversion.synthetic import write_synthetic
    from ling_jax.config import preset

    cfg = preset("toy", num_mtp_layers=0, quantization="fp8", expert_swiglu_limits=(), shared_swiglu_limits=())
    write_synthetic(tmp_path / "fp8", cfg, progress=False)
    assert any(i.dtype == "F8_E4M3" for i in crosscheck.TorchFromHF(tmp_path / "fp8", cfg, "cpu").catalog.values())
    ids = ",".join(map(str, np.random.default_rng(input_seed(5)).integers(2, cfg.vocab_size, size=40)))
    code, out = _run(capsys, "--hf-dir", tmp_path / "fp8", "--prompt-ids", ids, "--decode-steps", 2, "--json")
    report = json.loads(out)
    assert [r["layer"] for r in report["rows"]] == list(range(cfg.num_layers))
    assert all(r["mixer"] <= TOL_F32 and r["ffn"] <= TOL_F32 for r in report["rows"]), report["rows"]
    assert report["ok"] and code == 0
