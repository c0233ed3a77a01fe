"""What every benchmark script shares: the bandwidth ceiling, the error measure, tuning strings, timing helpers,
where results go, and the markdown table."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

# Measured H200 device-to-device copy rate, bytes read + written (experiments/RESULTS.md): the floors' denominator.
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


def slope_per_call(make_run, n_per_rep: int, reps=(1, 3), iters: int = 10) -> tuple[float, float]:
    """µs per call from the slope between executables of n_per_rep·r calls (r in reps), which cancels what an
    executable costs once; and the interquartile spread per call of the larger one.

    make_run(r) returns a zero-argument callable that runs the r-rep executable (compiled on its first call).
    """
    totals = {}
    for r in reps:
        run = make_run(r)
        jax.block_until_ready(run())
        jax.block_until_ready(run())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            ts.append(time.perf_counter() - t0)
        totals[r] = (statistics.median(ts), np.percentile(ts, 75) - np.percentile(ts, 25))
    (r0, (t0, _)), (r1, (t1, s1)) = sorted(totals.items())
    return (t1 - t0) / ((r1 - r0) * n_per_rep) * 1e6, s1 / (r1 * n_per_rep) * 1e6


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (inf when a has a non-finite entry): the benches' measure, the one the tests'
    `tests/numerics.py` also takes (which asserts finiteness instead of returning inf)."""
    a = np.asarray(np.asarray(a, np.float32), np.float64)
    b = np.asarray(np.asarray(b, np.float32), np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def parse_tuning(base, text: str):
    """`block_i=32,num_warps=2` -> `base` (a frozen tuning dataclass) with those fields replaced. Values are ints,
    true/false, none, or else strings; `default` or an empty string leaves base as it is."""
    kw = {}
    for item in filter(None, text.strip().split(",")):
        if item.strip() == "default":
            continue
        k, v = (s.strip() for s in item.split("="))
        kw[k] = {"true": True, "false": False, "none": None}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    return dataclasses.replace(base, **kw)


def parse_tunings(base, spec: str) -> list:
    """`a=1,b=2;default;c=3`: one tuning per `;`-separated item (see parse_tuning)."""
    return [parse_tuning(base, item) for item in spec.split(";")]


def short(tuning) -> str:
    """A tuning as its non-default fields only, e.g. `block_l=32,num_warps=4` (`default` when none differs)."""
    default = type(tuning)()
    diff = [f"{f.name}={getattr(tuning, f.name)}" for f in dataclasses.fields(tuning)
            if getattr(tuning, f.name) != getattr(default, f.name)]
    return ",".join(diff) or "default"


def median_time(fn, *args, n_rep: int = 30, n_warm: int = 3):
    """(median wall seconds of fn(*args) after n_warm untimed calls, the last output), each call blocked on."""
    out = None
    for _ in range(n_warm):
        out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n_rep):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def finish(results: dict, t_start: float) -> int:
    """The closing lines of a checked benchmark: its wall time, the failed checks; the exit code (1 on a failure)."""
    print(f"total bench time {time.time() - t_start:.0f}s")
    if results["failed"]:
        print(f"{len(results['failed'])} failed: " + "; ".join(results["failed"]))
        return 1
    return 0
