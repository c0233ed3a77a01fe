"""`ling-jax bench`: its options, their checks against the model's config, the weights (a checkpoint or random,
drawn on the device), and where the result row is written. The measurement itself is ling_jax.bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ling_jax.cli_common import (DEFAULT_DRAFTS, DTYPES, FP8, MAX_DRAFTS, PREFILL_CHUNK, _add_fp8_activations,
                                 _add_processes, _add_tp, _add_weights_source, _apply_fp8_activations, _check_backend,
                                 _check_backend_fits, _check_memory, _check_processes, _check_tp, _in_mesh,
                                 _is_main_process, _mesh, _param_shardings, _start_processes, _weights_config)

RESULTS_NAME = "bench_<model>_<dtype>[_<spec><K>][_tp<N>].json"


def _add_bench(b: argparse.ArgumentParser) -> None:
    _add_weights_source(b, "a preset's exact widths with random weights (needs --random-weights): ling-3.0-flash, "
                           "ling-3.0-tiny, toy (default: ling-3.0-flash, when no checkpoint is given)",
                        "with --preset: weights drawn leaf by leaf on the device (nothing on the host)",
                        "the preset's last N layers only, at its exact widths, no MTP layer (default: all, MTP layer "
                        "included)")
    b.add_argument("--dtype", choices=DTYPES + (FP8,), default="bfloat16",
                   help="weights and compute: bfloat16, float32, or fp8 (block-FP8 weights, bf16 activations)")
    b.add_argument("--prompt-len", type=int, default=8192, metavar="N", help="random prompt tokens (SGLang's 8192)")
    b.add_argument("--output-len", type=int, default=1024, metavar="N", help="output tokens, EOS ignored")
    b.add_argument("--backend", default="fast", metavar="SPEC", help="as `generate --backend`")
    _add_fp8_activations(b)
    b.add_argument("--block-size", type=int, default=16, metavar="N", help="decode steps per jitted block")
    b.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="C", help="as `generate`'s")
    b.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed generations first (excluded)")
    b.add_argument("--repeats", type=int, default=3, metavar="N", help="timed generations")
    b.add_argument("--profile", action="store_true",
                   help="device time per op family (JAX profiler); with --spec of the speculative step, beside the "
                        "verify forward alone and the plain decode step")
    b.add_argument("--no-kernel-count", action="store_true",
                   help="skip counting the kernels of a step (one more compilation, served by a cache)")
    b.add_argument("--device-memory-gb", type=float, default=None, metavar="G",
                   help="the usable device memory the plan checks against (default: what the runtime reports "
                        "JAX may allocate; the CPU reports none, so no check)")
    b.add_argument("--seed", type=int, default=0, metavar="S", help="prompt and weight seed")
    b.add_argument("--spec", choices=("none", "oracle", "mtp", "suffix"), default="none",
                   help="speculative decoding: oracle (planned acceptance, a timing mode: the model's own greedy "
                        "output as drafts, --accept-length's count kept each step whatever the verify says), mtp "
                        "(the NextN layer), suffix (model-free)")
    b.add_argument("--num-draft", type=int, default=DEFAULT_DRAFTS, metavar="K", help="drafts per verify step")
    b.add_argument("--accept-length", type=float, default=None, metavar="A",
                   help="--spec oracle: the mean accept length to plan, 1..K+1 (default: every draft accepted)")
    b.add_argument("--json", action="store_true", help="print the result row as one JSON object")
    b.add_argument("--results", metavar="PATH", default=None,
                   help="where the row is written as JSON: a file, or a directory to hold the default name (default: "
                        f"{RESULTS_NAME} in the current directory; <dtype> is fp8 for block-FP8 weights, fp8_w8a8 "
                        "with --fp8-activations)")
    _add_tp(b, "as `generate --tp`; the memory plan counts each device's share")
    _add_processes(b)


def _bench(args, parser) -> int:
    _check_bench_options(args, parser)
    # Before JAX starts: the full FP8 model does not fit in JAX's default 75 % of an H200.
    from ling_jax.memory import BENCH_MEM_FRACTION
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(BENCH_MEM_FRACTION))
    from ling_jax import bench

    cfg = _weights_config(args, parser, "ling-3.0-flash", "bench all of them, the MTP layer included")
    _check_bench_fits(args, cfg, parser)
    results = _results_path(args, cfg, parser)
    _start_processes(args, parser)
    mesh = _mesh(args, parser, cfg)
    _check_bench_memory(args, cfg)
    with _in_mesh(mesh):
        cfg, params = _bench_weights(args, cfg, mesh)
        row = bench.bench(params, cfg, prompt_len=args.prompt_len, output_len=args.output_len, backend=args.backend,
                          block_size=args.block_size, warmup=args.warmup, repeats=args.repeats,
                          prefill_chunk=args.prefill_chunk, count_kernels=not args.no_kernel_count,
                          profile=args.profile, seed=args.seed, progress=not args.json and _is_main_process(),
                          spec=args.spec, num_draft=args.num_draft, accept_length=args.accept_length)
    row = dict(model=_bench_name(args, cfg), dtype=args.dtype, tp=args.tp, **row, **bench.run_header())
    if not _is_main_process():
        return 0
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(row, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}, default=str))
    else:
        bench.print_row(row)
    print(f"ling-jax bench: wrote {results}", file=sys.stderr)
    return 0


def _check_bench_options(args, parser) -> None:
    """The options on their own, before JAX starts."""
    for option, value, least in (("--prompt-len", args.prompt_len, 1), ("--output-len", args.output_len, 2),
                                 ("--block-size", args.block_size, 1), ("--prefill-chunk", args.prefill_chunk, 1),
                                 ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1)):
        if value < least:
            parser.error(f"{option} {value} must be >= {least}")
    _check_tp(args, parser)
    _check_processes(args, parser)
    if not 1 <= args.num_draft <= MAX_DRAFTS:
        parser.error(f"--num-draft {args.num_draft} must lie in 1..{MAX_DRAFTS}")
    if args.accept_length is not None and (args.spec != "oracle" or not 1 <= args.accept_length <= args.num_draft + 1):
        parser.error(f"--accept-length {args.accept_length} goes with --spec oracle and lies in 1..--num-draft + 1 = "
                     f"{args.num_draft + 1}")
    from_checkpoint = args.checkpoint or args.hf_dir
    if from_checkpoint and (args.random_weights or args.layers is not None):
        parser.error("--random-weights and --layers go with --preset; a checkpoint benches its own weights")
    if not from_checkpoint and not args.random_weights:
        parser.error("--preset benches random weights: pass --random-weights to say so (or --checkpoint DIR / "
                     "--hf-dir DIR for real ones)")
    _check_backend(args.backend, parser)


def _check_bench_fits(args, cfg, parser) -> None:
    """The options against the model's config: the drafter, the kernels' sizes, and the positions the workload
    needs (the prompt, the output and, speculating, the K + 1 a verify step runs past the last token)."""
    if args.spec == "mtp" and not cfg.num_mtp_layers:
        parser.error("--spec mtp drafts with the MTP layer, which this model has not (a --layers slice drops it): "
                     "bench all layers, or use --spec oracle or suffix")
    _apply_fp8_activations(args, cfg, parser)
    _check_backend_fits(args.backend, cfg, parser)
    extra = args.num_draft + 1 if args.spec != "none" else 0
    limit = cfg.max_position_embeddings
    if args.prompt_len + args.output_len + extra <= limit:
        return
    room = limit - args.output_len - extra
    fix = (f"pass --prompt-len {room} or less" if room >= 1 else
           f"pass --output-len {limit - extra - 1} or less and a --prompt-len that fits beside it")
    plus = f" + --num-draft {args.num_draft} + 1" if extra else ""
    parser.error(f"--prompt-len {args.prompt_len} + --output-len {args.output_len}{plus} exceeds the model's "
                 f"max_position_embeddings={limit}: {fix} (SGLang's 8192 + 1024 needs a model with more positions, "
                 "such as --preset ling-3.0-flash)")


def _check_bench_memory(args, cfg) -> None:
    _check_memory(cfg, args.dtype, args.prompt_len, args.output_len, args.prefill_chunk,
                  with_mtp=bool(cfg.num_mtp_layers), device_gb=args.device_memory_gb, devices=args.tp)


def _bench_weights(args, cfg, mesh):
    import jax

    from ling_jax import bench

    dtype = bench.compute_dtype(args.dtype)
    shardings = _param_shardings(mesh, cfg)
    if args.checkpoint:
        from conversion.orbax_io import load_params
        return load_params(args.checkpoint, dtype=dtype, shardings=shardings)
    if args.hf_dir:
        from conversion.load import load_hf
        return load_hf(args.hf_dir, dtype=dtype, fp8=True if args.dtype == FP8 else None, shardings=shardings,
                       progress=_is_main_process())
    from ling_jax.params import init_params

    if shardings is None:  # drawn on the device, leaf by leaf: the host never holds the model
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, _abstract(cfg, dtype))
    params = init_params(cfg, jax.random.key(args.seed), dtype, with_mtp=bool(cfg.num_mtp_layers),
                         shardings=shardings)
    return cfg, jax.block_until_ready(params)


def _abstract(cfg, dtype):
    from ling_jax.params import abstract_params
    return abstract_params(cfg, dtype, with_mtp=bool(cfg.num_mtp_layers))


def _bench_name(args, cfg) -> str:
    if args.checkpoint or args.hf_dir:
        return Path(args.checkpoint or args.hf_dir).name
    return (args.preset or "ling-3.0-flash") + (f"-{cfg.num_layers}layers" if args.layers else "")


def _results_path(args, cfg, parser) -> Path:
    """The file the row goes to (RESULTS_NAME in the current directory, or --results: a file, or a directory for
    that name), checked writable before anything runs."""
    spec = "" if args.spec == "none" else f"_{args.spec}{args.num_draft}"
    tp = "" if args.tp == 1 else f"_tp{args.tp}"
    dtype = (cfg.quantization or args.dtype) + ("_w8a8" if args.fp8_activations else "")
    name = f"bench_{_bench_name(args, cfg)}_{dtype}{spec}{tp}.json"
    given = Path(args.results) if args.results else Path.cwd()
    target = given / name if given.is_dir() or not args.results or args.results.endswith(os.sep) else given
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        why = None if os.access(target.parent, os.W_OK) else "not writable"
    except OSError as e:
        why = "a file, not a directory" if target.parent.is_file() else e.strerror
    if why:
        parser.error(f"--results {target}: {target.parent} cannot hold it ({why}): pass --results PATH in a "
                     "writable directory")
    return target
