"""Plots of the recorded H200 results against their byte floors: one figure per op and one for the engine.

Reads the benchmarks' canonical results files (no GPU) and draws:
  moe.png           bench_moe.json: the T = 1 layer's device time per kernel; the layer vs T against its floor
  kda.png           kda_bench.json: decode device time per layer against the floor and fla; verify + commit vs T
  mla_decode.png    mla_profile.json (profile_ops.py's MLA ops): device µs per attention call vs cache length
  decode_slice.png  bench_decode.json: the slice's TPOT per backend against its floor
  spec.png          bench_spec.json: spec step time vs k, and TPOT vs accept length against plain decode
  prefill.png       bench_prefill.json: the slice's TTFT and useful TFLOP/s per prompt and chunk, its op split
  moe_fp8_h100.png  bench_moe_fp8_sweep2_h100.json: the FP8 MoE layer at T = 1 per down-kernel tuning (an H100)
  bench_sglang.png  every `ling-jax bench` row (bench_<model>_<dtype>.json): TPOT per configuration beside SGLang's
                    published rows, and each configuration's fraction of the byte floor per op family

    python experiments/plot_results.py [--results DIR] [--out DIR]

A missing results file skips its figure with a printed line. The numbers are experiments/RESULTS.md's.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
HBM_BYTES_PER_S = 4.3e12  # as common.HBM_BYTES_PER_S; this script needs no JAX


def plot_moe(data):
    """Left: the T = 1 layer's device time per kernel (profiler, cold chain). Right, when the run swept T: the
    layer's wall time per layer (device-bound from T = 2) and its profiled spans against the floor of the bytes."""
    prof = data.get("profile", {})
    sweep = sorted((r["T"], r["us"], r["floor_us"]) for r in data.get("rows", [])
                   if r.get("kind") == "moe_layer" and r["backend"] == "pallas" and r["T"] > 1)
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4), squeeze=False)
    a = axes[0][0]
    kernels = [k for k in prof.get("T1", []) if k["us_per_layer"] >= 0.5]
    a.barh([k["kernel"][:40] for k in kernels], [k["us_per_layer"] for k in kernels])
    span = prof.get("T1_own_us_per_layer", prof.get("T1_span_us_per_layer"))
    floor = next((r["floor_us"] for r in data.get("rows", []) if r.get("T") == 1), None)
    title = "T = 1" + (f": layer span {span:.1f} µs" if span else "") + (f", floor {floor:.1f} µs" if floor else "")
    a.set(xlabel="device µs per layer of the chain (kernel durations)", title=title)
    a.tick_params(axis="y", labelsize=7)
    a.invert_yaxis()
    if sweep:
        b = axes[0][1]
        b.plot([t for t, _, _ in sweep], [u for _, u, _ in sweep], "o-", label="Pallas, wall per layer")
        spans = sorted((t, prof[f"T{t}_span_us_per_layer"]) for t, _, _ in sweep
                       if f"T{t}_span_us_per_layer" in prof)
        if spans:
            b.plot([t for t, _ in spans], [s for _, s in spans], "D", label="Pallas, profiled span per layer")
        ref = sorted((r["T"], r["us"]) for r in data["rows"] if r.get("kind") == "moe_layer"
                     and r["backend"] == "reference")
        if ref:
            b.plot([t for t, _ in ref], [u for _, u in ref], "s", label="XLA reference")
        b.plot([t for t, _, _ in sweep], [f for _, _, f in sweep], "k--", label="byte floor (4.3 TB/s)")
        b.set(xlabel="tokens per call T", ylabel="µs per MoE layer", yscale="log", title="MoE layer vs T")
        b.legend(fontsize=7)
    fig.suptitle(f"MoE, Ling-3.0-flash shape, router {data.get('router_dtype', 'float32')}, {data['device']}")
    return fig


