"""The timeline measures that RESULTS.md's device-time verdicts rest on (ling_jax/profiling.py), on synthetic
profiler events: calls split at host gaps, the span per call (from the call's first event, or from a named first
kernel), and the steady-state period of a chain of layers."""

import math

from ling_jax import profiling

DOWN = "experts_fwd_kernel_down"
LAYER = (("router_fwd_kernel_gemv", 2.5), ("topk", 3.5), ("gate_up", 17.0), ("experts_fwd_kernel_down_t1", 10.5))


def _chain_call(t0, n_layers, start_cost=2.8, layer=LAYER, first_extra=0.0):
    """One call's events: a copy of the chain's input, a gap, then n_layers layers back to back, each kernel
    overlapping its predecessor by 0.1 µs (as PDL admits it early); the first layer's first kernel lasts
    first_extra longer (not admitted early). -> (events, the layers' time from the first layer's first kernel)."""
    events = [("memcpy32_post", t0, 0.9)]
    t = t0 + start_cost
    for i in range(n_layers):
        for j, (name, dur) in enumerate(layer):
            dur += first_extra if i == j == 0 else 0.0
            events.append((name, t, dur))
            t += dur - 0.1
    return events, t + 0.1 - (t0 + start_cost)


def test_split_calls_drops_a_truncated_call():
    a, _ = _chain_call(0.0, 4)
    b, _ = _chain_call(1000.0, 4)
    c, _ = _chain_call(2000.0, 2)  # cut by the end of the trace: fewer kernels than the others
    calls = profiling.split_calls(a + b + c)
    assert [len(x) for x in calls] == [len(a), len(b)]


def test_three_measures_of_a_chain():
    for n_layers in (8, 16):
        events, layers_time = _chain_call(0.0, n_layers, first_extra=0.8)
        calls = profiling.split_calls(events)
        span = profiling.call_span_us(calls) / n_layers
        layers = profiling.call_span_us(calls, first="router_fwd_kernel_gemv") / n_layers
        period = profiling.call_period_us(calls, DOWN, n_layers)
        assert math.isclose(layers, layers_time / n_layers, rel_tol=1e-9)  # every layer, nothing before them
        assert math.isclose(span, layers + 2.8 / n_layers, rel_tol=1e-9)  # plus the start, spread over NL
        assert math.isclose(period, 33.1, rel_tol=1e-9)  # 33.5 of kernels minus 4 overlaps of 0.1
        assert math.isclose(layers, 33.1 + (0.8 + 0.1) / n_layers, rel_tol=1e-9)  # the first layer's extra counts


def test_period_needs_one_marked_launch_per_layer():
    doubled = LAYER + (("experts_fwd_kernel_down_combine", 1.0),)  # the marker matches two kernels per layer
    calls = profiling.split_calls(_chain_call(0.0, 4, layer=doubled)[0])
    assert math.isnan(profiling.call_period_us(calls, DOWN, 4))
    one_layer = profiling.split_calls(_chain_call(0.0, 1)[0])
    assert math.isnan(profiling.call_period_us(one_layer, DOWN, 1))


def test_measures_are_medians_over_calls():
    calls = []
    for i, down in enumerate((10.5, 11.5, 10.5)):
        layer = (("router_fwd_kernel_gemv", 2.5), ("experts_fwd_kernel_down_t1", down))
        events, _ = _chain_call(1000.0 * i, 4, layer=layer)
        calls.append(events)
    assert math.isclose(profiling.call_period_us(calls, DOWN, 4), 2.5 + 10.5 - 0.2, rel_tol=1e-9)
    assert math.isclose(profiling.call_span_us(calls, first="router_fwd_kernel_gemv"), 4 * 12.8 + 0.1,
                        rel_tol=1e-9)


def test_layer_own_span():
    """Each layer's first kernel start to its last kernel end: 33.5 of kernels minus 3 inner overlaps of 0.1; a
    fusion between layers (the "norm" chain) is not counted; the first layer's extra counts once in the median of
    NL values (not at all here, being one of 8); a marker launched twice per layer gives NaN."""
    gemv = "router_fwd_kernel_gemv"
    with_norm = LAYER + (("loop_reduce_fusion", 1.5),)
    for layer, want in ((LAYER, 33.2), (with_norm, 33.2)):
        calls = profiling.split_calls(_chain_call(0.0, 8, layer=layer, first_extra=0.8)[0])
        assert math.isclose(profiling.call_layer_span_us(calls, gemv, DOWN, 8), want, rel_tol=1e-9)
    doubled = LAYER + (("experts_fwd_kernel_down_combine", 1.0),)
    calls = profiling.split_calls(_chain_call(0.0, 4, layer=doubled)[0])
    assert math.isnan(profiling.call_layer_span_us(calls, gemv, DOWN, 4))


