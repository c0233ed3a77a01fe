"""Plots of the recorded H200 results against their byte floors (reads experiments/results/*.json, no GPU).

    python experiments/plot_results.py

Writes experiments/results/{moe_vs_T,kda_decode_verify,decode_slice}.png. Every number plotted is a row of
experiments/RESULTS.md; this script only draws them.
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


def plot_moe(data) -> Path:
    layer = [r for r in data["rows"] if r["kind"] == "moe_layer"]
    pallas = sorted((r["T"], r["us"], r["floor_us"]) for r in layer if r["backend"] == "pallas")
    xla = sorted((r["T"], r["us"]) for r in layer if r["backend"] == "reference")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([t for t, _, _ in pallas], [u for _, u, _ in pallas], "o-", label="Pallas (router + experts + shared)")
    ax.plot([t for t, _ in xla], [u for _, u in xla], "s", label="XLA reference")
    ax.plot([t for t, _, _ in pallas], [f for _, _, f in pallas], "k--", label="byte floor at 4.3 TB/s")
    ax.set(xlabel="tokens per call T (distinct experts grow with T)", ylabel="µs per MoE layer", yscale="log",
           title=f"MoE layer, Ling-3.0-flash shape, {data['device']}")
    ax.legend()
    return _save(fig, "moe_vs_T.png")


def plot_kda(data) -> Path:
    rows = [r for run in data["runs"] for r in run["rows"] if r["section"] in ("decode", "verify")]
    floor = next(r["us"] for r in rows if r["name"] == "byte floor per layer")
    decode = {r["name"]: r["us_per_layer"] for r in rows if r["section"] == "decode" and "us_per_layer" in r
              and r["name"] != "best pallas"}
    verify = {}
    for r in rows:
        m = re.match(r"T(\d+) design A \(states\) verify\+commit", r["name"])
        if r["section"] == "verify" and m:
            verify[int(m.group(1))] = r["us_per_layer"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(decode)
    a.barh(names, [decode[n] for n in names])
    a.axvline(floor, color="k", ls="--", label=f"byte floor {floor:.2f} µs")
    a.set(xlabel="µs per layer (decode, T = 1)", title="KDA decode configurations")
    a.legend()
    ts = sorted(verify)
    b.plot(ts, [verify[t] for t in ts], "o-", label="verify + commit (design A)")
    b.axhline(2 * min(v for k, v in decode.items() if k.startswith("pallas")), color="r", ls=":",
              label="2 × best decode (target at T = 6)")
    b.set(xlabel="verify tokens T", ylabel="µs per layer", ylim=(0, max(verify.values()) * 1.2),
          title="KDA verify (T 2-5: BV 32, 4 warps; T 6: BV 16, 2 warps)")
    b.legend()
    fig.suptitle(f"KDA at H = 32, K = V = 128, batch 1 ({data['runs'][0]['meta']['device']})")
    return _save(fig, "kda_decode_verify.png")


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
    for name, plot in (("bench_moe.json", plot_moe), ("kda_bench.json", plot_kda),
                       ("bench_decode.json", plot_slice)):
        data = _load(name)
        print(f"{name}: " + (str(plot(data)) if data else "missing, skipped"))


if __name__ == "__main__":
    main()