def plot_kda(data):
    """Left: decode device time per layer (profiler: kernel + gated norm) against the floor and fla (CUDA graph).
    Right: verify + commit device time per layer vs T against twice the best decode."""
    rows = data["rows"]
    floor = next((r["us"] for r in rows if r["name"] == "byte floor per layer"), None)
    decode = {r["name"]: r["kern_sum_us"] for r in rows if r["section"] == "decode" and "kern_sum_us" in r}
    fla = {r["name"]: r["us_per_layer"] for r in rows
           if r["section"] == "decode" and r["name"].startswith("fla") and "us_per_layer" in r}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(decode) + [n[:50] for n in fla]
    a.barh(names, list(decode.values()) + list(fla.values()), color=["C0"] * len(decode) + ["C1"] * len(fla))
    if floor:
        a.axvline(floor, color="k", ls="--", label=f"byte floor {floor:.2f} µs")
        a.legend(fontsize=8)
    a.set(xlabel="µs per layer (Pallas: profiler device time; fla: CUDA graph)", title="KDA decode (T = 1)")
    a.tick_params(axis="y", labelsize=7)
    curves: dict[str, list] = {}
    for r in rows:
        m = re.match(r"T(\d+) (.*verify\+commit)$", r["name"])
        if r["section"] == "verify" and m and "kern_sum_us" in r:
            curves.setdefault(m.group(2), []).append((int(m.group(1)), r["kern_sum_us"]))
    for label, pts in curves.items():
        pts.sort()
        b.plot([t for t, _ in pts], [u for _, u in pts], "o-", label=label)
    if decode:
        best = min(decode.values())
        b.axhline(2 * best, color="r", ls=":", label=f"2 × decode ({2 * best:.1f} µs)")
    b.set(xlabel="verify tokens T", ylabel="device µs per layer", ylim=(0, None), title="KDA verify + commit")
    b.legend(fontsize=8)
    fig.suptitle(f"KDA at H = 32, K = V = 128, batch 1 ({data['meta']['device']})")
    return fig