HLO_BLOCK = """\
HloModule jit_decode_block

%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %add.1 = f32[4]{0} add(%p, %p)
}

%body.7 (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %gemv = f32[4]{0} custom-call(%x), metadata={op_name="body/layer0_kda_moe/gemv_rows_fwd_kernel"}
  %loop_add_fusion = f32[4]{0} fusion(%gemv), kind=kLoop, calls=%fused_add, metadata={op_name="body/layer0_kda_moe/add"}
  %router = f32[4]{0} custom-call(%y), metadata={op_name="body/layer1_mla_moe/router_fwd_kernel_gemv"}
  %greedy = s32[1]{0} custom-call(%z), metadata={op_name="body/greedy_head"}
}

%cond.8 (arg: (s32[], f32[4])) -> pred[] {
  %lt_fusion = pred[] fusion(%i), kind=kLoop, calls=%fused_add, metadata={op_name="cond/lt"}
}

ENTRY %main.9 (a: f32[4]) -> f32[4] {
  %wrapped_transpose = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add
  %wrapped_transpose.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add
  %while.3 = (s32[]) while(%tuple), condition=%cond.8, body=%body.7, backend_config={"known_trip_count":{"n":"16"}}
}
"""


def test_count_launches_per_step():
    """A decode block's launches per step: its loop body's every step, the rest (entry copies, the loop test) once
    per block of `steps`; none inside fused computations; each in-loop launch under its layer's scope."""
    from ling_jax.bench import count_launches

    counts = count_launches(HLO_BLOCK, steps=16)
    assert counts["per_block"] == 3
    assert counts["step"] == round(4 + 3 / 16, 1)
    assert counts["layers"] == {"layer0_kda_moe": 2, "layer1_mla_moe": 1, "outside": 1}
    assert counts["first_layers"]["kda_moe"] == ["gemv <- gemv_rows_fwd_kernel", "loop_add_fusion <- add"]
    # XLA's double buffering: the body holds two steps and the loop runs half the trips.
    body = HLO_BLOCK.split("%body.7 (")[1].split("\n}")[0].split("\n", 1)[1]
    unrolled = HLO_BLOCK.replace(body, body + "\n" + body).replace('"n":"16"', '"n":"8"')
    assert count_launches(unrolled, steps=16) == counts
    assert count_launches(unrolled.replace('"n":"8"', '"n":"1"'), steps=2)["step"] == round(4 + 3 / 2, 1)
    # Without a loop (a block of one step) every launch is the step's.
    flat = HLO_BLOCK.replace(", condition=%cond.8, body=%body.7", "")
    assert count_launches(flat.replace(" while(", " call("), steps=1)["step"] == 7
    # A loop whose trip count is not the block's (an interpreted kernel's own loop on the CPU) is not the block's:
    # at one step, or at a trip count that is neither the steps nor half of them, every launch is the step's.
    assert count_launches(HLO_BLOCK, steps=1)["step"] == 7
    assert count_launches(HLO_BLOCK, steps=4)["per_block"] == 0


# A speculative step's kernels (k = 3, one of each layer kind) as the verify forward and the step's own work launch
# them, with their durations: the verify's Pallas kernels and an XLA GEMM, then acceptance and commit, which XLA fuses.
SPEC_STEP = (("gemv_rows_fwd_kernel", 6.0), ("gemm_fusion_dot_4", 1.5), ("kda_recurrent_verify", 8.0),
             ("router_fwd_kernel_gemv", 2.0), ("experts_fwd_kernel_gate_up", 20.0),
             ("experts_fwd_kernel_down", 10.0), ("mla_decode_fwd_kernel", 3.0),
             ("greedy_head_fwd_kernel", 5.0), ("loop_select_fusion_2", 1.5), ("loop_dynamic_slice_fusion_7", 2.5))


