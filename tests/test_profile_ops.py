"""The timeline measures that RESULTS.md's device-time verdicts rest on (experiments/profile_ops.py), on synthetic
profiler events: calls split at host gaps, the span per call, and the steady-state period of a chain of layers."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import profile_ops  # noqa: E402


def _chain_call(t0, n_layers, start_cost=2.8, layer=(("gemv", 2.5), ("topk", 3.5), ("gate_up", 17.0),
                                                        ("experts_fwd_kernel_down_t1", 10.5))):
    """One call's events: a copy of the chain's input, a gap, then n_layers layers back to back, each kernel
    overlapping its predecessor by 0.1 µs (as PDL admits it early)."""
    events = [("memcpy32_post", t0, 0.9)]
    t = t0 + start_cost
    for _ in range(n_layers):
        for name, dur in layer:
            events.append((name, t, dur))
            t += dur - 0.1
    return events, t + 0.1 - (t0 + start_cost)


def test_split_calls_drops_a_truncated_call():
    a, _ = _chain_call(0.0, 4)
    b, _ = _chain_call(1000.0, 4)
    c, _ = _chain_call(2000.0, 2)  # cut by the end of the trace: fewer kernels than the others
    calls = profile_ops.split_calls(a + b + c)
    assert [len(x) for x in calls] == [len(a), len(b)]


def test_span_counts_the_chain_start_and_period_does_not():
    for n_layers in (8, 16):
        events, body = _chain_call(0.0, n_layers)
        calls = profile_ops.split_calls(events)
        per_layer = body / n_layers
        span = profile_ops.call_span_us(calls) / n_layers
        period = profile_ops.call_period_us(calls, "experts_fwd_kernel_down")
        assert math.isclose(span, per_layer + 2.8 / n_layers, rel_tol=1e-9)  # the start, spread over the layers
        assert math.isclose(period, 33.1, rel_tol=1e-9)  # 33.5 of kernels minus 4 overlaps of 0.1
    assert math.isnan(profile_ops.call_period_us(profile_ops.split_calls(_chain_call(0.0, 1)[0]),
                                                 "experts_fwd_kernel_down"))


def test_period_is_the_median_over_calls():
    calls = []
    for i, layer_down in enumerate((10.5, 11.5, 10.5)):
        events, _ = _chain_call(1000.0 * i, 4, layer=(("gemv", 2.5), ("experts_fwd_kernel_down_t1", layer_down)))
        calls.append(events)
    period = profile_ops.call_period_us(calls, "experts_fwd_kernel_down")
    assert math.isclose(period, 2.5 + 10.5 - 0.2, rel_tol=1e-9)
