"""Batch-1 decode TPOT of a Ling-3.0-flash slice on one GPU: exact widths, fewer layers, random bf16 weights.

Question: how far is the engine's decode step (prefill, then jitted blocks of `fori_loop` steps) from the byte
floor, per backend? The slice is `--layers` layers of the real config (5 KDA + 1 MLA per 6, all MoE, the last
layers' SwiGLU clamps, which bite) plus the real embedding and lm_head; a full-model TPOT is extrapolated per layer
and labelled so. Workload as SGLang's: random prompt, greedy, EOS ignored, batch 1. TPOT and TTFT are medians
over `--repeats` generations after a warm-up one; the floor is the step's HBM bytes (weights once, KDA state read
and written, MLA cache read) at 4.3 TB/s. `--profile` adds the device time of a step by kernel family (JAX
profiler), `--tp N` shards the weights N ways over the first N devices (ling_jax/sharding.py) and decodes under
that mesh; its floor is then the step's bytes split N ways, a lower bound (the router, norms and a few small
tensors are read by every device).

    python experiments/bench_decode.py --layers 6 --prompt-len 2048 --new-tokens 257 --backends fast,reference \
        --router-dtype bfloat16 --profile

Prints a table and writes experiments/results/bench_decode.json (and $OUT/bench_decode.json when OUT is set).
`PYTHONPATH=. JAX_PLATFORMS=cpu python experiments/bench_decode.py --smoke`: the toy preset, 2 layers (KDA, MLA),
a short prompt, one generation (no warm-up) per backend, reference and pallas, on the CPU in interpret mode; it
writes nothing to the repo.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from common import HBM_BYTES_PER_S, run_header, write_results
from ling_jax.config import KDA, MOE, preset
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.params import COMPUTE, init_params, is_spec, param_specs
from ling_jax.sharding import make_mesh, param_shardings

SMOKE = dict(preset="toy", layers=2, prompt_len=16, new_tokens=9, block_size=4, warmup=0, repeats=1,
             backends="reference,pallas")


def slice_config(layers: int, base: str = "ling-3.0-flash"):
    flash = preset(base)
    start = flash.num_layers - layers  # take the last layers: clamps on, as in the real tail of the stack
    # A slice shorter than a group still ends its group: KDA layers, then MLA (docs/model.md §1).
    return flash.replace(num_layers=layers, layer_group_size=min(flash.layer_group_size, layers),
                         first_k_dense_replace=0, num_mtp_layers=0,
                         expert_swiglu_limits=flash.expert_swiglu_limits[start:],
                         shared_swiglu_limits=flash.shared_swiglu_limits[start:])


def step_bytes(cfg, context: int, dtype_bytes: int = 2) -> dict[str, float]:
    """HBM bytes one decode step must move: weights read once, KDA state read + written, MLA cache read."""
    specs = param_specs(cfg, with_mtp=False)
    item = lambda s: dtype_bytes if s.dtype_class == COMPUTE else jnp.dtype(s.dtype(None)).itemsize  # noqa: E731
    size = lambda tree: sum(int(np.prod(s.shape)) * item(s)  # noqa: E731
                            for s in jax.tree.leaves(tree, is_leaf=is_spec))
    out = {"lm_head": size(specs["lm_head"]), "embed_row": cfg.hidden_size * dtype_bytes, "kda_state": 0,
           "mla_cache": 0, "mixers": 0, "ffn": 0}
    for i, layer in enumerate(specs["layers"]):
        out["mixers"] += size(layer["mixer"]) + size(layer["input_norm"]) + size(layer["post_norm"])
        ffn = layer["ffn"]
        if cfg.ffn_kind(i) == MOE:
            per_expert = size(ffn["we_gate"]) // cfg.num_experts * 3
            shared = sum(size(ffn[k]) for k in ("ws_gate", "ws_up", "ws_down") if k in ffn)
            out["ffn"] += size(ffn["router"]) + size(ffn["expert_bias"]) + cfg.num_experts_per_tok * per_expert + shared
        else:
            out["ffn"] += size(ffn)
        if cfg.mixer_kind(i) == KDA:
            out["kda_state"] += 2 * cfg.num_heads * cfg.head_dim * cfg.head_dim * 4
        else:
            out["mla_cache"] += context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return out


def kernels_per_step(params, cfg, backend: str) -> dict:
    """Kernel launches in one compiled decode step: fusions and custom calls (cuBLAS, Pallas) outside fused
    computations, counted in the HLO of a one-step block -> {"step": total, "layers": {layer scope: count}}. A
    launch belongs to the layer whose named scope (`layer{i}_{mixer}_{ffn}`, ling_jax.model.forward) its op_name
    carries; the rest (embedding, lm_head, the block's own bookkeeping) to "outside"."""
    eos = jnp.zeros((0,), jnp.int32)
    # The loop state's shapes and shardings only: the step's program does not depend on the prefill's values.
    loop, _ = jax.eval_shape(functools.partial(G.start, cfg=cfg, sampler=Greedy(), max_len=16, backend=backend,
                                               pad_id=0), params, jnp.ones((1, 8), jnp.int32), jax.random.key(0), eos)
    hlo = G.decode_block.lower(params, loop, eos, cfg, Greedy(), steps=1, backend=backend,
                               pad_id=0).compile().as_text()
    return count_launches(hlo)


def count_launches(hlo: str) -> dict:
    """See kernels_per_step; `hlo` is a compiled module's text. Also "first_layers": {mixer_ffn kind: the launches
    of the first layer of that kind, as `instruction <- op`}, to read where a layer's kernels come from."""
    count, per_layer, computation = 0, collections.Counter(), ""
    names = collections.defaultdict(list)
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
        elif not computation.startswith(("fused", "wrapped")) and re.search(r"\b(fusion|custom-call)\(", line):
            count += 1
            scope = re.search(r"(layer\d+_\w+?_\w+?)/", line)
            layer = scope.group(1) if scope else "outside"
            per_layer[layer] += 1
            inst = re.match(r"\s*%?([\w\-]+?)(?:[.\d]*) = ", line)
            op = re.search(r'op_name="([^"]*)"', line)
            names[layer].append(f"{inst.group(1) if inst else '?'} <- {op.group(1).split('/')[-1] if op else '?'}")
    first = {}
    for layer in sorted(names, key=lambda n: (len(n), n)):
        kind = re.sub(r"^layer\d+_", "", layer)
        first.setdefault(kind, names[layer])
    return {"step": count, "layers": dict(sorted(per_layer.items())), "first_layers": first}


# Which part of the step a kernel belongs to, by name (first match wins): the per-op breakdown of `--profile`.
OP_FAMILIES = (
    ("lm_head", ("greedy_head",)),
    ("projections", ("gemv_fwd", "input_reduce_fusion")),
    ("moe", ("router_fwd", "experts_fwd")),
    ("kda", ("kda_recurrent",)),
    ("mla", ("mla_decode",)),
)


def op_family(kernel: str) -> str:
    return next((op for op, marks in OP_FAMILIES if any(m in kernel for m in marks)), "other")


def op_breakdown(families: list[dict], moved: dict, tpot_us: float) -> dict:
    """Exclusive device time per op family, the bytes that family must move and its achieved bandwidth, and whether
    the families add up to the measured TPOT within 10 %."""
    nbytes = {"lm_head": moved["lm_head"], "projections": moved["mixers"], "moe": moved["ffn"],
              "kda": moved["kda_state"], "mla": moved["mla_cache"]}
    rows = {}
    for f in families:
        op = op_family(f["kernel"])
        row = rows.setdefault(op, dict(us=0.0, launches=0.0))
        row["us"] += f["exclusive_us_per_step"]
        row["launches"] += f["per_step"]
    for op, row in rows.items():
        row["us"] = round(row["us"], 2)
        if op in nbytes:
            row["bytes"] = int(nbytes[op])
            row["TBps"] = round(nbytes[op] / (row["us"] * 1e-6) / 1e12, 3) if row["us"] else None
            row["floor_us"] = round(nbytes[op] / HBM_BYTES_PER_S * 1e6, 2)
    total = sum(r["us"] for r in rows.values())
    return dict(ops=rows, sum_us=round(total, 1), tpot_us=round(tpot_us, 1),
                adds_up=abs(total - tpot_us) <= 0.1 * tpot_us)


def profile_step(params, cfg, backend: str, prompt, block: int, top: int = 25, device=None) -> dict:
    """Device time of one decode step by kernel family (JAX profiler over one jitted block of `block` steps).

    Families merge XLA's numbered fusions (loop_add_fusion_3 → loop_add_fusion) so the table reads per op kind;
    "exclusive" is each family's time not overlapped by earlier kernels (ling_jax.profiling.exclusive_by_family).
    """
    from ling_jax.profiling import exclusive_by_family, kernel_family, trace_events

    eos = jnp.zeros((0,), jnp.int32)
    max_len = prompt.shape[1] + 4 * block
    loop, _ = G.start(params, jnp.asarray(prompt), jax.random.key(0), eos, cfg, Greedy(), max_len=max_len,
                      backend=backend, pad_id=0)
    kw = dict(steps=block, backend=backend, pad_id=0)
    loop, _, _ = G.decode_block(params, loop, eos, cfg, Greedy(), **kw)  # compile
    jax.block_until_ready(loop)
    # One traced block from the compiled state (donated once); TP: GPU `device`'s timeline only (every shard runs the
    # same kernels).
    events = trace_events(lambda: G.decode_block(params, loop, eos, cfg, Greedy(), **kw), 1, device=device)
    fam: dict[str, list[float]] = {}
    for name, _, dur in events:
        fam.setdefault(kernel_family(name), []).append(dur)
    excl, after = exclusive_by_family(events)  # PDL: durations include early-admitted kernels' waits
    rows = sorted(((k, sum(v) / block, len(v) / block) for k, v in fam.items()), key=lambda r: -r[1])
    span = (events[-1][1] + events[-1][2] - events[0][1]) / block if events else 0.0
    busy = sum(e[2] for e in events) / block
    print(f"\nprofile [{backend}]: {span:.1f} µs per step on the GPU timeline, {busy:.1f} µs of it in kernels, "
          f"{len(events) / block:.0f} kernels per step")
    print("  µs/step (exclusive)   launches   kernel  <- usual predecessor")
    for k, us, n in rows[:top]:
        print(f"  {us:8.1f} ({excl[k] / block:8.1f})  {n:5.1f}×  {k}  <- {after[k].most_common(1)[0][0]}")
    return dict(backend=backend, span_us_per_step=span, busy_us_per_step=busy,
                families=[dict(kernel=k, us_per_step=round(us, 2), exclusive_us_per_step=round(excl[k] / block, 2),
                               per_step=n, after=after[k].most_common(1)[0][0]) for k, us, n in rows])


def run(args) -> list[dict]:
    cfg = slice_config(args.layers, args.preset).replace(router_weight_dtype=args.router_dtype)
    dtype = jnp.dtype(args.dtype)
    mesh = make_mesh(args.tp) if args.tp > 1 else None
    # Each weight made on its shards directly: made whole on one device first, then resharded, the 6-layer slice's
    # 43 GB expert stack and its copy do not fit beside JAX's preallocation on a 2-GPU H200 machine.
    params = init_params(cfg, jax.random.key(0), dtype, with_mtp=False,
                         shardings=mesh and param_shardings(cfg, mesh, with_mtp=False))
    mesh_ctx = jax.set_mesh(mesh) if mesh else contextlib.nullcontext()
    jax.block_until_ready(params)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, args.prompt_len))
    context = args.prompt_len + args.new_tokens
    moved = step_bytes(cfg, context)
    total = sum(moved.values())
    floor_us = total / (HBM_BYTES_PER_S * max(args.tp, 1)) * 1e6
    full_bytes = sum(step_bytes(preset(args.preset), context).values())
    rows = []
    with mesh_ctx:
        for backend in args.backends.split(","):
            rows.append(run_backend(args, cfg, params, prompt, backend, total, floor_us, full_bytes, moved))
    return rows, moved


