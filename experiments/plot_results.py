"""Plots of the recorded H200 results against their byte floors (reads experiments/results/*.json, no GPU).

    python experiments/plot_results.py

Writes experiments/results/{moe_vs_T,moe_verify_T,moe_t1_down,moe_t1_s11,kda_decode_verify,mla_decode,
decode_slice}.png.
Every number plotted is a row of experiments/RESULTS.md; this script only draws them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def plot_moe(data, t1, v1) -> Path:
    """Left: the MoE layer's device time per kernel at T = 1 (profiler, cold chain; `t1`'s profile if given, else
    `data`'s) against the floor. Right: the T sweep (wall per layer in
    the chain, device-bound from T = 2) against the floor of the experts read, with the first kernels' v1 sweep."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    src = t1 if t1 and "T1" in t1.get("profile", {}) else data
    prof = [k for k in src["profile"]["T1"] if k["us_per_layer"] >= 0.5]
    floor = next(r["floor_us"] for r in src["rows"] if r["T"] == 1)
    a.barh([k["kernel"] for k in prof], [k["us_per_layer"] for k in prof])
    total = sum(k["us_per_layer"] for k in src["profile"]["T1"])
    a.set(xlabel="device µs per layer (profiler)",
          title=f"T = 1: {total:.1f} µs per layer vs floor {floor:.1f} µs (defaults, cold)")
    a.tick_params(axis="y", labelsize=7)
    a.invert_yaxis()
    runs = ((data["rows"], "o-", "Pallas"), ((v1 or {}).get("rows", []), "o:", "first kernels (v1)"))
    for rows, style, label in runs:
        layer = [r for r in rows if r["kind"] == "moe_layer"]
        pallas = sorted((r["T"], r["us"], r["floor_us"]) for r in layer if r["backend"] == "pallas" and r["T"] > 1)
        xla = sorted((r["T"], r["us"]) for r in layer if r["backend"] == "reference")
        if not pallas:
            continue
        b.plot([t for t, _, _ in pallas], [u for _, u, _ in pallas], style, label=f"{label}, T >= 2 (wall)")
        b.plot([t for t, _ in xla], [u for _, u in xla], "s" if style == "o-" else "x",
               label=f"XLA reference{' (v1)' if style != 'o-' else ''}")
        if style == "o-":
            b.plot([t for t, _, _ in pallas], [f for _, _, f in pallas], "k--", label="byte floor of experts read")
    b.set(xlabel="tokens per call T", ylabel="µs per MoE layer", yscale="log", title="MoE layer vs T")
    b.legend(fontsize=7)
    fig.suptitle(f"MoE, Ling-3.0-flash shape, {data['device']}")
    return _save(fig, "moe_vs_T.png")


def plot_moe_verify(dot, fma) -> Path:
    """MoE layer device time (profiler timeline span per layer, cold chain) at T = 1, 2, 4, 8 with the T > 1 gate/up
    as tensor-core dots over 16 padded rows or as per-token FMAs (session 9, S9 10), against the byte floor of the
    experts read."""
    fig, a = plt.subplots(figsize=(6, 4))
    floors = {r["T"]: r["floor_us"] for r in dot["rows"] if r["backend"] == "pallas"}
    for src, style, label in ((dot, "o-", "gate/up: tensor-core dots (T >= 3 default)"),
                              (fma, "s-", "gate/up: per-token FMAs (T = 2 default)")):
        spans = sorted((int(k[1:].split("_")[0]), v) for k, v in src["profile"].items() if k.endswith("_span_us_per_layer"))
        a.plot([t for t, _ in spans], [v for _, v in spans], style, label=label)
    ts = sorted(t for t in floors if t in (1, 2, 4, 8))
    a.plot(ts, [floors[t] for t in ts], "k--", label="byte floor of the experts read (4.3 TB/s)")
    a.set(xlabel="tokens per call T", ylabel="µs per MoE layer (timeline span)", xticks=[1, 2, 4, 8],
          title=f"MoE layer at small T, {dot['device']} (S9 10)")
    a.legend(fontsize=7)
    return _save(fig, "moe_verify_T.png")