def _block(steps, step=SPEC_STEP, overlap=0.5, gap=1.0):
    """A traced block of `steps` steps: each kernel admitted `overlap` µs before its predecessor ends (PDL), `gap` µs
    between steps -> (events, the block's covered time per step)."""
    events, t = [], 0.0
    for _ in range(steps):
        for name, dur in step:
            events.append((name, t, dur))
            t += dur - overlap
        t += overlap + gap
    return events, (sum(d for _, d in step) - overlap * (len(step) - 1))


def test_step_families_per_step():
    """A block's measures per step: numbered fusions merge into one family; exclusive times leave out what PDL
    overlaps, so they add up to the covered timeline, and the span adds the gaps between steps."""
    events, covered = _block(4)
    prof = profiling.step_families(events, 4)
    fams = {f["kernel"]: f for f in prof["families"]}
    assert set(fams) == {profiling.kernel_family(name) for name, _ in SPEC_STEP}
    assert fams["loop_select_fusion"]["per_step"] == 1 and fams["loop_select_fusion"]["us_per_step"] == 1.5
    assert math.isclose(sum(f["exclusive_us_per_step"] for f in prof["families"]), covered, abs_tol=0.05)
    assert math.isclose(prof["busy_us_per_step"], sum(d for _, d in SPEC_STEP), rel_tol=1e-9)
    assert math.isclose(prof["span_us_per_step"], covered + 1.0 * 3 / 4, rel_tol=1e-9)  # 3 gaps in 4 steps
    assert prof["kernels_per_step"] == len(SPEC_STEP) and prof["families"][0]["kernel"] == "experts_fwd_kernel_gate_up"
    assert profiling.step_families([], 4) == dict(span_us_per_step=0.0, busy_us_per_step=0.0, kernels_per_step=0.0,
                                                  families=[])


def test_spec_breakdown_adds_up_to_the_step_not_the_token():
    """The spec step's families by op (the verify's kernels in theirs, acceptance and commit in "other") add up to
    the step's time, not to TPOT (a step emits the accept length's tokens); the bytes are a verify's over k + 1
    positions."""
    from ling_jax.bench import op_breakdown, step_bytes
    from ling_jax.config import preset

    prof = profiling.step_families(_block(8)[0], 8)
    moved = step_bytes(preset("toy"), 64, positions=4)
    step_us = sum(f["exclusive_us_per_step"] for f in prof["families"])
    tpot_us = step_us / 3.25
    b = op_breakdown(prof["families"], moved, tpot_us, step_us * 1.05)
    assert b["adds_up"] and b["step_us"] == round(step_us * 1.05, 1) and b["tpot_us"] == round(tpot_us, 1)
    assert set(b["ops"]) == {"projections", "kda", "moe", "mla", "lm_head", "other"}
    assert b["ops"]["projections"]["launches"] == 2  # the GEMV kernel and XLA's GEMM fusion
    assert math.isclose(b["ops"]["other"]["us"], 1.5 - 0.5 + 2.5 - 0.5, abs_tol=0.02)
    assert b["ops"]["moe"]["bytes"] == moved["ffn"] and "bytes" not in b["ops"]["other"]
    assert not op_breakdown(prof["families"], moved, tpot_us)["adds_up"]  # against TPOT, as a plain step
    assert not op_breakdown(prof["families"], moved, tpot_us, step_us * 1.2)["adds_up"]


def test_spec_summary_shares_outside_the_verify_forward():
    from ling_jax.spec_profile import spec_summary

    spec, _ = _block(8)
    verify, _ = _block(8, SPEC_STEP[:-2])  # the same step without acceptance and commit
    plain, _ = _block(8, (("gemv_rows_fwd_kernel", 4.0), ("greedy_head_fwd_kernel", 3.0)))
    prof = dict(profiling.step_families(spec, 8), verify=profiling.step_families(verify, 8))
    s = spec_summary(prof, profiling.step_families(plain, 8))
    step, alone = prof["span_us_per_step"], prof["verify"]["span_us_per_step"]
    assert s["spec_step_us"] == round(step, 1) and s["verify_forward_us"] == round(alone, 1)
    assert math.isclose(s["outside_verify_us"], 1.5 - 0.5 + 2.5 - 0.5, abs_tol=0.05)  # acceptance and commit
    assert s["outside_verify_pct"] == round(100 * (step - alone) / step, 1) and s["plain_step_us"] < s["spec_step_us"]
    empty = dict(profiling.step_families([], 8), verify=profiling.step_families([], 8))
    assert spec_summary(empty, profiling.step_families([], 8))["outside_verify_pct"] is None