def kernel_counts(params, cfg, backend: str) -> dict:
    counts = kernels_per_step(params, cfg, backend)
    return dict(kernels_per_step=counts["step"], kernels_per_layer=counts["layers"],
                launches_of_first_layers=counts["first_layers"])


def print_breakdown(b: dict) -> None:
    print(f"  by op (exclusive µs per step; bytes that op must move):  sum {b['sum_us']} µs against TPOT "
          f"{b['tpot_us']} µs ({'within' if b['adds_up'] else 'NOT within'} 10 %)")
    for op, r in sorted(b["ops"].items(), key=lambda kv: -kv[1]["us"]):
        bw = (f"{r['bytes'] / 1e6:8.1f} MB  {r['TBps']:.2f} TB/s  floor {r['floor_us']:.1f} µs" if "bytes" in r
              else "")
        print(f"  {op:12s} {r['us']:8.1f} µs  {r['launches']:6.1f} launches  {bw}")


def run_backend(args, cfg, params, prompt, backend, total, floor_us, full_bytes, moved) -> dict:
    """TPOT / TTFT medians over args.repeats generations after args.warmup untimed ones (+ the profile if asked)."""
    kwargs = dict(max_new_tokens=args.new_tokens, sampler=Greedy(), backend=backend,
                  block_size=args.block_size, ignore_eos=True)
    for _ in range(args.warmup):  # compile + warm up
        G.generate(params, cfg, prompt, **kwargs)
    tpots, ttfts = [], []
    for _ in range(args.repeats):
        res = G.generate(params, cfg, prompt, **kwargs)
        tpots.append(res.tpot_s)
        ttfts.append(res.ttft_s)
    tpot_us = float(np.median(tpots)) * 1e6
    row = dict(backend=backend, layers=cfg.num_layers, tp=args.tp, tpot_us=tpot_us,
               ttft_ms=float(np.median(ttfts)) * 1e3, bytes_per_step=total, floor_us=floor_us,
               frac_of_floor=floor_us / tpot_us, **kernel_counts(params, cfg, backend),
               # Extrapolation, not a measurement: the full model at the slice's fraction of the floor.
               extrapolated_full_tpot_ms=tpot_us * full_bytes / total / 1e3)
    if args.profile:
        row["profile"] = profile_step(params, cfg, backend, prompt, args.block_size,
                                      device=0 if args.tp > 1 else None)
        row["breakdown"] = op_breakdown(row["profile"]["families"], moved, tpot_us)
        print_breakdown(row["breakdown"])
    print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "launches_of_first_layers")}),
          flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--preset", default="ling-3.0-flash", help="the config whose widths are sliced")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=257)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations first (compile, warm up)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="reference,pallas")
    parser.add_argument("--profile", action="store_true", help="per-kernel device time of a step (JAX profiler)")
    parser.add_argument("--router-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the MoE routers' dtype (LingConfig.router_weight_dtype): bfloat16 as the BF16 release "
                             "stores them, float32 (LingConfig's default) as transformers' save_pretrained does")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: weights sharded over N devices")
    parser.add_argument("--json", default="bench_decode.json", help="results file name (experiments/results, $OUT)")
    parser.add_argument("--smoke", action="store_true", help="toy preset on the CPU; writes nothing to the repo")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    header = run_header()
    rows, moved = run(args)
    print(f"slice of {args.layers} layers of {args.preset} x tp {max(args.tp, 1)}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, block {args.block_size}, router {args.router_dtype}")
    print("bytes per step: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in moved.items()))
    print(f"{'backend':10s} {'TPOT us':>9s} {'floor us':>9s} {'of floor':>9s} {'kernels':>8s} {'TTFT ms':>9s} "
          f"{'full model, extrapolated':>25s}")
    for r in rows:
        print(f"{r['backend']:10s} {r['tpot_us']:9.1f} {r['floor_us']:9.1f} {r['frac_of_floor']:9.1%} "
              f"{r['kernels_per_step']:8d} {r['ttft_ms']:9.1f} {r['extrapolated_full_tpot_ms']:22.2f} ms")
        print(f"{'':10s} kernels per layer: " + ", ".join(f"{k} {v}" for k, v in r["kernels_per_layer"].items()))
        for kind, launches in r["launches_of_first_layers"].items():
            print(f"{'':10s} {kind}: " + "; ".join(launches))
    write_results(args.json, dict(args=vars(args), rows=rows, bytes=moved, **header), to_repo=not args.smoke)


if __name__ == "__main__":
    main()
