"""Prefill (TTFT) of a Ling-3.0-flash slice on one GPU: exact widths, fewer layers, random bf16 weights.

Questions: how long does the slice take to prefill SGLang's 8192-token prompt (and 2048, and 32768 in chunks),
how much of the bf16 tensor-core peak is that, where does the time go per op, and how does peak memory follow the
prefill chunk? TTFT is `generate`'s: prefill plus the first greedy token, median of `--repeats` after a warm-up.
Useful FLOPs count what the model must compute: every projection (2 FLOPs per weight per token), the routed experts
each token chose and the shared one, the router, causal MLA attention over every visible (query, key) pair
(2·H·(Dqk + Dv) each), the KDA recurrence (6·H·K·V per token: decay, k·S, rank-1 update, q·S) and the lm_head of
the last token. Memory per row is the compiled prefill's (XLA's memory analysis): temporaries (the activations)
and outputs (the caches); the params are left out.
The full-model TTFT is extrapolated per layer (42 / layers × the slice) and labelled so.

    python experiments/bench_prefill.py --layers 6 --rows 2048:8192,8192:8192,8192:2048,32768:8192,32768:4096 \
        --profile 8192:8192

Prints a table and writes experiments/results/bench_prefill.json (and $OUT/bench_prefill.json).
`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/bench_prefill.py --smoke`: the toy preset on the CPU.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench_decode import slice_config
from common import print_table, run_header, write_results
from ling_jax.cache import cache_len
from ling_jax.config import KDA, MOE
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.params import init_params

PEAK_BF16_FLOPS = 989e12  # H200 dense bf16 tensor-core peak (spec sheet)
SMOKE = dict(preset="toy", layers=3, rows="40:40,40:16", profile="", repeats=1, backend="reference")


def useful_flops(cfg, prompt_len: int) -> dict[str, float]:
    """FLOPs the prefill of `prompt_len` tokens must compute, by op (module docstring)."""
    T, D, H = prompt_len, cfg.hidden_size, cfg.num_heads
    K = cfg.head_dim
    out = dict(kda_proj=0.0, kda_core=0.0, mla_proj=0.0, mla_attention=0.0, moe_routed=0.0, moe_shared=0.0,
               router=0.0, dense_mlp=0.0, lm_head=2.0 * D * cfg.vocab_size)
    pairs = T * (T + 1) / 2
    for i in range(cfg.num_layers):
        if cfg.mixer_kind(i) == KDA:
            # q, k, v, f, g: D -> H·K each; beta D -> H; output H·K -> D
            out["kda_proj"] += 2 * T * D * (6 * H * K + H)
            out["kda_core"] += 6 * T * H * K * K
        else:
            q = D * H * cfg.qk_head_dim if cfg.q_lora_rank is None else \
                cfg.q_lora_rank * (D + H * cfg.qk_head_dim)
            kv = D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + \
                cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            out["mla_proj"] += 2 * T * (q + kv + D * H + H * cfg.v_head_dim * D)
            out["mla_attention"] += 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * pairs
        if cfg.ffn_kind(i) == MOE:
            out["router"] += 2 * T * D * cfg.num_experts
            out["moe_routed"] += 6 * T * cfg.num_experts_per_tok * D * cfg.moe_intermediate_size
            out["moe_shared"] += 6 * T * D * cfg.shared_expert_intermediate_size
        else:
            out["dense_mlp"] += 6 * T * D * cfg.intermediate_size
    return out


def peak_bytes(params, cfg, prompt, args, chunk: int) -> dict | None:
    """The compiled prefill's temporaries (the activations) and outputs (the caches), from XLA's memory analysis;
    the arguments, mostly the params, are left out. None where it is not reported."""
    max_len = cache_len(prompt.shape[1] + 1)
    lowered = G.start.lower(params, jnp.asarray(prompt), jax.random.key(0), jnp.zeros((0,), jnp.int32), cfg,
                            Greedy(), max_len=max_len, backend=args.backend, pad_id=0, prefill_chunk=chunk)
    mem = lowered.compile().memory_analysis()
    if mem is None:
        return None
    gib = 2 ** 30
    return dict(temp_gib=round(mem.temp_size_in_bytes / gib, 2), output_gib=round(mem.output_size_in_bytes / gib, 2))


def ttft_row(params, cfg, args, prompt_len: int, chunk: int) -> dict:
    prompt = np.random.default_rng(prompt_len).integers(0, cfg.vocab_size, size=(1, prompt_len))
    row = dict(prompt=prompt_len, chunk=chunk)
    try:
        run = lambda: G.generate(params, cfg, prompt, max_new_tokens=1, sampler=Greedy(), backend=args.backend,  # noqa: E731
                                 ignore_eos=True, prefill_chunk=chunk)
        run()
        results = [run() for _ in range(args.repeats)]
    except Exception as e:  # out of memory or a refused size: a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
        print(json.dumps(row), flush=True)
        return row
    ttft = float(np.median([r.ttft_s for r in results]))
    flops = useful_flops(cfg, prompt_len)
    total = sum(flops.values())
    row.update(ttft_ms=round(ttft * 1e3, 2), compiles=results[-1].compiles, useful_tflop=round(total / 1e12, 3),
               tflops_per_s=round(total / ttft / 1e12, 1), frac_of_peak=round(total / ttft / PEAK_BF16_FLOPS, 3),
               full_model_ttft_ms_extrapolated=round(ttft * 1e3 * 42 / cfg.num_layers, 1))
    row.update(peak_bytes(params, cfg, prompt, args, chunk) or {})
    print(json.dumps(row), flush=True)
    return row


OP_CLASSES = (("kda", ("kda_", "short_conv")), ("mla", ("mla", "attention", "flash")),
              ("moe", ("grouped", "experts", "router", "moe")), ("gemm", ("gemm", "dot", "cublas", "cutlass", "nvjet")))


def op_class(kernel: str) -> str:
    name = kernel.lower()
    return next((cls for cls, keys in OP_CLASSES if any(k in name for k in keys)), "other")


def profile_row(params, cfg, args, prompt_len: int, chunk: int) -> dict:
    """Device time of one prefill by kernel family and op class, against each class's useful FLOPs."""
    from ling_jax.profiling import kernel_family, trace_events

    prompt = np.random.default_rng(prompt_len).integers(0, cfg.vocab_size, size=(1, prompt_len))
    run = lambda: G.generate(params, cfg, prompt, max_new_tokens=1, sampler=Greedy(), backend=args.backend,  # noqa: E731
                             ignore_eos=True, prefill_chunk=chunk)
    run()
    events = trace_events(run, 1)
    fam: dict[str, float] = {}
    for name, _, dur in events:
        fam[kernel_family(name)] = fam.get(kernel_family(name), 0.0) + dur
    classes: dict[str, float] = {}
    for name, us in fam.items():
        classes[op_class(name)] = classes.get(op_class(name), 0.0) + us
    flops = useful_flops(cfg, prompt_len)
    class_flops = dict(kda=flops["kda_core"], mla=flops["mla_attention"],
                       moe=flops["moe_routed"] + flops["moe_shared"] + flops["router"],
                       gemm=flops["kda_proj"] + flops["mla_proj"] + flops["dense_mlp"] + flops["lm_head"])
    print(f"\nprofile prompt {prompt_len} chunk {chunk}: {sum(fam.values()) / 1e3:.2f} ms of kernels")
    for cls, us in sorted(classes.items(), key=lambda kv: -kv[1]):
        f = class_flops.get(cls)
        rate = f" {f / (us * 1e-6) / 1e12:7.1f} TFLOP/s useful" if f and us else ""
        print(f"  {cls:6s} {us / 1e3:8.3f} ms{rate}")
    for name, us in sorted(fam.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {us:10.1f} us  {name}")
    return dict(prompt=prompt_len, chunk=chunk, kernels_ms=sum(fam.values()) / 1e3,
                classes_ms={c: u / 1e3 for c, u in classes.items()},
                class_tflops_per_s={c: class_flops[c] / (u * 1e-6) / 1e12 for c, u in classes.items()
                                    if c in class_flops and u},
                families=[dict(kernel=n, us=round(u, 1)) for n, u in sorted(fam.items(), key=lambda kv: -kv[1])])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--preset", default="ling-3.0-flash", help="the config whose widths are sliced")
    ap.add_argument("--rows", default="2048:8192,8192:8192,8192:2048,32768:8192,32768:4096",
                    help="prompt:chunk pairs timed")
    ap.add_argument("--profile", default="8192:8192", help="prompt:chunk profiled by kernel ('' for none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="fast")
    ap.add_argument("--router-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="toy preset on the CPU; writes nothing to the repo")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    header = run_header()
    cfg = slice_config(args.layers, args.preset).replace(router_weight_dtype=args.router_dtype)
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, with_mtp=False)
    jax.block_until_ready(params)
    rows = [ttft_row(params, cfg, args, *map(int, item.split(":"))) for item in args.rows.split(",")]
    profile = profile_row(params, cfg, args, *map(int, args.profile.split(":"))) if args.profile else None
    print(f"\nslice of {args.layers} layers of {args.preset}, backend {args.backend}, bf16; TFLOP/s of useful FLOPs, "
          f"peak {PEAK_BF16_FLOPS / 1e12:.0f}; full-model TTFT extrapolated x 42 / {args.layers}")
    print_table(rows, ["prompt", "chunk", "ttft_ms", "tflops_per_s", "frac_of_peak", "temp_gib", "output_gib",
                       "full_model_ttft_ms_extrapolated", "error"])
    write_results("bench_prefill.json", dict(args=vars(args), rows=rows, profile=profile, **header),
                  to_repo=not args.smoke)


if __name__ == "__main__":
    main()
