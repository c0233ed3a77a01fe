"""`ling-jax bench`: batch-1 decode measured with SGLang's methodology, and the measures the decode benchmarks share.

Workload (SGLang's `bench_serving` record for this model, docs/design.md §4): one random prompt of `--prompt-len` tokens
(8192), `--output-len` tokens out (1024), concurrency 1, greedy, EOS ignored, a warm-up generation excluded.
Metrics: TTFT; TPOT as SGLang defines it, (latency - TTFT) / (output - 1), its mean and median over the timed
generations; output tokens per second; the step's HBM bytes (`step_bytes`) and the fraction of their floor at
`HBM_BYTES_PER_S`; kernels per step (`kernels_per_step`); with `--profile` the device time per op family (of the
speculative step with `--spec`, beside its verify forward alone and the plain step: `profile_spec`). SGLang's
published rows (`SGLANG_ROWS`) print beside ours with the hardware difference.

Weights: a checkpoint (`--checkpoint` orbax, `--hf-dir` safetensors) or `--random-weights` generated leaf by leaf
on the device (no host copy), `--layers N` for a slice of the real widths (the last N layers, so their SwiGLU
clamps bite as at the end of the stack). `ling_jax.memory` checks the plan fits before any allocation.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import KDA, MOE, preset
from ling_jax.engine import generate as G
from ling_jax.engine.sampling import Greedy
from ling_jax.params import COMPUTE, is_spec, param_specs

# Measured H200 device-to-device copy rate, bytes read + written (experiments/RESULTS.md): the floors' denominator.
HBM_BYTES_PER_S = 4.3e12

# SGLang's published batch-1 rows for Ling-3.0-flash (docs/design.md §4): 4 Blackwell GPUs, TP4, bf16,
# 8192-token prompt, 1024 out, concurrency 1, mean TPOT. Every row speculates (NEXTN with 6 draft tokens, then
# the DSpark draft model), so a row without speculation here compares with their TPOT per output token.
SGLANG_ROWS = (
    dict(config="SGLang baseline (NEXTN)", tpot_ms=3.33, accept_length=3.14),
    dict(config="SGLang, host never blocking + NEXTN tuned", tpot_ms=1.53, accept_length=3.25),
    dict(config="SGLang, DSpark draft", tpot_ms=0.78, accept_length=9.95),
)
SGLANG_HARDWARE = "4 Blackwell GPUs, TP4, bf16"


def slice_config(layers: int, base: str = "ling-3.0-flash"):
    flash = preset(base)
    start = flash.num_layers - layers  # take the last layers: clamps on, as in the real tail of the stack
    # A slice shorter than a group still ends its group: KDA layers, then MLA (docs/model.md §1).
    return flash.replace(num_layers=layers, layer_group_size=min(flash.layer_group_size, layers),
                         first_k_dense_replace=0, num_mtp_layers=0,
                         expert_swiglu_limits=flash.expert_swiglu_limits[start:],
                         shared_swiglu_limits=flash.shared_swiglu_limits[start:])


def step_bytes(cfg, context: int, dtype_bytes: int = 2, positions: int = 1,
               routed_experts: float | None = None) -> dict[str, float]:
    """HBM bytes one batch-1 forward over `positions` new tokens must move: the plain decode step (1) or the verify
    step of k drafts (k + 1). `context`: the sequence's length after the step.

    Weights are read once whatever `positions` (the final norm with lm_head, which the greedy head fuses). An MoE
    layer reads its router, its shared expert and `routed_experts` distinct routed experts: by default
    min(E, positions * top_k), the most the positions can select (experiments/bench_moe.py measures the mean that
    routing gives; pass it for that floor). The KDA delta state (fp32) is read once and each position's post-state
    written (a verify step keeps every one for the commit to choose from); its conv window's W - 1 rows are read and
    each position's pre-conv row written. The MLA latent cache's `context` rows: the earlier rows read, the
    positions' own written. The embedding's rows of the positions. Activations are not counted."""
    specs = param_specs(cfg, with_mtp=False)
    item = lambda s: dtype_bytes if s.dtype_class == COMPUTE else jnp.dtype(s.dtype(None)).itemsize  # noqa: E731
    size = lambda tree: sum(int(np.prod(s.shape)) * item(s)  # noqa: E731
                            for s in jax.tree.leaves(tree, is_leaf=is_spec))
    if routed_experts is None:
        routed_experts = min(cfg.num_experts, positions * cfg.num_experts_per_tok)
    H, K = cfg.num_heads, cfg.head_dim
    conv_row = 3 * H * K * dtype_bytes  # one position's pre-conv q | k | v
    out = {"lm_head": size(specs["lm_head"]) + size(specs["final_norm"]),
           "embed_row": positions * cfg.hidden_size * dtype_bytes, "kda_state": 0, "mla_cache": 0, "mixers": 0,
           "ffn": 0}
    for i, layer in enumerate(specs["layers"]):
        out["mixers"] += size(layer["mixer"]) + size(layer["input_norm"]) + size(layer["post_norm"])
        ffn = layer["ffn"]
        if cfg.ffn_kind(i) == MOE:
            per_expert = size(ffn["we_gate"]) // cfg.num_experts * 3
            shared = sum(size(ffn[k]) for k in ("ws_gate", "ws_up", "ws_down") if k in ffn)
            out["ffn"] += size(ffn["router"]) + size(ffn["expert_bias"]) + routed_experts * per_expert + shared
        else:
            out["ffn"] += size(ffn)
        if cfg.mixer_kind(i) == KDA:
            out["kda_state"] += ((1 + positions) * H * K * K * 4
                                 + (cfg.conv_kernel_size - 1 + positions) * conv_row)
        else:
            out["mla_cache"] += context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return out


def kernels_per_step(params, cfg, backend: str, *, max_len: int = 16, steps: int = 1) -> dict:
    """Kernel launches per compiled decode step: fusions and custom calls (cuBLAS, Pallas) outside fused
    computations, counted in the HLO of a decode block of `steps` steps (`count_launches`) -> {"step": launches per
    step, "layers": {layer scope: count}, "per_block": the block's launches outside its loop, "first_layers"}. A
    launch belongs to the layer whose named scope (`layer{i}_{mixer}_{ffn}`, ling_jax.model.forward) its op_name
    carries; the rest of the loop body (embedding, lm_head, the step's bookkeeping) to "outside". `max_len` and
    `steps` as the timed generations used, so a persistent compilation cache serves it."""
    eos = jnp.zeros((0,), jnp.int32)
    # The loop state's shapes and shardings only: the step's program does not depend on the prefill's values.
    loop, _ = jax.eval_shape(functools.partial(G.start, cfg=cfg, sampler=Greedy(), max_len=max_len, backend=backend,
                                               pad_id=pad_id(cfg)), params, jnp.ones((1, 8), jnp.int32), jax.random.key(0), eos)
    hlo = G.decode_block.lower(params, loop, eos, cfg, Greedy(), steps=steps, backend=backend,
                               pad_id=pad_id(cfg)).compile().as_text()
    return count_launches(hlo, steps)


def block_loop(hlo: str, steps: int) -> tuple[set[str], int]:
    """The decode block's loop in a compiled module of `steps` steps -> (the computations around it, steps per pass
    of its body). The loop is the entry computation's while of known trip count `steps`, or `steps / 2` where XLA's
    double buffering unrolled two steps into its body. Around it run the entry and its loops' conditions (which
    XLA's GPU runtime skips for a known trip count), once per block. No such loop (one step; or only a kernel's own
    loops, as interpreted Pallas programs on the CPU): (set(), 1), every launch the step's."""
    entry = re.search(r"^ENTRY %?([\w.\-]+) [^\n]*\{$(.*?)^\}", hlo, re.M | re.S)
    if entry is None or steps < 2:
        return set(), 1
    loops = [(re.search(r"\bcondition=%?([\w.\-]+)", line).group(1),
              re.search(r'"known_trip_count":\{"n":"(\d+)"', line)) for line in entry.group(2).splitlines()
             if re.search(r"\bwhile\(.*\bcondition=", line)]
    trips = [int(n.group(1)) for _, n in loops if n and int(n.group(1)) in (steps, steps / 2)]
    if not trips:
        return set(), 1
    return {entry.group(1), *(cond for cond, _ in loops)}, steps // trips[0]