def plot_moe_t1_down(sets) -> Path:
    """T = 1 MoE layer span (profiler, cold dependent chain) per down-kernel variant of session 10's probe (S10 1-5:
    sets s10c1..s10c5, `probe_moe_down_rows_fused.py`), each call's stripe kernel + combine (then production) as
    its baseline; rows that failed their check (error > 2e-2) are left out."""
    fig, a = plt.subplots(figsize=(10, 8))
    labels, spans, colors = [], [], []
    for name, data in sets:
        for r in data["rows"]:
            if r["err"] is None or r["err"] > 2e-2:
                continue
            base = r["label"].startswith("dep: production")
            short = r["label"].replace("dep: ", "").replace("production layer", "stripes + combine (S9 code)")
            for long, brief in (("rows fused ", "rows "), (", 8 slots/step", ""), ("early_launch True", "PDL trigger"),
                                ("shared_first True", "shared first"), (" slots/step", " slots")):
                short = short.replace(long, brief)
            labels.append(f"S10 {name[-1]}: {short}")
            spans.append(r["span_us"])
            colors.append("grey" if base else "C0")
    y = range(len(labels))
    a.barh(list(y), spans, color=colors)
    a.axvline(34.0, color="k", ls="--", lw=1, label="issue target 34 µs")
    a.set(yticks=list(y), xlabel="µs per MoE layer (timeline span)", xlim=(30, max(spans) + 1),
          title="T = 1 down-kernel variants, S10 1-5 (grey: the call's session-9 layer)")
    a.set_yticklabels(labels, fontsize=6)
    a.invert_yaxis()
    a.legend(fontsize=7)
    return _save(fig, "moe_t1_down.png")


def plot_moe_t1_s11(probes, benches) -> Path:
    """Session 11. Left: the T = 1 layer's span per variant of the S11 1-4 probes (loads issued ahead of their
    math, PDL trigger placements, the GEMV's weights before its wait), production rows grey. Right: the production
    bench's direct chain per run (S11 4, 5, 7): span / NL, the span from the first layer / NL ("layers"; S11 4-5
    ran before it was recorded: there the median span less the first traced call's start, hollow) and the
    steady-state period."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 7), gridspec_kw=dict(width_ratios=[3, 2]))
    labels, spans, colors = [], [], []
    for call, data in probes:
        for r in data["rows"]:
            prod = r["label"].startswith("dep: production")
            labels.append(f"S11 {call}: " + r["label"].replace("dep: ", "").replace("fence True", "barrier"))
            spans.append(r["span_us"])
            colors.append("grey" if prod else "C0")
    y = list(range(len(labels)))
    a.barh(y, spans, color=colors)
    a.axvline(34.0, color="k", ls="--", lw=1, label="issue target 34 µs")
    a.set(yticks=y, xlabel="µs per MoE layer (span / NL, NL = 8; the probes' chains start at their first layer)",
          xlim=(30, max(spans) + 0.5), title="T = 1 probe variants, S11 1-4 (grey: production)")
    a.set_yticklabels(labels, fontsize=6)
    a.invert_yaxis()
    a.legend(fontsize=7)
    for i, (run, data) in enumerate(benches):
        prof, nl = data["profile"], data["layers"]
        span, period = prof["T1_span_us_per_layer"], prof["T1_period_us_per_layer"]
        layers = prof.get("T1_layers_us_per_layer")
        exact = layers is not None
        if not exact:
            start = next(ts for name, ts, _ in prof["T1_timeline_first_call"]
                         if name.startswith("router_fwd_kernel_gemv"))
            layers = span - start / nl
        b.plot([i, i], [span, period], "k-", lw=0.5)
        b.plot(i, span, "o", color="C1", label="span / NL" if i == 0 else None)
        b.plot(i, layers, "D", color="C2", mfc="C2" if exact else "none",
               label="from the first layer (hollow: estimated)" if i == 0 else None)
        b.plot(i, period, "s", color="C0", label="steady-state period" if i == 0 else None)
    b.axhline(34.0, color="k", ls="--", lw=1)
    b.set(xticks=range(len(benches)), ylabel="µs per MoE layer", title="production bench, --chain direct")
    b.set_xticklabels([run for run, _ in benches], fontsize=7, rotation=30)
    b.legend(fontsize=7)
    fig.suptitle(f"MoE layer at T = 1, {probes[0][1]['device']}")
    return _save(fig, "moe_t1_s11.png")


def plot_moe_t1_s12(probes, benches) -> Path:
    """Session 12: the T = 1 layer with fp32 and bf16 routers. Left: the S12 1-2 probe rows' span (the probes'
    direct chain), fp32 grey, bf16 with one row per GEMV program light, with DECODE_TUNING_BF16's two rows dark.
    Right: the production bench per run, each measure as a point: in the direct chain the span / NL, the span from
    the first layer / NL and the steady-state period; in the "norm" chain (an XLA fusion before every layer, the
    model's case) each layer's own span, GEMV start to down end (median)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw=dict(width_ratios=[3, 2]))
    labels, spans, colors = [], [], []
    for call, data in probes:
        for r in data["rows"]:
            label = r["label"].replace("dep: ", "")
            fp32, two_rows = "fp32" in label, "2 rows" in label
            labels.append(f"S12 {call}: {label}")
            spans.append(r["span_us"])
            colors.append("grey" if fp32 else ("C0" if two_rows else "lightsteelblue"))
    y = list(range(len(labels)))
    a.barh(y, spans, color=colors)
    a.axvline(34.0, color="k", ls="--", lw=1, label="issue target 34 µs")
    a.set(yticks=y, xlabel="µs per MoE layer (span / NL, NL = 8)", xlim=(32, max(spans) + 0.5),
          title="T = 1 probe rows, S12 1-2 (grey: fp32 router; dark: bf16, 2 rows per GEMV program)")
    a.set_yticklabels(labels, fontsize=7)
    a.invert_yaxis()
    a.legend(fontsize=7)
    marks = dict(span=("o", "C1", "span / NL (direct)"), layers=("D", "C2", "from the first layer (direct)"),
                 period=("s", "C0", "steady-state period (direct)"), own=("*", "C3", "own span (norm chain)"))
    seen = set()
    for i, (run, data) in enumerate(benches):
        prof = data["profile"]
        keys = ("own",) if data.get("chain") == "norm" or "norm" in run else ("span", "layers", "period")
        for k in keys:
            marker, color, label = marks[k]
            hollow = data.get("router_dtype", "float32") == "float32"
            b.plot(i, prof[f"T1_{k}_us_per_layer"], marker, color=color, mfc="none" if hollow else color, ms=8,
                   label=None if k in seen else label)
            seen.add(k)
    b.axhline(34.0, color="k", ls="--", lw=1)
    b.set(xticks=range(len(benches)), ylabel="µs per MoE layer",
          title="production bench (hollow: fp32 router, filled: bf16)")
    b.set_xticklabels([run for run, _ in benches], fontsize=7, rotation=30)
    b.legend(fontsize=7)
    fig.suptitle(f"MoE layer at T = 1 with the router in bf16 as stored, {probes[0][1]['device']}")
    return _save(fig, "moe_t1_s12.png")


