"""Device timelines from the JAX profiler: the GPU kernels of a traced run and the per-call measures the
benchmarks report (spans, steady-state periods, per-layer spans, exclusive time per kernel family).

With programmatic dependent launch kernels overlap, so a layer's device time is a timeline span, not a kernel
sum; these functions turn a Perfetto trace into those spans. On a machine without GPU events (the CPU) a trace
holds no GPU stream and every measure is empty or NaN.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax


def gpu_events(trace_dir, device=None):
    """(name, ts µs, dur µs) of every event on a GPU stream in the Perfetto trace, in time order; `device`: only
    GPU number `device`'s (a sharded step runs on every GPU at once, so their merged timelines would count each kernel
    once per device)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    want = re.compile(r"/device:GPU" if device is None else rf"/device:GPU:{int(device)}\b")
    gpu_pids = {p for p, n in procs.items() if want.search(n)}
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    return sorted(out, key=lambda e: e[1])


def trace_events(run, n, *, device=None, pause_s=0.0):
    """GPU events (as `gpu_events`, `device` likewise) of n traced calls of the zero-argument `run`, each blocked
    on, with `pause_s` of host sleep after each so that `split_calls` can tell the calls apart. A `run` that
    threads donated state keeps it in its closure."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(n):
                jax.block_until_ready(run())
                time.sleep(pause_s)
        return gpu_events(d, device)


def trace_kernels(run, n):
    """`trace_events` of n calls of `run` after two untraced warm-up calls."""
    jax.block_until_ready(run())
    jax.block_until_ready(run())
    return trace_events(run, n)


def split_calls(events, gap_us=20.0):
    """The traced kernels grouped by call: calls are separated by host syncs, so the stream is split at gaps
    > gap_us; only the calls with the most common kernel count are kept (a call cut by the trace is dropped).
    No events (no GPU, or CUPTI unavailable): no calls."""
    if not events:
        return []
    calls, cur = [], [events[0]]
    for prev, e in zip(events, events[1:]):
        if e[1] - (prev[1] + prev[2]) < gap_us:
            cur.append(e)
        else:
            calls.append(cur)
            cur = [e]
    calls.append(cur)
    n_k = collections.Counter(len(c) for c in calls).most_common(1)[0][0]
    return [c for c in calls if len(c) == n_k]


def call_span_us(calls, first=None):
    """Median timeline span of the calls: first kernel start to last kernel end (gaps in, overlaps once); `first`:
    start at the first event whose name contains it instead (e.g. a chain's first layer, leaving out a copy of the
    chain's input and the gap before the first layer); a call without such an event is skipped. NaN when no call
    counts."""
    spans = []
    for c in calls:
        starts = [ts for name, ts, _ in c if first is None or first in name]
        if starts:
            spans.append(max(e[1] + e[2] for e in c) - starts[0])
    return statistics.median(spans) if spans else float("nan")


def call_period_us(calls, marker, n_layers):
    """Median over the calls of a chain's steady-state period per layer: the end of the last launch whose name
    contains `marker` minus the end of the first, / (n_layers - 1), where the marker names a kernel launched exactly
    once per layer (a call with another count is skipped, so a marker that also matches a second kernel gives NaN,
    not half the period). It leaves out the chain's start and its whole first layer (there, the first layer's first
    kernel is not admitted early by a predecessor as the others are), so it does not depend on the chain's length;
    NaN when no call qualifies or n_layers < 2."""
    periods = []
    for c in calls:
        ends = sorted(ts + dur for name, ts, dur in c if marker in name)
        if n_layers >= 2 and len(ends) == n_layers:
            periods.append((ends[-1] - ends[0]) / (n_layers - 1))
    return statistics.median(periods) if periods else float("nan")


def call_layer_span_us(calls, first, last, n_layers):
    """Median over the calls and layers of one layer's own span: the end of its `last` launch minus the start of
    its `first` launch (the l-th of each in the call), where both markers name kernels launched exactly once per
    layer (a call with other counts is skipped; NaN when none qualifies). It counts the layer alone, not what runs
    between layers; with a first kernel admitted early by PDL it also counts that kernel's wait."""
    spans = []
    for c in calls:
        starts = sorted(ts for name, ts, dur in c if first in name)
        ends = sorted(ts + dur for name, ts, dur in c if last in name)
        if len(starts) == len(ends) == n_layers:
            spans.extend(e - s for s, e in zip(starts, ends))
    return statistics.median(spans) if spans else float("nan")


def kernel_family(name, width=60):
    """A kernel's name without arguments and XLA's instance numbers: loop_add_fusion_3 -> loop_add_fusion."""
    return re.sub(r"[_.\d]+$", "", name.split("(")[0])[:width]


def exclusive_by_family(events):
    """({family: exclusive µs}, {family: Counter of its predecessors' families}) over time-ordered events. With PDL
    a kernel admitted early counts its entry wait in its duration; its exclusive time is the part past the end of
    every earlier kernel: what it adds to the timeline."""
    excl, after = collections.defaultdict(float), collections.defaultdict(collections.Counter)
    prev, prev_end = None, None
    for name, ts, dur in events:
        key = kernel_family(name)
        start = ts if prev_end is None else max(ts, prev_end)
        excl[key] += max(0.0, ts + dur - start)
        after[key][prev] += 1
        prev, prev_end = key, ts + dur if prev_end is None else max(prev_end, ts + dur)
    return dict(excl), dict(after)


def step_families(events, steps):
    """Per-step measures of a traced block of `steps` steps: its timeline span (first kernel start to last kernel
    end), kernel time and kernel count, and per family (`kernel_family`) its time, exclusive time
    (`exclusive_by_family`), launches and usual predecessor, the costliest first. No events (the CPU): zeros, no
    families."""
    fam = collections.defaultdict(list)
    for name, _, dur in events:
        fam[kernel_family(name)].append(dur)
    excl, after = exclusive_by_family(events)
    rows = sorted(((k, sum(v) / steps, len(v) / steps) for k, v in fam.items()), key=lambda r: -r[1])
    span = (max(ts + dur for _, ts, dur in events) - events[0][1]) / steps if events else 0.0
    return dict(span_us_per_step=span, busy_us_per_step=sum(e[2] for e in events) / steps,
                kernels_per_step=len(events) / steps,
                families=[dict(kernel=k, us_per_step=round(us, 2), exclusive_us_per_step=round(excl[k] / steps, 2),
                               per_step=n, after=after[k].most_common(1)[0][0]) for k, us, n in rows])


def durations_by_name(events, width=60):
    """{kernel name (first `width` characters): [durations µs]} over the traced events."""
    by_name = collections.defaultdict(list)
    for name, _, dur in events:
        by_name[name[:width]].append(dur)
    return by_name
