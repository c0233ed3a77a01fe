"""What every benchmark script shares: the bandwidth ceiling, where results go, and the markdown table."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import jax

# Measured H200 device-to-device copy rate, bytes read + written (device tool KINDS.md): the floors' denominator.
HBM_BYTES_PER_S = 4.3e12


def run_header() -> dict:
    """Print the device line every benchmark opens with; return the fields every results file records."""
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} · jax {jax.__version__} · backend {jax.default_backend()}", flush=True)
    return {"device": dev.device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat()}


def write_results(name: str, results: dict, *, to_repo: bool = True) -> None:
    """experiments/results/<name> (not for CPU smoke runs: to_repo=False), and $OUT/<name> when OUT is set."""
    dirs = ([Path(__file__).parent / "results"] if to_repo else []) + (
        [Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(results, indent=1, default=str))


def print_table(rows: list[dict], columns: list[str]) -> None:
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