def count_launches(hlo: str, steps: int = 1) -> dict:
    """See kernels_per_step; `hlo` is a compiled module's text. The launches of the loop's body (and of what it
    calls) run every step; those around the loop (`block_loop`: the block's entry and exit, the loop state's
    layout copies) once per block, so each counts 1/steps of a step. A body XLA unrolled holds two steps, so its
    launches count half. Without the block's loop (one step) every launch counts. Also
    "first_layers": {mixer_ffn kind: the launches of the first layer of that kind, as `instruction <- op`}, to read
    where a layer's kernels come from."""
    around, per_pass = block_loop(hlo, steps)
    per_step, per_block, per_layer, computation = 0, 0, collections.Counter(), ""
    names = collections.defaultdict(list)
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
        elif not computation.startswith(("fused", "wrapped")) and re.search(r"\b(fusion|custom-call)\(", line):
            if computation in around:
                per_block += 1
                continue
            per_step += 1
            scope = re.search(r"(layer\d+_\w+?_\w+?)/", line)
            layer = scope.group(1) if scope else "outside"
            per_layer[layer] += 1
            inst = re.match(r"\s*%?([\w\-]+?)(?:[.\d]*) = ", line)
            op = re.search(r'op_name="([^"]*)"', line)
            names[layer].append(f"{inst.group(1) if inst else '?'} <- {op.group(1).split('/')[-1] if op else '?'}")
    first = {}
    for layer in sorted(names, key=lambda n: (len(n), n)):
        kind = re.sub(r"^layer\d+_", "", layer)
        first.setdefault(kind, names[layer][:len(names[layer]) // per_pass])
    return {"step": round(per_step / per_pass + per_block / steps, 1),
            "layers": {k: v // per_pass for k, v in sorted(per_layer.items())}, "per_block": per_block,
            "first_layers": first}


# Which part of the step a kernel belongs to, by name (first match wins): the per-op breakdown of `--profile`.
OP_FAMILIES = (
    ("lm_head", ("greedy_head",)),
    # The GEMV kernels of every layout, K-split sums, and XLA's GEMM fusions: a verify over k + 1 positions runs a few
    # of its dots as those.
    ("projections", ("gemv_", "input_reduce_fusion", "gemm_fusion")),
    ("moe", ("router_fwd", "experts_fwd")),
    ("kda", ("kda_recurrent",)),
    ("mla", ("mla_decode",)),
)


def op_family(kernel: str) -> str:
    return next((op for op, marks in OP_FAMILIES if any(m in kernel for m in marks)), "other")


def op_breakdown(families: list[dict], moved: dict, tpot_us: float, step_us: float | None = None) -> dict:
    """Exclusive device time per op family, the bytes that family must move and its achieved bandwidth, and whether
    the families add up to the measured step time within 10 %: TPOT for plain decode, `step_us` for a speculative
    step (the decode time per step run, which emits the accept length's tokens); `against` names which ("TPOT" or
    "spec step")."""
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
    against = "TPOT" if step_us is None else "spec step"
    total, step_us = sum(r["us"] for r in rows.values()), tpot_us if step_us is None else step_us
    return dict(ops=rows, sum_us=round(total, 1), tpot_us=round(tpot_us, 1), step_us=round(step_us, 1),
                against=against, adds_up=abs(total - step_us) <= 0.1 * step_us)


def pad_id(cfg) -> int:
    """The pad id `generate` compiles its steps with."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else 0


def profile_step(params, cfg, backend: str, prompt, block: int, top: int = 25, device=None,
                 max_len: int | None = None, prefill_chunk: int | None = None) -> dict:
    """Device time of one decode step by kernel family (JAX profiler over one jitted block of `block` steps).

    Families merge XLA's numbered fusions (loop_add_fusion_3 → loop_add_fusion) so the table reads per op kind;
    "exclusive" is each family's time not overlapped by earlier kernels (ling_jax.profiling.exclusive_by_family).
    """
    from ling_jax.profiling import step_families, trace_events

    from ling_jax.sharding import replicated

    prompt, key, eos = replicated((np.asarray(prompt, np.int32), jax.random.key(0), jnp.zeros((0,), jnp.int32)),
                                  params["embed"])
    max_len = max_len or prompt.shape[1] + 4 * block
    loop, _ = G.start(params, jnp.asarray(prompt), key, eos, cfg, Greedy(), max_len=max_len,
                      backend=backend, pad_id=pad_id(cfg), prefill_chunk=prefill_chunk)
    kw = dict(steps=block, backend=backend, pad_id=pad_id(cfg))
    loop, _, _ = G.decode_block(params, loop, eos, cfg, Greedy(), **kw)  # compile
    jax.block_until_ready(loop)
    # One traced block from the compiled state (donated once); TP: GPU `device`'s timeline only (every shard runs the
    # same kernels).
    events = trace_events(lambda: G.decode_block(params, loop, eos, cfg, Greedy(), **kw), 1, device=device)
    prof = dict(backend=backend, **step_families(events, block))
    print_profile(f"profile [{backend}]", prof, top)
    return prof


def print_profile(title: str, prof: dict, top: int = 25) -> None:
    """A step's profile (`profiling.step_families`): its timeline and its `top` costliest kernel families."""
    print(f"\n{title}: {prof['span_us_per_step']:.1f} µs per step on the GPU timeline, {prof['busy_us_per_step']:.1f} "
          f"µs of it in kernels, {prof['kernels_per_step']:.0f} kernels per step")
    print("  µs/step (exclusive)   launches   kernel  <- usual predecessor")
    for f in prof["families"][:top]:
        print(f"  {f['us_per_step']:8.1f} ({f['exclusive_us_per_step']:8.1f})  {f['per_step']:5.1f}×  {f['kernel']}  "
              f"<- {f['after']}")


def kernel_counts(params, cfg, backend: str, **kw) -> dict:
    counts = kernels_per_step(params, cfg, backend, **kw)
    return dict(kernels_per_step=counts["step"], kernels_per_layer=counts["layers"],
                kernels_per_block_outside_loop=counts["per_block"], launches_of_first_layers=counts["first_layers"])


def print_breakdown(b: dict) -> None:
    step = (f"TPOT {b['tpot_us']} µs" if b["against"] == "TPOT" else
            f"the spec step's {b['step_us']} µs (decode time per step run; TPOT {b['tpot_us']} µs)")
    print(f"  by op (exclusive µs per step; bytes that op must move):  sum {b['sum_us']} µs against {step} "
          f"({'within' if b['adds_up'] else 'NOT within'} 10 %)")
    for op, r in sorted(b["ops"].items(), key=lambda kv: -kv[1]["us"]):
        bw = (f"{r['bytes'] / 1e6:8.1f} MB  {r['TBps']:.2f} TB/s  floor {r['floor_us']:.1f} µs" if "bytes" in r
              else "")
        print(f"  {op:12s} {r['us']:8.1f} µs  {r['launches']:6.1f} launches  {bw}")


def bench_config(base: str, layers: int | None, dtype: str, router_dtype: str | None = None):
    """The preset `base`, or its last `layers` layers (`slice_config`, no MTP layer), block-FP8 for dtype "fp8"."""
    cfg = preset(base) if layers is None else slice_config(layers, base)
    cfg = cfg.replace(quantization="fp8" if dtype == "fp8" else None)
    return cfg.replace(router_weight_dtype=router_dtype) if router_dtype else cfg


def compute_dtype(dtype: str):
    """The activations' dtype of a --dtype choice: FP8 weights compute in bf16."""
    return jnp.dtype(jnp.bfloat16 if dtype == "fp8" else dtype)


def timed_generations(run, *, warmup: int, repeats: int, progress: bool = True) -> list:
    """`warmup` untimed then `repeats` timed calls of the zero-argument generation `run` -> their results."""
    from tqdm import tqdm

    results = []
    with tqdm(total=warmup + repeats, desc="generations (warm-up first)", disable=not progress) as bar:
        for i in range(warmup + repeats):
            res = run()
            if i >= warmup:
                results.append(res)
            bar.update(1)
    return results


def sglang_metrics(results: list, output_len: int) -> dict:
    """TTFT and TPOT as SGLang reports them (TPOT = (latency - TTFT) / (output - 1)), over the timed runs."""
    ttft = [r.ttft_s * 1e3 for r in results]
    tpot = [r.tpot_s * 1e3 for r in results]  # over the output's tokens after the first, as SGLang counts them
    latency = [t + p * (output_len - 1) for t, p in zip(ttft, tpot)]
    return dict(ttft_ms=float(np.median(ttft)), tpot_ms_mean=float(np.mean(tpot)),
                tpot_ms_median=float(np.median(tpot)), latency_ms=float(np.median(latency)),
                output_tokens_per_s=float(output_len / (np.median(latency) / 1e3)),
                compiles_in_timed_runs=int(sum(r.compiles for r in results)))


def accept_plan(k: int, accept: float, steps: int) -> list[int]:
    """Accepted drafts per step whose mean is accept - 1 (evenly spread, Bresenham), each in 0..k."""
    import math

    mean = accept - 1
    if not 0 <= mean <= k:
        raise ValueError(f"accept length {accept} needs 1 <= accept <= k + 1 = {k + 1}")
    return [min(k, math.floor((j + 1) * mean + 1e-9) - math.floor(j * mean + 1e-9)) for j in range(steps)]


def corruptions(k: int, plan: list[int], n_new: int) -> list[int]:
    """Output positions to corrupt so that step j accepts plan[j] drafts (the oracle drafts positions m..m+k-1)."""
    bad, m = [], 1
    for n in plan:
        if m >= n_new:
            break
        if n < k:
            bad.append(m + n)
        m += n + 1
    return bad


def oracle_aux(tokens, bad):
    cont = jnp.asarray([tokens], jnp.int32)
    corrupt = jnp.zeros(cont.shape, bool)
    return cont, corrupt.at[0, jnp.asarray(bad, jnp.int32)].set(True) if bad else corrupt


SPEC_DRAFTERS = ("oracle", "mtp", "suffix")


def spec_drafter(params, cfg, prompt, *, spec: str, k: int, accept_length: float | None, output_len: int,
                 backend: str, block_size: int, prefill_chunk: int | None = None):
    """The drafter of `spec` and its aux -> (drafter, aux). The oracle is planned acceptance (drafters.PlannedDrafter,
    a timing mode): it drafts the model's own greedy output and keeps accept_plan's count each step (None: every
    draft, accept length k + 1) whatever the verify says, since at full size in bf16 or FP8 the verify's argmax
    leaves plain decode's; mtp and suffix draft for real and are judged by the acceptance rule."""
    from ling_jax.engine import drafters

    if spec not in SPEC_DRAFTERS:
        raise ValueError(f"spec={spec!r} is no drafter of the bench: choose one of {', '.join(SPEC_DRAFTERS)}")
    if spec != "oracle":
        return {"mtp": drafters.MTPDrafter, "suffix": drafters.Suffix}[spec](), None
    truth = G.generate(params, cfg, prompt, max_new_tokens=output_len, sampler=Greedy(), backend=backend,
                       block_size=block_size, ignore_eos=True, prefill_chunk=prefill_chunk).tokens[0]
    plan = accept_plan(k, k + 1 if accept_length is None else accept_length, output_len)
    return drafters.PlannedDrafter(), (jnp.asarray([truth], jnp.int32), jnp.asarray(plan, jnp.int32))


def spec_runner(params, cfg, prompt, drafter, aux, *, k: int, output_len: int, backend: str, block_size: int,
                prefill_chunk: int | None = None):
    """A zero-argument speculative greedy generation with `drafter` and its aux (`spec_drafter`)."""
    from ling_jax.engine.speculative import generate_speculative

    return functools.partial(generate_speculative, params, cfg, prompt, drafter=drafter, aux=aux,
                             max_new_tokens=output_len, sampler=Greedy(), k=k, backend=backend, block_size=block_size,
                             ignore_eos=True, prefill_chunk=prefill_chunk)



def planned_accept_length(k: int, accept: float | None, steps: int) -> float:
    """The accept length the plan gives over the first `steps` verify steps (what the device's counts must show)."""
    plan = accept_plan(k, k + 1 if accept is None else accept, steps)
    return (sum(plan) + steps) / steps


def enable_compilation_cache() -> None:
    """A persistent compilation cache for this process (unless one is set): a second compile of the same program,
    as `kernels_per_step` does, is then read back rather than compiled (minutes for the full model)."""
    import tempfile

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="ling-jax-xla-cache-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_header() -> dict:
    """The fields every result row records: device, device count, jax version, date and the repository's commit."""
    import datetime
    import subprocess
    from pathlib import Path

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(device=jax.devices()[0].device_kind, devices=jax.device_count(), processes=jax.process_count(),
                jax=jax.__version__,
                date=datetime.date.today().isoformat(), commit=commit)


def peak_memory_bytes() -> int | None:
    """This process's first device's peak allocation so far (None where the runtime reports none: the CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # a runtime without memory stats
        stats = {}
    return stats.get("peak_bytes_in_use")


def bench(params, cfg, *, prompt_len: int, output_len: int, backend: str, block_size: int, warmup: int,
          repeats: int, prefill_chunk: int | None = None, count_kernels: bool = True, profile: bool = False,
          seed: int = 0, progress: bool = True, spec: str = "none", num_draft: int = 3,
          accept_length: float | None = None) -> dict:
    """SGLang's workload on `params` -> one result row (see the module docstring). `spec`: "none", or a drafter of
    SPEC_DRAFTERS with `num_draft` drafts per step (the oracle at `accept_length`); kernel counts are of the plain
    decode step, the profile of the step timed (`profile_spec` for a speculative one)."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len} must be >= 2: TPOT needs a decode step after the prefill's token")
    from ling_jax.cache import cache_len
    from ling_jax.model import PREFILL_CHUNK, check_chunk

    if count_kernels:  # the kernel count compiles the timed step again: from this cache, not from scratch
        enable_compilation_cache()

    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, prompt_len))
    block_size = min(block_size, output_len - 1)  # as the generators cap it: the kernel count compiles that block
    if spec == "none":
        run = functools.partial(G.generate, params, cfg, prompt, max_new_tokens=output_len, sampler=Greedy(),
                                backend=backend, block_size=block_size, ignore_eos=True, prefill_chunk=prefill_chunk)
    else:
        gen = dict(output_len=output_len, backend=backend, block_size=block_size, prefill_chunk=prefill_chunk)
        drafter, aux = spec_drafter(params, cfg, prompt, spec=spec, k=num_draft, accept_length=accept_length, **gen)
        run = spec_runner(params, cfg, prompt, drafter, aux, k=num_draft, **gen)
    results = timed_generations(run, warmup=warmup, repeats=repeats, progress=progress)
    row = dict(backend=backend, layers=cfg.num_layers, quantization=cfg.quantization, prompt_len=prompt_len,
               output_len=output_len, block_size=block_size, repeats=repeats, warmup=warmup,
               prefill_chunk=prefill_chunk or PREFILL_CHUNK, spec=spec, **sglang_metrics(results, output_len))
    if spec != "none":
        steps_run = [r.steps_run for r in results]
        row.update(num_draft=num_draft, accept_length=float(np.mean([r.accept_length for r in results])),
                   verify_steps=[r.verify_steps for r in results], steps_run=steps_run,
                   step_ms_median=float(np.median([r.decode_s * 1e3 / n for r, n in zip(results, steps_run)])),
                   agreement=_mean_or_none([r.agreement for r in results]),
                   acceptance="planned (timing)" if spec == "oracle" else "real")
        if spec == "oracle":  # the device's counts must be the plan's, over the steps each run took
            want = [planned_accept_length(num_draft, accept_length, r.verify_steps) for r in results]
            got = [r.accept_length for r in results]
            if not np.allclose(got, want, rtol=0, atol=1e-9):
                raise AssertionError(f"planned acceptance: the device counted accept lengths {got}, the plan gives "
                                     f"{want}")
            row["planned_accept_length"] = want[0]
    moved = step_bytes(cfg, prompt_len + output_len, jnp.dtype(params["embed"].dtype).itemsize)
    total = sum(moved.values())
    floor_ms = total / HBM_BYTES_PER_S * 1e3
    row.update(bytes_per_token=int(total), bytes_by_part={k: int(v) for k, v in moved.items()},
               floor_ms=floor_ms, frac_of_floor=floor_ms / row["tpot_ms_median"])
    # The timed generations' cache length, so these reuse their compiled step (a persistent compilation cache).
    n_blocks = -(-(output_len - 1) // block_size)
    max_len = min(cache_len(prompt_len + 1 + n_blocks * block_size), cfg.max_position_embeddings)
    if count_kernels:
        row.update(kernel_counts(params, cfg, backend, max_len=max_len, steps=block_size))
    if profile:
        from ling_jax.sharding import tp_size

        chunk = check_chunk(prefill_chunk)
        device = 0 if tp_size() > 1 else None  # one GPU's timeline: every shard runs the same kernels
        plain = profile_step(params, cfg, backend, prompt, block_size, max_len=max_len, prefill_chunk=chunk,
                             device=device)
        if spec == "none":
            row.update(profile=plain, breakdown=op_breakdown(plain["families"], moved, row["tpot_ms_median"] * 1e3))
        else:
            row.update(profile_spec(params, cfg, prompt, row, plain, drafter=drafter, aux=aux, prefill_chunk=chunk,
                                    device=device))
    row["peak_memory_bytes"] = peak_memory_bytes()
    return row


def profile_spec(params, cfg, prompt, row: dict, plain: dict, *, drafter, aux, prefill_chunk: int,
                 device=None) -> dict:
    """A spec row's profile -> its "profile" (the speculative step by kernel family, `spec_profile`; the verify
    forward alone under "verify", the plain step's `plain` under "plain"), "breakdown" (the spec step's families
    against its time, the decode time per step run, with the bytes a verify over k + 1 positions moves) and
    "spec_profile" (`spec_profile.spec_summary`); `device` as `profile_step`'s."""
    from ling_jax import spec_profile

    k, backend = row["num_draft"], row["backend"]
    prof = spec_profile.profile_spec_step(params, cfg, backend, prompt, row["block_size"], drafter=drafter, aux=aux,
                                          k=k, max_new=row["output_len"], pad_id=pad_id(cfg),
                                          prefill_chunk=prefill_chunk, device=device)
    print_profile(f"profile [{backend}] spec step, k={k}", prof)
    print_profile(f"profile [{backend}] verify forward alone, {k + 1} positions", prof["verify"], top=10)
    moved = step_bytes(cfg, row["prompt_len"] + row["output_len"], jnp.dtype(params["embed"].dtype).itemsize,
                       positions=k + 1)
    breakdown = op_breakdown(prof["families"], moved, row["tpot_ms_median"] * 1e3, row["step_ms_median"] * 1e3)
    return dict(profile=dict(prof, plain=plain), breakdown=breakdown,
                spec_profile=spec_profile.spec_summary(prof, plain))


def _mean_or_none(values: list) -> float | None:
    """The mean of the values that are not None (a run that drafted nothing has no agreement); None if none is."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def print_row(row: dict) -> None:
    gb = 1e9
    spec = "" if row["spec"] == "none" else (
        f", spec {row['spec']} k={row['num_draft']} (accept length {row['accept_length']:.2f}, acceptance: "
        f"{row['acceptance']}; natural agreement of drafts and verify "
        f"{'-' if row['agreement'] is None else format(row['agreement'], '.1%')})")
    print(f"{row['layers']} layers, {row['quantization'] or 'unquantised'}, backend {row['backend']}{spec}: prompt "
          f"{row['prompt_len']}, output {row['output_len']}, {row['repeats']} timed runs after {row['warmup']} warm-up")
    step = "" if row["spec"] == "none" else (f" · spec step median {row['step_ms_median']:.3f} ms (first run: "
                                             f"{row['steps_run'][0]} steps run, {row['verify_steps'][0]} emitting)")
    print(f"  TTFT {row['ttft_ms']:.1f} ms · TPOT median {row['tpot_ms_median']:.3f} ms (mean "
          f"{row['tpot_ms_mean']:.3f}) · {row['output_tokens_per_s']:.0f} tok/s{step}")
    print(f"  bytes per token {row['bytes_per_token'] / gb:.2f} GB, floor {row['floor_ms']:.3f} ms at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s: {row['frac_of_floor']:.1%} of it"
          + (f" · {row['kernels_per_step']} kernels per step" if "kernels_per_step" in row else "")
          + (f" · peak device memory {row['peak_memory_bytes'] / 2**30:.1f} GiB" if row.get("peak_memory_bytes")
             else ""))
    if "breakdown" in row:
        print_breakdown(row["breakdown"])
    if "spec_profile" in row:
        from ling_jax.spec_profile import print_spec_summary
        print_spec_summary(row["spec_profile"], row["num_draft"])
    print(f"  beside SGLang ({SGLANG_HARDWARE}; ours: {jax.devices()[0].device_kind} x {row.get('tp', 1)}):")
    for r in SGLANG_ROWS:
        accept = f", accept length {r['accept_length']}" if r["accept_length"] else ""
        print(f"    {r['config']:42s} TPOT {r['tpot_ms']:.2f} ms{accept}")