def plot_kda(data) -> Path:
    """Device time per layer (profiler: kernel + gated norm, commit copies for verify) against the floor and fla."""
    rows = data["rows"]
    floor = next(r["us"] for r in rows if r["name"] == "byte floor per layer")
    decode = {r["name"].replace("pallas ", "ours "): r["kern_sum_us"] for r in rows
              if r["section"] == "decode" and "kern_sum_us" in r}
    fla = {r["name"].split(";")[1].strip(" )") if ";" in r["name"] else r["name"]: r["us_per_layer"]
           for r in rows if r["section"] == "decode" and r["name"].startswith("fla")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(decode) + [f"fla ({k})" for k in fla]
    a.barh(names, list(decode.values()) + list(fla.values()), color=["C0"] * len(decode) + ["C1"] * len(fla))
    a.axvline(floor, color="k", ls="--", label=f"byte floor {floor:.2f} µs")
    a.set(xlabel="µs per layer (ours: profiler device time, conv + norm incl.; fla: CUDA graph)",
          title="KDA decode (T = 1)")
    a.legend(fontsize=8)
    for label, pat in (("A, vec prologue", r"T(\d+) A vec BV16 w2 verify\+commit"),
                       ("A, default prologue", r"T(\d+) A default verify\+commit")):
        pts = sorted((int(m.group(1)), r["kern_sum_us"]) for r in rows
                     if r["section"] == "verify" and (m := re.match(pat, r["name"])))
        b.plot([t for t, _ in pts], [u for _, u in pts], "o-", label=f"verify + commit, design {label}")
    best = min(decode.values())
    b.axhline(2 * best, color="r", ls=":", label=f"2 × decode ({2 * best:.1f} µs): the T = 6 target")
    b.set(xlabel="verify tokens T", ylabel="device µs per layer", ylim=(0, None), title="KDA verify")
    b.legend(fontsize=8)
    fig.suptitle(f"KDA at H = 32, K = V = 128, batch 1 ({data['meta']['device']})")
    return _save(fig, "kda_decode_verify.png")


def plot_mla(data, before) -> Path:
    """Device µs per attention call vs L (8 distinct caches per profiled call: cold at 32k) against the floor:
    `data` the current kernel and the XLA reference (S7 9), `before` the kernel as session 2 tiled it (call 4)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    now = {(o["op"], o["backend"]): o["span_us_per_op"] for o in data["ops"]}
    old = {(o["op"], o["backend"]): o["span_us_per_op"] for o in (before or {}).get("ops", [])}
    lengths = (1024, 8192, 32768)
    for t, marker in ((1, "o"), (6, "s")):
        for label, ops, backend, style in (("pallas", now, "pallas", "-"), ("pallas, session 2", old, "pallas", "--"),
                                           ("reference (XLA)", now, "reference", ":")):
            ys = [ops.get((f"mla_{L // 1024}k_t{t}", backend)) for L in lengths]
            if any(y is not None for y in ys):
                ax.plot(lengths, ys, marker + style, label=f"{label}, T = {t}", alpha=0.5 if ops is old else 1)
        floor = [(L * 576 * 2 + t * 32 * (576 + 512) * 4) / 4.3e12 * 1e6 for L in lengths]
        ax.plot(lengths, floor, "k" + ("--" if t == 1 else "-."), lw=0.8, label=f"byte floor, T = {t}")
    ax.set(xscale="log", yscale="log", xlabel="cache length L", ylabel="device µs per call",
           title=f"MLA absorbed decode, H = 32, R = 512, P = 64 ({data['device']})")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, "mla_decode.png")


def plot_slice(data) -> Path:
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["backend"] for r in rows], [r["tpot_us"] for r in rows], label="measured TPOT")
    ax.axhline(rows[0]["floor_us"], color="k", ls="--", label="byte floor at 4.3 TB/s")
    for i, r in enumerate(rows):
        ax.text(i, r["tpot_us"], f"{r['frac_of_floor']:.0%} of floor\n{r['kernels_per_step']} kernels",
                ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="µs per token", title=f"Decode, {data['args']['layers']}-layer Flash slice, {data['device']}")
    ax.set_ylim(0, max(r["tpot_us"] for r in rows) * 1.3)
    ax.legend(loc="upper left")
    return _save(fig, "decode_slice.png")


def _save(fig, name: str) -> Path:
    fig.tight_layout()
    path = RESULTS / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    # MoE: session 4's final run (S4 9: bench_moe.py --quick, its own T = 1 profile), the first kernels' sweep beside
    jobs = (("bench_moe_s4c9.json", lambda d: plot_moe(d, None, _load("bench_moe_v1.json"))),
            ("bench_moe_s9c10_dot.json", lambda d: plot_moe_verify(d, _load("bench_moe_s9c10_fma256.json"))),
            ("probe_moe_down_rows_fused_s10c1.json",
             lambda d: plot_moe_t1_down([(f"s10c{c}", _load(f"probe_moe_down_rows_fused_s10c{c}.json"))
                                         for c in range(1, 6)])),
            ("probe_gemv_prewait_s11c3_b.json",
             lambda d: plot_moe_t1_s11(
                 [("1", _load("probe_moe_down_inflight_s11c1.json")),
                  ("2", _load("probe_moe_down_inflight_s11c2.json")),
                  ("3", _load("probe_gemv_prewait_s11c3_a.json")), ("4", d)],
                 [(f"S11 {c} #{i}, NL {nl}", _load(f"bench_moe_s11c{c}_direct_nl{nl}_{i}.json"))
                  for c in (4, 5, 7) for nl, i in ((8, 1), (8, 2), (16, 3))])),
            ("probe_router_bf16_s12c2.json",
             lambda d: plot_moe_t1_s12(
                 [("1", _load("probe_router_bf16_s12c1.json")), ("2", d)],
                 [(label, _load(f"bench_moe_{name}.json")) for label, name in (
                     ("S12 1 fp32", "s12c1_fp32"), ("S12 1 bf16 1 row", "s12c1_bf16"),
                     ("S12 2 fp32", "s12c2_fp32"), ("S12 2 bf16", "s12c2_bf16_be2_a"),
                     ("S12 2 bf16", "s12c2_bf16_be2_b"), ("S12 3 bf16", "s12c3_bf16_nl8_1"),
                     ("S12 3 bf16", "s12c3_bf16_nl8_2"), ("S12 3 bf16 NL 16", "s12c3_bf16_nl16_3"),
                     ("S12 4 bf16", "s12c4_direct_bfloat16_4"), ("S12 4 norm fp32", "s12c4_norm_float32_2"),
                     ("S12 4 norm bf16", "s12c4_norm_bfloat16_1"), ("S12 4 norm bf16", "s12c4_norm_bfloat16_3"))])),
            ("kda_decode_verify.json", plot_kda),
            ("mla_profile_s7c9.json", lambda d: plot_mla(d, _load("mla_profile.json"))),
            ("bench_decode.json", plot_slice))
    for name, plot in jobs:
        data = _load(name)
        print(f"{name}: " + (str(plot(data)) if data else "missing, skipped"))


if __name__ == "__main__":
    main()
