"""Tensor-parallel conversion: each device's shard assembled straight from the safetensors sources equals the
unsharded load bit for bit (bf16, block-FP8 as stored, quantised and dequantised); a checkpoint converted from one
mesh restores onto others; `convert` streams to orbax in bounded host memory.

Tolerances: shards hold the very bytes of the unsharded leaves, so leaves are compared bit for bit. Logits of the
restored params on one device are bit-equal to those of the loaded ones (same values, same program); over 2 or 4
devices only the order of the all-reduced fp32 partial sums differs (<= 1e-5 relative, as tests/test_sharding.py).
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conversion import hf
from conversion.load import load_hf, read_catalog
from conversion.orbax_io import PARAMS_DIR, convert, load_params
from conversion.synthetic import write_synthetic
from ling_jax import model
from ling_jax.config import preset, to_hf_dict
from ling_jax.sharding import make_mesh, param_shardings
from pallas_kernels.common.fp8 import Fp8Weight
from tests.numerics import input_seed, rel_err

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4,
                                reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")

TOY = preset("toy")
# Toy widths at which every block-FP8 row split over 2 devices keeps whole 128-row scale blocks.
FP8_TOY = preset("toy", quantization="fp8", head_dim=64, v_head_dim=64, intermediate_size=256,
                 moe_intermediate_size=256, shared_expert_intermediate_size=256)
TOKENS = np.array([[7, 41, 3, 99, 12, 250, 18, 5, 77, 301]], np.int32)


def _leaves(tree) -> dict[str, jax.Array]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {hf.path_str(tuple(hf._key(k) for k in kp)): x for kp, x in flat}


def assert_bit_equal(got, want):
    got, want = _leaves(got), _leaves(want)
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g.shape, g.dtype) == (w.shape, w.dtype), name
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)), name


def assert_placed(params, shardings):
    for name, s in _leaves(shardings).items():
        assert _leaves(params)[name].sharding == s, name


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("bf16") / "ck", TOY, seed=input_seed(11), progress=False)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[str, Path]:
    """The FP8 toy as the -fp8 release stores it, and in float32 (for quantising on load)."""
    root = tmp_path_factory.mktemp("fp8")
    return {"fp8": write_synthetic(root / "fp8", FP8_TOY, seed=input_seed(12), dtype="float32", progress=False),
            "float": write_synthetic(root / "float", FP8_TOY.replace(quantization=None), seed=input_seed(13),
                                     dtype="float32", progress=False)}


def test_sharded_load_is_bit_identical(bf16_dir):
    """TP4: every shard (experts split by intermediate, fused KDA/MLA leaves by head, lm_head by vocab) holds the
    bytes of the unsharded leaf."""
    cfg, want = load_hf(bf16_dir, progress=False)
    shardings = param_shardings(cfg, make_mesh(4))
    _, got = load_hf(bf16_dir, shardings=shardings, progress=False)
    assert_placed(got, shardings)
    assert got["layers"][1]["ffn"]["we_gate"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert_bit_equal(got, want)


@pytest.mark.parametrize("stored, fp8", [("fp8", None), ("float", True), ("fp8", False)],
                         ids=["fp8-as-stored", "quantised", "dequantised"])
def test_sharded_fp8_load_is_bit_identical(fp8_dirs, stored, fp8):
    """TP2 over block-FP8 checkpoints: values and scales of every Fp8Weight (ROWS projections, OUT_IN experts)
    sliced from the F8 tensors, quantised from float ones, or dequantised, equal the unsharded load."""
    cfg, want = load_hf(fp8_dirs[stored], fp8=fp8, progress=False)
    assert (cfg.quantization == "fp8") == (fp8 is not False)
    shardings = param_shardings(cfg, make_mesh(2))
    _, got = load_hf(fp8_dirs[stored], fp8=fp8, shardings=shardings, progress=False)
    if cfg.quantization == "fp8":
        assert isinstance(got["layers"][1]["ffn"]["we_down"], Fp8Weight)
    assert_placed(got, shardings)
    assert_bit_equal(got, want)


def _logits(params, cfg):
    logits, _, _ = model.prefill(params, jnp.asarray(TOKENS), cfg, max_len=64, all_logits=True)
    return np.asarray(logits)


@pytest.mark.parametrize("written, restored", [(4, 2), (4, 1), (1, 4)])
def test_checkpoint_reshards(bf16_dir, tmp_path, written, restored):
    """Converted at one TP degree, in many partial saves (a small group_bytes splits layers across them), restored
    at another: every leaf bit-equal to the HF load, placed as asked, and the float32 logits match."""
    cfg, want = load_hf(bf16_dir, dtype=jnp.float32, progress=False)
    out = tmp_path / "ck"
    convert(bf16_dir, out, dtype=jnp.float32, shardings=param_shardings(cfg, make_mesh(written)), progress=False,
            group_bytes=2**20)
    shardings = param_shardings(cfg, make_mesh(restored))
    cfg_back, got = load_params(out, shardings=shardings)
    assert cfg_back == cfg
    assert_placed(got, shardings)
    assert_bit_equal(got, want)
    got_logits, want_logits = _logits(got, cfg), _logits(want, cfg)
    if restored == 1:
        assert np.array_equal(got_logits, want_logits)
    else:
        assert rel_err(got_logits, want_logits) < 1e-5


def test_checkpoint_of_an_older_version_loads(bf16_dir, tmp_path):
    """One StandardCheckpointer tree directly under params/, as ling-jax wrote before converting in parts."""
    cfg, want = load_hf(bf16_dir, progress=False)
    out = tmp_path / "old"
    out.mkdir()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / PARAMS_DIR, want)
        ckptr.wait_until_finished()
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    _, got = load_params(out, shardings=param_shardings(cfg, make_mesh(4)))
    assert_bit_equal(got, want)


# ---- host memory of a streamed conversion ------------------------------------------------------------------------

# The largest source tensors are the dense MLP's [98304, 1024] float32 (384 MiB, split 4-way by intermediate); each
# stacked expert leaf [96, 1024, 1024] is as large, from 96 sources of 4 MiB; one layer's leaves hold 1.2 GB and the
# checkpoint 2.4 GB. The embeddings stay small: replicated, they occupy one copy per device (4 on this host).
MEM_CFG = preset("toy", vocab_size=8192, hidden_size=1024, num_layers=2, layer_group_size=2, first_k_dense_replace=1,
                 intermediate_size=98304, num_experts=96, moe_intermediate_size=1024, num_mtp_layers=0,
                 expert_swiglu_limits=(0.0, 4.0), shared_swiglu_limits=(0.0, 5.0))

# Peak memory comes from the kernel: VmHWM is the high-water mark of the process's resident memory, so no sampling
# interval can miss a short-lived peak; writing 5 to clear_refs resets it to the current RSS once the imports and the
# devices are up. The loader reads with plain reads (no memory map), so file pages do not count.
_MEASURE = textwrap.dedent("""
    import gc, json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    from conversion.orbax_io import convert
    from ling_jax.config import from_hf
    from ling_jax.sharding import make_mesh, param_shardings

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    shardings = param_shardings(from_hf(sys.argv[1] + "/config.json"), make_mesh(4))
    gc.collect()
    baseline = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    convert(sys.argv[1], sys.argv[2], shardings=shardings, progress=False)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
