"""Speculative decoding on a Ling-3.0-flash slice (exact widths, random bf16 weights): step time and TPOT against
plain decode, in one run.

Questions: what does one spec step (k drafts, one verify forward over k + 1 positions, accept, commit) cost next to
a plain decode step, and what TPOT does it give at a controlled accept length? The drafter is the oracle: it
replays a greedy output, corrupted at positions chosen so each step accepts a planned number of drafts; the accept
length is then exact (checked against the device counters), and the drafter costs nothing, so the step time is the
verify forward and its bookkeeping.

In bf16 the verify forward (k + 1 positions) and plain decode are different programs whose roundings differ, so a
near-tie can flip an argmax and the spec output leaves plain greedy's; an oracle replaying plain greedy would then
miss its plan. So each row's continuation is the spec path's own output under that row's corruptions, found by
iteration: replay plain greedy, take the output, replay it, until the output equals what was replayed (each round
fixes the first disagreement, since positions before it see the same inputs). Each row reports how many rounds that
took and where its output first left plain greedy's.

    python experiments/bench_spec.py --layers 6 --prompt-len 2048 --new-tokens 257 --ks 1,2,3,4,5,6,7,8 \
        --accepts 3:1,3:2,3:3.25,4:5 --profile-k 3

Rows: plain decode (TPOT = step time); per k with the true continuation (accept length k + 1: the step time and
TPOT); per k:a pair (accept length a with k drafts: TPOT). `--profile-k K` adds the device time of a spec step by
kernel family next to the verify forward alone over K + 1 positions, so what the step spends outside the verify
forward shows. Writes experiments/results/bench_spec.json (and $OUT/bench_spec.json).
`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/bench_spec.py --smoke`: the toy preset on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os

# The oracle replays plain greedy's output, so the spec path must compute the same argmaxes: XLA's excess precision
# drops bf16 round trips in one program and keeps them in the other, which moved verify logits 0.2 from decode's on
# the toy preset (experiments/RESULTS.md, Speculative decoding). Plain and spec rows both run under it.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ling_jax.bench import accept_plan, corruptions, oracle_aux, slice_config  # noqa: E402
from common import run_header, write_results  # noqa: E402
from ling_jax.engine import generate as G  # noqa: E402
from ling_jax.engine import speculative as S  # noqa: E402
from ling_jax.engine.drafters import OracleDrafter  # noqa: E402
from ling_jax.engine.sampling import Greedy  # noqa: E402
from ling_jax.model import forward  # noqa: E402
from ling_jax.params import init_params  # noqa: E402

SMOKE = dict(preset="toy", layers=3, prompt_len=16, new_tokens=24, ks="1,3", accepts="3:2.5", block_size=4,
             repeats=1, profile_k=0, backend="reference")


def timed(fn, repeats: int):
    fn()  # compile + warm up
    results = [fn() for _ in range(repeats)]
    return results, float(np.median([r.decode_s for r in results]))


def run(args):
    cfg = slice_config(args.layers, args.preset).replace(router_weight_dtype=args.router_dtype)
    params = init_params(cfg, jax.random.key(0), jnp.dtype(args.dtype), with_mtp=False)
    jax.block_until_ready(params)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, args.prompt_len))
    n_new = args.new_tokens
    common = dict(sampler=Greedy(), backend=args.backend, ignore_eos=True)

    plain_runs, plain_s = timed(lambda: G.generate(params, cfg, prompt, max_new_tokens=n_new + 24,
                                                   block_size=args.block_size, **common), args.repeats)
    truth = [int(t) for t in plain_runs[0].tokens[0]]
    plain = dict(kind="plain", k=0, accept_length=1.0, step_us=plain_s / plain_runs[0].steps * 1e6,
                 tpot_us=plain_s / plain_runs[0].steps * 1e6)
    rows = [plain]
    print(json.dumps(plain), flush=True)

    def spec(k, continuation, bad, n):
        return S.generate_speculative(params, cfg, prompt, max_new_tokens=n, drafter=OracleDrafter(), k=k,
                                      aux=oracle_aux(continuation, bad), block_size=args.block_size, **common)

    def own_output(k, bad):
        """The continuation the spec path reproduces under corruptions `bad` (module docstring), and the rounds."""
        continuation = truth
        for rounds in range(1, args.max_rounds + 1):
            out = [int(t) for t in spec(k, continuation, bad, len(truth)).tokens[0]]
            if out == continuation:
                return continuation, rounds
            continuation = out
        return continuation, None

    def spec_row(k, bad, planned):
        continuation, rounds = own_output(k, bad)
        if not bad:
            own[k] = continuation
        runs, decode_s = timed(lambda: spec(k, continuation, bad, n_new), args.repeats)
        r = runs[0]
        same = [a == b for a, b in zip(r.tokens[0], truth)]
        row = dict(kind="spec", k=k, planned_accept=planned, accept_length=r.accept_length,
                   oracle_rounds=rounds, first_divergence_from_plain=same.index(False) if False in same else None,
                   verify_steps=r.verify_steps, step_us=decode_s / r.verify_steps * 1e6,
                   tpot_us=decode_s / (len(r.tokens[0]) - 1) * 1e6)
        row["tpot_vs_plain"] = row["tpot_us"] / plain["tpot_us"]
        print(json.dumps(row), flush=True)
        return row

    own = {}  # k -> the spec path's own output with no corruption (the profile replays it)
    for k in map(int, args.ks.split(",")):
        rows.append(spec_row(k, [], k + 1))
    for item in filter(None, args.accepts.split(",")):
        k, a = item.split(":")
        k, a = int(k), float(a)
        plan = accept_plan(k, a, n_new)
        rows.append(spec_row(k, corruptions(k, plan, n_new), a))
    profile = profile_spec(params, cfg, prompt, own.get(args.profile_k) or own_output(args.profile_k, [])[0], args) \
        if args.profile_k else None
    return cfg, rows, profile


def profile_spec(params, cfg, prompt, truth, args) -> dict:
    """Device time per spec step by kernel family, and of the verify forward alone over k + 1 positions."""
    from ling_jax.profiling import kernel_family, trace_events

    k, steps = args.profile_k, args.block_size
    eos = jnp.zeros((0,), jnp.int32)
    aux = oracle_aux(truth, [])
    statics = dict(cfg=cfg, sampler=Greedy(), drafter=OracleDrafter(), backend=args.backend, pad_id=0)
    max_len = prompt.shape[1] + 8 * steps * (k + 1)
    state, _ = S.spec_start(params, aux, jnp.asarray(prompt), jax.random.key(0), eos, max_len=max_len, **statics)
    holder = [state]

    def block():
        holder[0], out, _, _ = S.spec_block(params, aux, holder[0], eos, k=k, steps=steps, max_new=10 ** 6,
                                            **statics)
        return out

    jax.block_until_ready(block())
    spec_events = trace_events(block, 1)

    @jax.jit
    def verify_only(params, model, tokens):
        def body(_, carry):
            logits, _, _ = forward(params, tokens, model.layers, model.length, cfg, mode="verify",
                                   backend=args.backend)
            return carry + logits[0, 0, 0]
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

    tokens = jnp.asarray([truth[:k + 1]], jnp.int32)
    model = holder[0].model
    jax.block_until_ready(verify_only(params, model, tokens))
    verify_events = trace_events(lambda: verify_only(params, model, tokens), 1)

    def summary(events):
        fam: dict[str, float] = {}
        for name, _, dur in events:
            fam[kernel_family(name)] = fam.get(kernel_family(name), 0.0) + dur / steps
        span = (events[-1][1] + events[-1][2] - events[0][1]) / steps if events else 0.0
        return span, sorted(fam.items(), key=lambda kv: -kv[1])

    spec_span, spec_fam = summary(spec_events)
    verify_span, verify_fam = summary(verify_events)
    print(f"\nprofile k={k}: spec step {spec_span:.1f} µs on the GPU timeline, verify forward alone "
          f"{verify_span:.1f} µs; outside the verify forward {spec_span - verify_span:.1f} µs "
          f"({(spec_span - verify_span) / max(spec_span, 1e-9):.1%})")
    for name, us in spec_fam[:25]:
        print(f"  {us:8.1f}  {name}")
    return dict(k=k, spec_span_us=spec_span, verify_span_us=verify_span,
                outside_verify_us=spec_span - verify_span,
                spec_families=[dict(kernel=n, us_per_step=round(u, 2)) for n, u in spec_fam],
                verify_families=[dict(kernel=n, us_per_step=round(u, 2)) for n, u in verify_fam])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--preset", default="ling-3.0-flash", help="the config whose widths are sliced")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=257)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="k values run with the true continuation")
    parser.add_argument("--accepts", default="3:1,3:2,3:3.25,4:5",
                        help="k:accept-length pairs run with planned corruptions")
    parser.add_argument("--block-size", type=int, default=8, help="spec steps (and plain steps) per block")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per row (median)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="fast")
    parser.add_argument("--router-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--max-rounds", type=int, default=8,
                        help="replay rounds to find each row's own greedy output (module docstring)")
    parser.add_argument("--profile-k", type=int, default=0, help="profile the spec step at this k (0: no)")
    parser.add_argument("--json", default="bench_spec.json", help="results file name (experiments/results, $OUT)")
    parser.add_argument("--smoke", action="store_true", help="toy preset on the CPU; writes nothing to the repo")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    header = run_header()
    cfg, rows, profile = run(args)
    print(f"\nslice of {args.layers} layers of {args.preset}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"backend {args.backend}, oracle drafter")
    print(f"{'row':>14s} {'accept':>7s} {'step us':>9s} {'TPOT us':>9s} {'vs plain':>9s} {'rounds':>6s} {'left plain at':>13s}")
    for r in rows:
        name = "plain" if r["kind"] == "plain" else f"k={r['k']} a={r['planned_accept']:g}"
        print(f"{name:>14s} {r['accept_length']:7.2f} {r['step_us']:9.1f} {r['tpot_us']:9.1f} "
              f"{r['tpot_us'] / rows[0]['tpot_us']:9.2f} {str(r.get('oracle_rounds', '')):>6s} "
              f"{str(r.get('first_divergence_from_plain', '')):>13s}")
    write_results(args.json, dict(args=vars(args), rows=rows, profile=profile, **header), to_repo=not args.smoke)


if __name__ == "__main__":
    main()
