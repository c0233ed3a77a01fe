"""Every benchmark script still runs: `--smoke` on the CPU (toy sizes, interpret mode, the same code paths and
checks as a GPU run), as a subprocess from the repo root, writing nothing to experiments/results; the sm_90
resource report lowers the MLA kernel; and plot_results.py draws its figures from synthetic results files of the
canonical formats."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def run_script(name: str, *args: str, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, f"experiments/{name}.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


def results_state() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in RESULTS.iterdir()} if RESULTS.exists() else {}


SMOKE_OUTPUT = {  # what each smoke run must print beyond exiting 0
    "bench_decode": [r"^reference\s+\d", r"^pallas\s+\d"],  # its TPOT table, a row per backend
    "profile_ops": [r"^moe pallas: ran, no GPU events", r"^mla_1k_t1 reference: ran, no GPU events"],
    "bench_kda": [r"^\| section \| name \| numbers \|", r"checks passed; total"],
    "bench_moe": [r"^\| kind \| backend \| T \|"],
    "bench_mla": [r"^\| L \| T \| backend \|"],
    "bench_suffix": [r"^\| history \| capacity \| k \|", r"^device path = host path, step for step"],
    "bench_spec": [r"^\s+plain\s+1\.00", r"^\s+k=3 a=2\.5\s+2\.50"],  # the planned accept length is exact
    "bench_moe_prefill": [r"^\| kind \| N \| ms \|"],
    "bench_mla_prefill": [r"^\| kind \| T \| L \|"],
    "bench_prefill": [r"^\| prompt \| chunk \| ttft_ms \|"],
    "bench_gemv": [r"^\| kind \| shape \| T \|"],
    "decode_copies": [r"^\| where \| shape \| copies \|", r"^\| every step \| "],
}


@pytest.mark.parametrize("name", sorted(SMOKE_OUTPUT))
def test_benchmark_smoke(name):
    before = results_state()
    out = run_script(name, "--smoke")
    for pattern in SMOKE_OUTPUT[name]:
        assert re.search(pattern, out, re.M), f"{name} --smoke printed no line matching {pattern!r}:\n{out[-3000:]}"
    assert results_state() == before, f"{name} --smoke wrote under experiments/results"


def test_gemv_levers_smoke():
    """bench_gemv's FP8 levers side by side (`--fp8 --levers`): every lever row timed and checked at the toy
    shapes, the sweep after them, the summary table; nothing under experiments/results."""
    before = results_state()
    out = run_script("bench_gemv", "--fp8", "--levers", "--smoke")
    for lever in ("before", "d_rows_fma", "d_rows_dot", "a_rows_dot", "c_w8a8", "rows_sweep"):
        assert re.search(rf"^kda_o\s+T=1\s+{lever}\s+[\d.]+ µs", out, re.M), f"no timed {lever} row:\n{out[-3000:]}"
    assert re.search(r"^\| shape \| T \| before \| d_rows_fma \|", out, re.M), out[-3000:]
    assert results_state() == before, "bench_gemv --levers --smoke wrote under experiments/results"


def test_triton_resources_reports_the_gemv_levers():
    """The sm_90 SASS report of the FP8 GEMV levers: registers, spills and SASS instructions per weight."""
    out = run_script("triton_resources", "--gemv", "--shapes", "kda_o", "--ts", "1",
                     "--levers", "before,d_rows_fma")
    rows_found = re.findall(r"^kda_o\s+T=1\s+(\w+)\s+grid .* regs (\d+) stack (\d+) B .* SASS/weight ([\d.]+) ", out,
                            re.M)
    assert [r[0] for r in rows_found] == ["before", "d_rows_fma"], out
    for _, regs, stack, per_weight in rows_found:
        assert 0 < int(regs) <= 255 and int(stack) == 0 and 1 < float(per_weight) < 20, out


def test_triton_resources_reports_the_default_mla_kernel():
    """The sm_90 resource report (registers, spill stack, shared memory) of the MLA decode kernel, on the CPU."""
    out = run_script("triton_resources", "--t", "1", "--length", "1024", "--tunings", "default")
    m = re.search(r"regs (\d+) stack (\d+) B smem (\d+) KiB", out)
    assert m, out
    regs, smem = int(m.group(1)), int(m.group(3))
    assert 0 < regs <= 255 and 0 < smem <= 227, out  # what an sm_90 program can have


def test_mla_prefill_smem_bytes_against_the_sm90_compile():
    """`prefill.smem_bytes` against the shared memory of the MLA prefill kernel compiled for sm_90 at Ling's widths
    (the venv's Triton): equal in bf16, an upper bound in float32, for the tiling the kernel picks itself (float32:
    32-key blocks, where the defaults' 295424 bytes exceed the 232448 a program may take) and for 32-key bf16 blocks;
    every one fits."""
    out = run_script("triton_resources", "--mla-prefill", "--length", "1024", "--tunings", "block_k=32")
    rows = re.findall(r"^mla_prefill (\w+) smem (\d+) B estimate (\d+) B .*<- (.*)$", out, re.M)
    assert len(rows) == 4, out
    for dtype, smem, est, _ in rows:
        assert (int(smem) == int(est)) if dtype == "bfloat16" else (int(smem) <= int(est)), out
        assert int(est) <= 227 * 1024, out
    assert [r[3] for r in rows if r[0] == "float32"][0] == "fitting block_k=32", out


def synthetic_results(d: Path) -> None:
    """One small results file per figure, in the formats the benchmarks write."""
    moe_rows = [dict(kind="moe_layer", backend=b, T=t, us=30.0 * t * (5 if b == "reference" else 1),
                     floor_us=25.0 * t) for b in ("pallas", "reference") for t in (1, 2, 4)]
    moe_prof = {"T1": [dict(kernel="experts_fwd_kernel_gate_up", us_per_layer=17.2),
                       dict(kernel="router_fwd_kernel_gemv", us_per_layer=2.6)],
                "T1_own_us_per_layer": 33.7, "T2_span_us_per_layer": 60.0}
    kda_rows = [dict(section="decode", name="byte floor per layer", us=1.07),
                dict(section="decode", name="pallas BV16 warps1", kern_sum_us=5.3),
                dict(section="decode", name="fla fused_recurrent_kda", us_per_layer=5.3)]
    kda_rows += [dict(section="verify", name=f"T{t} default verify+commit", kern_sum_us=4.0 + 2 * t) for t in (2, 6)]
    mla_ops = [dict(op=f"mla_{k}k_t{t}", backend=b, span_us_per_op=10.0 * k * t) for k in (1, 32) for t in (1, 6)
               for b in ("pallas", "reference")]
    decode_rows = [dict(backend=b, tpot_us=us, floor_us=500.0, frac_of_floor=500.0 / us, kernels_per_step=900)
                   for b, us in (("fast", 800.0), ("reference", 2000.0))]
    sweep = [dict(kind="sweep_exp", T=1, us=us, floor_us=12.96, bytes=55_718_560, note=note) for us, note in
             ((40.3, "device 40.3 block_d=2,warps_down=1"), (33.5, "device 33.5 down_t1=slots_last"),
              (45.0, "device 45.0 block_d=16,down_t1=slots,t1_gate_up=dot"))]
    files = {"bench_moe.json": dict(device="H200", router_dtype="bfloat16", rows=moe_rows, profile=moe_prof),
             "bench_moe_fp8_sweep2_h100.json": dict(device="NVIDIA H100 80GB HBM3", commit="abc1234", rows=sweep),
             "kda_bench.json": dict(meta=dict(device="H200"), checks_passed=True, rows=kda_rows),
             "mla_profile.json": dict(device="H200", ops=mla_ops),
             "bench_decode.json": dict(device="H200", args=dict(layers=6), rows=decode_rows)}
    for name, data in files.items():
        (d / name).write_text(json.dumps(data))


def test_plot_results_draws_every_figure(tmp_path):
    synthetic_results(tmp_path)
    out = run_script("plot_results", "--results", str(tmp_path), "--out", str(tmp_path / "png"), timeout=120)
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert pngs == ["decode_slice.png", "kda.png", "mla_decode.png", "moe.png", "moe_fp8_h100.png"], out
    assert all((tmp_path / "png" / p).stat().st_size > 10_000 for p in pngs)


def test_plot_results_skips_a_missing_file(tmp_path):
    synthetic_results(tmp_path)
    (tmp_path / "kda_bench.json").unlink()
    out = run_script("plot_results", "--results", str(tmp_path), timeout=120)
    assert "kda_bench.json: missing, kda.png skipped" in out
    assert not (tmp_path / "kda.png").exists() and (tmp_path / "moe.png").exists()