def plot_mla(data):
    """Device µs per attention call vs cache length L (profile_ops' MLA ops: 8 distinct caches per profiled
    call, cold at 32k), Pallas and the XLA reference, against the byte floor (cache read + fp32 queries)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    span = {(o["op"], o["backend"]): o["span_us_per_op"] for o in data["ops"]}
    ops = [m for o in data["ops"] if (m := re.match(r"mla_(\d+)k_t(\d+)$", o["op"]))]
    lengths = sorted({int(m.group(1)) * 1024 for m in ops})
    for t, marker in zip(sorted({int(m.group(2)) for m in ops}), "osD^"):
        for backend, style in (("pallas", "-"), ("reference", ":")):
            ys = [span.get((f"mla_{L // 1024}k_t{t}", backend)) for L in lengths]
            if any(y is not None for y in ys):
                ax.plot(lengths, ys, marker + style, label=f"{backend}, T = {t}")
        floor = [(L * 576 * 2 + t * 32 * (576 + 512) * 4) / HBM_BYTES_PER_S * 1e6 for L in lengths]
        ax.plot(lengths, floor, "k--", lw=0.8, alpha=0.4 + 0.3 * (t == 1), label=f"byte floor, T = {t}")
    ax.set(xscale="log", yscale="log", xlabel="cache length L", ylabel="device µs per call",
           title=f"MLA absorbed decode, H = 32, R = 512, P = 64 ({data['device']})")
    ax.legend(fontsize=6, ncol=2)
    return fig


def plot_slice(data):
    """TPOT per backend of the engine's decode of a Flash slice against the floor of its step's bytes; the rows of
    bench_decode_before.json (the same run on the previous tree, when recorded) first, labelled "before"."""
    before = RESULTS / "bench_decode_before.json"
    earlier = [dict(r, backend=f"{r['backend']}, before") for r in json.loads(before.read_text())["rows"]] \
        if before.exists() else []
    rows = earlier + data["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["backend"] for r in rows], [r["tpot_us"] for r in rows], label="measured TPOT")
    ax.axhline(rows[0]["floor_us"], color="k", ls="--", label="byte floor at 4.3 TB/s")
    for i, r in enumerate(rows):
        ax.text(i, r["tpot_us"], f"{r['frac_of_floor']:.0%} of floor\n{r['kernels_per_step']} kernels",
                ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="µs per token", title=f"Decode, {data['args']['layers']}-layer Flash slice, {data['device']}")
    ax.set_ylim(0, max(r["tpot_us"] for r in rows) * 1.3)
    ax.legend(loc="upper left")
    return fig


def plot_spec(data):
    """Left: the spec step's time vs k (true continuation) beside plain decode's step. Right: TPOT vs accept length,
    k = 3 and the true-continuation rows, against plain TPOT and the ideal plain / accept length."""
    rows = data["rows"]
    plain = rows[0]["tpot_us"]
    full = sorted((r["k"], r["step_us"], r["tpot_us"], r["accept_length"]) for r in rows
                  if r["kind"] == "spec" and r["planned_accept"] == r["k"] + 1)
    k3 = sorted((r["accept_length"], r["tpot_us"]) for r in rows if r["kind"] == "spec" and r["k"] == 3)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.plot([k for k, *_ in full], [s for _, s, *_ in full], "o-", label="spec step (k drafts, all accepted)")
    a.axhline(plain, color="k", ls="--", label="plain decode step")
    a.set(xlabel="k (drafts per step)", ylabel="µs per step", title="Spec step vs k")
    a.set_ylim(0, None)
    a.legend(fontsize=8)
    b.plot([x for x, _ in k3], [t for _, t in k3], "o-", label="k = 3, planned accept lengths")
    b.plot([acc for *_, acc in full], [t for _, _, t, _ in full], "s:", label="k + 1 accepted (k = 1..8)")
    xs = [1 + i * 0.1 for i in range(81)]
    b.plot(xs, [plain / x for x in xs], color="0.6", lw=1, label="plain TPOT / accept length")
    b.axhline(plain, color="k", ls="--", label="plain TPOT")
    b.set(xlabel="accept length (tokens per verify step)", ylabel="TPOT µs",
          title=f"{data['args']['layers']}-layer Flash slice, {data['device']}")
    b.set_ylim(0, None)
    b.legend(fontsize=8)
    return fig


def plot_prefill(data):
    """Left: TTFT per (prompt, chunk) with the useful TFLOP/s on each bar. Right: the profiled prefill's device
    time by op class."""
    rows = [r for r in data["rows"] if "ttft_ms" in r]
    prof = data.get("profile") or {}
    fig, axes = plt.subplots(1, 2 if prof else 1, figsize=(12 if prof else 7, 3.8), squeeze=False)
    a = axes[0][0]
    labels = [f"{r['prompt']}\nchunk {r['chunk']}" for r in rows]
    a.bar(labels, [r["ttft_ms"] for r in rows])
    for i, r in enumerate(rows):
        a.text(i, r["ttft_ms"], f"{r['tflops_per_s']:.0f} TFLOP/s", ha="center", va="bottom", fontsize=8)
    a.set(ylabel="TTFT ms", title=f"Prefill, {data['args']['layers']}-layer Flash slice, {data['device']}")
    a.set_ylim(0, max(r["ttft_ms"] for r in rows) * 1.2)
    if prof:
        b = axes[0][1]
        classes = sorted(prof["classes_ms"].items(), key=lambda kv: -kv[1])
        b.barh([c for c, _ in classes], [ms for _, ms in classes])
        b.set(xlabel="device ms", title=f"prompt {prof['prompt']}: {prof['kernels_ms']:.1f} ms of kernels by op")
    return fig


# SGLang's published rows, as ling_jax.bench.SGLANG_ROWS (4 Blackwell GPUs, TP4, bf16; every row speculates).
SGLANG = (("SGLang baseline (NEXTN)", 3.33), ("SGLang, NEXTN tuned", 1.53), ("SGLang, DSpark draft", 0.78))
OP_ORDER = ("projections", "moe", "lm_head", "kda", "mla")


def bench_rows(results: Path) -> list[dict]:
    """The `ling-jax bench` rows among the results files (they carry SGLang's TPOT fields)."""
    rows = []
    for path in sorted(results.glob("bench_*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "tpot_ms_median" in data:
            rows.append(data)
    return rows


def _label(r: dict) -> str:
    variant = f" ({r['variant']})" if r.get("variant") else ""  # a before row kept beside its after
    return f"{r['model']} {r['quantization'] or r['dtype']}{variant}\n{r['device']} x {r.get('devices', 1)}"


def plot_bench(rows: list[dict]):
    """Left: TPOT per configuration (median; the byte floor as a tick) beside SGLang's rows. Right: each configuration's
    fraction of the floor per op family (floor µs / measured µs, from --profile)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.5))
    labels = [_label(r) for r in rows] + [name for name, _ in SGLANG]
    tpots = [r["tpot_ms_median"] for r in rows] + [ms for _, ms in SGLANG]
    colors = ["C0"] * len(rows) + ["C7"] * len(SGLANG)
    a.barh(labels, tpots, color=colors)
    for i, r in enumerate(rows):
        a.plot([r["floor_ms"]] * 2, [i - 0.4, i + 0.4], "k-", lw=2)
        a.text(r["tpot_ms_median"], i, f" {r['tpot_ms_median']:.2f} ms ({r['frac_of_floor']:.0%} of floor)",
               va="center", fontsize=8)
    for j, (_, ms) in enumerate(SGLANG):
        a.text(ms, len(rows) + j, f" {ms:.2f} ms", va="center", fontsize=8)
    a.set(xlabel="TPOT ms (8192 in, 1024 out, batch 1; black tick: byte floor at 4.3 TB/s)",
          title="ling-jax bench beside SGLang (4 Blackwell GPUs, TP4, bf16, speculative)")
    a.tick_params(axis="y", labelsize=7)
    a.invert_yaxis()
    profiled = [r for r in rows if "breakdown" in r]
    width = 0.8 / max(len(profiled), 1)
    for k, r in enumerate(profiled):
        ops = r["breakdown"]["ops"]
        fracs = [ops[o]["floor_us"] / ops[o]["us"] if o in ops and ops[o]["us"] else 0 for o in OP_ORDER]
        b.bar([i + k * width for i in range(len(OP_ORDER))], fracs, width, label=_label(r).replace("\n", ", "))
    b.set_xticks([i + width * (len(profiled) - 1) / 2 for i in range(len(OP_ORDER))], OP_ORDER)
    b.axhline(1.0, color="k", ls="--", lw=1)
    b.set(ylabel="fraction of the byte floor", ylim=(0, 1.1), title="decode step by op family (exclusive device time)")
    if profiled:
        b.legend(fontsize=7)
    return fig


def plot_moe_fp8_sweep(data):
    """The FP8 MoE layer at T = 1 per experts tuning of a bench_moe.py sweep (device span per layer), against the
    floor at 4.3 TB/s and at the run's own card's copy rate when it is an H100 (~3.0 TB/s)."""
    rows = [r for r in data["rows"] if r["kind"] == "sweep_exp"]
    labels = [_down_label(r["note"]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows)), 4.5))
    bars = ax.bar(range(len(rows)), [r["us"] for r in rows], color="#4c72b0")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.axhline(rows[0]["floor_us"], color="k", ls="--", lw=1, label=f"floor at 4.3 TB/s ({rows[0]['floor_us']} µs)")
    if "H100" in data.get("device", ""):
        h100 = rows[0]["bytes"] / 3.0e12 * 1e6
        ax.axhline(h100, color="gray", ls=":", lw=1, label=f"at the H100's ~3.0 TB/s copy rate ({h100:.1f} µs)")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel("down kernel: form, features per program x warps")
    ax.set_ylabel("µs per layer (device span)")
    ax.set_title(f"FP8 MoE layer at T = 1 by down kernel, {data.get('device', '')}, commit {data.get('commit')}")
    ax.legend(fontsize=8)
    return fig


def _down_label(note: str) -> str:
    """'slots_last\n64 x 4w' from a sweep row's note (`common.short`: fields at ExpertsTuning's defaults are left
    out, block_d 64 and warps_down 4 among them)."""
    field = lambda name, default: (re.search(rf"\b{name}=(\w+)", note) or [None, default])[1]  # noqa: E731
    gate_up = "\ndot gate/up" if field("t1_gate_up", "fma") == "dot" else ""
    return f"{field('down_t1', 'fused')}\n{field('block_d', '64')} x {field('warps_down', '4')}w{gate_up}"


FIGURES = (("bench_moe.json", plot_moe, "moe.png"), ("kda_bench.json", plot_kda, "kda.png"),
           ("mla_profile.json", plot_mla, "mla_decode.png"), ("bench_decode.json", plot_slice, "decode_slice.png"),
           ("bench_spec.json", plot_spec, "spec.png"), ("bench_prefill.json", plot_prefill, "prefill.png"),
           ("bench_moe_fp8_sweep2_h100.json", plot_moe_fp8_sweep, "moe_fp8_h100.png"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the results JSON files")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: --results)")
    args = ap.parse_args(argv)
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    for name, plot, png in FIGURES:
        path = args.results / name
        if not path.exists():
            print(f"{name}: missing, {png} skipped")
            continue
        fig = plot(json.loads(path.read_text()))
        _save(fig, out / png, name)
    rows = bench_rows(args.results)
    if rows:
        _save(plot_bench(rows), out / "bench_sglang.png", f"{len(rows)} ling-jax bench rows")
    else:
        print("no ling-jax bench rows: bench_sglang.png skipped")


def _save(fig, path: Path, source: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"{source} -> {path}")


if __name__ == "__main__":
    main()