""")


def test_convert_streams_in_bounded_host_memory(tmp_path):
    """TP4 conversion to orbax of a 2.4 GB checkpoint on CPU (where the devices' shards live in host memory too)
    peaks below 2 x the largest source tensor + 400 MB over the interpreter's baseline: one large leaf and orbax's
    host copy of it while it is written, plus the runtime's slack. Holding the whole model, a whole layer's experts,
    or a leaf's host array beside its shards and orbax's copy would exceed it."""
    try:
        hf_dir = write_synthetic(tmp_path / "hf", MEM_CFG, seed=input_seed(14), dtype="float32", progress=False)
        catalog, _ = read_catalog(hf_dir)
        largest = max(info.nbytes for info in catalog.values())
        assert largest == catalog["model.layers.0.mlp.up_proj.weight"].nbytes == 384 * 2**20
        assert sum(info.nbytes for info in catalog.values()) > 2e9
        run = subprocess.run([sys.executable, "-c", _MEASURE, str(hf_dir), str(tmp_path / "out")],
                             capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600)
        assert (tmp_path / "out" / PARAMS_DIR).is_dir() or run.returncode
    finally:  # 4.4 GB on disk
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    mem = json.loads(run.stdout.strip().splitlines()[-1])
    used = mem["peak"] - mem["baseline"]
    assert used < 2 * largest + 400e6, f"peak {used / 1e6:.0f} MB over the baseline {mem['baseline'] / 1e6:.0f} MB"
