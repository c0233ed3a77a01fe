"""`ling-jax` command line: convert | generate | bench | crosscheck | layercheck.

    ling-jax convert --hf-dir DIR --out DIR [--dtype bfloat16|float32|fp8] [--router-fp32] [--no-mtp] [--force]
                     [--tp N]
    ling-jax generate (--checkpoint DIR | --hf-dir DIR | --preset NAME)
                      (--prompt-ids 1,2,3 | --prompt TEXT --tokenizer tokenizer.json) --max-new-tokens N
                      [--temperature T --top-p P --seed S] [--dtype float32|bfloat16|fp8] [--backend SPEC]
                      [--block-size N] [--prefill-chunk C] [--ignore-eos] [--json] [--tp N]
                      [--coordinator HOST:PORT --num-processes P --process-id I]
    ling-jax bench (--preset NAME --random-weights | --checkpoint DIR | --hf-dir DIR) [--layers N]
                   [--dtype bfloat16|float32|fp8] [--prompt-len 8192] [--output-len 1024] [--profile] [--json]
                   [--results PATH] [--tp N] [--coordinator HOST:PORT --num-processes P --process-id I]
    ling-jax crosscheck --hf-dir DIR [--checkpoint ORBAX] [--prompt-ids 1,2,3 | --prompt TEXT --tokenizer FILE]
                        [--dtype float32|bfloat16] [--layers A:B] [--decode-steps N] [--backend SPEC]
                        [--torch-device auto|cpu|cuda] [--json]
    ling-jax layercheck (--preset NAME --random-weights | --checkpoint DIR | --hf-dir DIR) [--layers N]
                        [--compare verify-vs-decode|backends] [--path verify|decode] [--backend SPEC]
                        [--dtype float32|bfloat16|fp8] [--activations float32|bfloat16]
                        [--prompt-ids 1,2,3 | --prompt-len N] [--num-draft K | --verify-ids 1,2,3] [--seed S]
                        [--tolerance X] [--json]

`bench` lives in ling_jax/bench_cli.py, `layercheck` in ling_jax/layercheck_cli.py, what the subcommands share in
ling_jax/cli_common.py.

`crosscheck` runs transformers' model and ling-jax side by side, layer by layer (ling_jax.crosscheck.stream):
transformers always reads --hf-dir, ling-jax --checkpoint when given (checked to hold --hf-dir's weights: its config
and norm scales), else --hf-dir. Exit status 0 when every check is within its tolerance, 1 when one is not, 2 for a
bad option or checkpoint.

`layercheck` compares, layer by layer, the verify forward over K + 1 positions with K + 1 sequential decode steps,
or one path on --backend with the same path on the reference (ling_jax.layercheck); exit status as `crosscheck`'s.

`--tp N` shards the model over N devices (ling_jax.sharding: heads, intermediate dims and the vocabulary split).
With `--coordinator`, one process runs per host, `jax.distributed` joins them, and the mesh spans every process's
devices; process 0 prints and writes the results.

With no arguments, `generate` runs the embedded default: the `toy` preset with random weights, a fixed prompt and
64 new tokens.

Every bad input is refused with one line naming the option and the fix, before any weight loads: `generate` reads
the model's config first (preset, config.json), checks the prompt against it, and only then loads the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ling_jax.bench_cli import _add_bench, _bench
from ling_jax.cli_common import (DEFAULT_DRAFTS, DTYPES, FP8, HF_DIR_HELP, MAX_DRAFTS, PREFILL_CHUNK,
                                 _add_fp8_activations, _add_processes, _add_tp, _apply_fp8_activations,
                                 _bad_input_errors, _check_backend, _check_backend_fits,
                                 _check_checkpoint_fp8, _check_memory, _check_processes, _check_tp,
                                 _checkpoint_config, _DefaultsFormatter, _hf_config, _id_list, _in_mesh,
                                 _is_main_process, _mesh, _model_config, _param_shardings, _Parser, _start_processes)
from ling_jax.layercheck_cli import _add_layercheck, _layercheck

DEFAULT_PROMPT_IDS = "7,41,3,99,12,250,18,5,77,301,64,9"
# Warm-ups added when the timed run after --warmup still compiled (a cache key that changed after the first call).
EXTRA_WARMUPS = 3
SPEC_CHOICES = ("none", "oracle", "mtp", "suffix", "model")
CROSSCHECK_DECODE_STEPS = 32


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ling-jax", description=__doc__.split("\n\n")[0], formatter_class=_DefaultsFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_convert(sub.add_parser("convert", help="HF safetensors checkpoint -> ling-jax (orbax) checkpoint",
                                formatter_class=_DefaultsFormatter))
    _add_generate(sub.add_parser("generate", help="generate tokens", formatter_class=_DefaultsFormatter))
    _add_bench(sub.add_parser("bench", help="batch-1 TTFT / TPOT on SGLang's workload (8192 in, 1024 out)",
                              formatter_class=_DefaultsFormatter))
    _add_crosscheck(sub.add_parser("crosscheck", formatter_class=_DefaultsFormatter,
                                            help="ling-jax against transformers on a checkpoint, layer by layer"))
    _add_layercheck(sub.add_parser("layercheck", formatter_class=_DefaultsFormatter,
                                   help="verify forward against sequential decode (or a backend against the "
                                        "reference), layer by layer"))
    return parser


def _add_convert(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("--hf-dir", required=True, metavar="DIR", help=f"{HF_DIR_HELP} (required)")
    conv.add_argument("--out", required=True, metavar="DIR",
                      help="output directory for the ling-jax (orbax) checkpoint (required)")
    conv.add_argument("--dtype", choices=DTYPES + (FP8,), default=None,
                      help="dtype of the compute params (default: as stored in the safetensors, block-FP8 kept; "
                           "the float32-class ones, e.g. A_log and dt_bias, stay float32). fp8: the decoder layers' "
                           "linear weights quantised to block-FP8 as the -fp8 release is, the rest bfloat16; "
                           "bfloat16 or float32 on an FP8 checkpoint dequantise it")
    conv.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    conv.add_argument("--force", action="store_true", help="overwrite an existing --out checkpoint")
    conv.add_argument("--router-fp32", action="store_true",
                      help="widen bf16-stored MoE routers to float32 (same logits, twice the router bytes); by "
                           "default they stay as stored")
    _add_tp(conv, "convert into the shards of an N-device mesh, so no device holds the whole model (the "
                  "checkpoint loads at any --tp)")


def _add_generate(gen: argparse.ArgumentParser) -> None:
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="ling-jax (orbax) checkpoint written by `ling-jax convert` (default: none, so --preset)")
    src.add_argument("--hf-dir", metavar="DIR", help=f"{HF_DIR_HELP}, read on the fly (default: none, so --preset)")
    src.add_argument("--preset", metavar="NAME",
                     help="random weights for a preset: toy, ling-3.0-tiny, ling-3.0-flash (default: toy, when "
                          "neither --checkpoint nor --hf-dir is given)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", metavar="IDS",
                        help=f"comma-separated token ids, e.g. 1,2,3 (default: {DEFAULT_PROMPT_IDS})")
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="prompt text, encoded with --tokenizer (default: none, so --prompt-ids)")
    gen.add_argument("--tokenizer", metavar="FILE",
                     help="tokenizer.json for --prompt and for decoding the output (default: none, so the output "
                          "is printed as token ids)")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling mass in (0, 1]; needs --temperature > 0")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (and weight seed for --preset)")
    gen.add_argument("--dtype", choices=DTYPES + (FP8,), default=None,
                     help="compute dtype (default: float32 for --preset; the dtype stored in the safetensors for "
                          "--hf-dir; the dtype stored in the checkpoint for --checkpoint); fp8: block-FP8 weights "
                          "(quantised from --hf-dir, random for --preset) with bfloat16 activations")
    gen.add_argument("--backend", default="reference", metavar="SPEC",
                     help="reference | pallas | fast (per op, the faster on the H200) | per op, e.g. "
                          "kda=pallas,moe_decode=pallas (ling_jax/backends.py)")
    _add_fp8_activations(gen)
    gen.add_argument("--block-size", type=int, default=16, metavar="N", help="decode steps per jitted block")
    gen.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="C",
                     help="prompt tokens per prefill forward: a longer prompt is prefilled in chunks of C, so the "
                          "MoE's activations scale with C, not with the prompt (smaller chunks cost time)")
    gen.add_argument("--ignore-eos", action="store_true", help="always produce --max-new-tokens tokens")
    gen.add_argument("--warmup", type=int, default=1, metavar="N",
                     help="untimed runs first, so the reported times exclude compilation (should the timed run "
                          f"still compile, up to {EXTRA_WARMUPS} more follow, and stderr says if it never settles)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, ttft_ms, tpot_ms (SGLang's "
                     "(latency - TTFT) / (tokens - 1); null for one token), tokens_per_s (with --spec also "
                     "accept_length, verify_steps, drafted, accepted)")
    spec = gen.add_argument_group(
        "speculative decoding", "Lossless: greedy output equals plain greedy token for token in float32. In bfloat16 "
        "the verify and decode programs round differently, so a near-tie can resolve differently and the tokens "
        "can drift from plain greedy after a few steps (XLA_FLAGS=--xla_allow_excess_precision=false narrows it).")
    spec.add_argument("--spec", choices=SPEC_CHOICES, default="none",
                      help="drafter: none (plain decode), oracle (replays --oracle-ids), mtp (the checkpoint's NextN "
                           "layer), suffix (model-free, from the prompt and output), model (--draft-checkpoint)")
    spec.add_argument("--num-draft", type=int, default=None, metavar="K",
                      help=f"drafts per verify step, 1..{MAX_DRAFTS} (default: {DEFAULT_DRAFTS} with --spec)")
    spec.add_argument("--draft-checkpoint", metavar="DIR",
                      help="the draft model for --spec model: a ling-jax checkpoint or an HF directory sharing the "
                           "target's vocabulary (default: none)")
    spec.add_argument("--oracle-ids", metavar="IDS",
                      help="the continuation --spec oracle replays, comma-separated ids from the first new token "
                           "on (default: none)")
    _add_tp(gen, "the model sharded over a mesh of N devices (with --coordinator: every process's devices)")
    _add_processes(gen)


def _check_numbers(args, parser) -> None:
    for option, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--block-size", args.block_size, 1),
                                 ("--prefill-chunk", args.prefill_chunk, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{option} {value} must be >= {least}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature {args.temperature} must be a number >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p {args.top_p} must lie in (0, 1]: 1 keeps the whole distribution")
    if args.temperature == 0 and args.top_p != 1:
        parser.error(f"--top-p {args.top_p} has no effect with --temperature 0 (greedy): drop --top-p or pass "
                     "--temperature > 0")


def _load_tokenizer(path, parser):
    if path is None:
        return None
    if not Path(path).is_file():
        parser.error(f"--tokenizer {path} {'is a directory' if Path(path).is_dir() else 'does not exist'}: pass the "
                     "tokenizer.json file that comes with the checkpoint")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        parser.error("--tokenizer needs the `tokenizers` package (pip install tokenizers)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own exception types
        parser.error(f"--tokenizer {path} is not a tokenizer.json ({e}): pass the tokenizer.json file that comes "
                     "with the checkpoint")


def _prompt_ids(args, parser, tokenizer) -> list[int]:
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt).ids
        if not ids:
            parser.error(f"--prompt {args.prompt!r} encodes to no tokens: pass a prompt with some text")
        return ids
    return _id_list(args.prompt_ids if args.prompt_ids is not None else DEFAULT_PROMPT_IDS, "--prompt-ids", parser)


def _check_prompt_fits(ids: list[int], args, cfg, parser) -> None:
    option = "--prompt" if args.prompt is not None else "--prompt-ids"
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        fix = ("--tokenizer belongs to another model" if args.prompt is not None
               else f"pass ids in [0, {cfg.vocab_size})")
        parser.error(f"{option}: token ids {bad[:5]} lie outside the model's vocabulary [0, {cfg.vocab_size}): {fix}")
    limit = cfg.max_position_embeddings
    # A verify step runs K + 1 positions past the last committed token, so speculation needs that much room.
    extra = args.num_draft + 1 if args.spec != "none" else 0
    if len(ids) + args.max_new_tokens + extra > limit:
        room = limit - len(ids) - extra
        fix = f"pass --max-new-tokens {room} or fewer" if room >= 1 else f"shorten {option}"
        plus = f" + --num-draft {args.num_draft} + 1" if extra else ""
        parser.error(f"the prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens}{plus} exceeds the "
                     f"model's max_position_embeddings={limit}: {fix}")


def _load_weights(args, cfg, mesh):
    """(cfg, params) as the options say, each leaf loaded straight into its shard on `mesh` (if any). `cfg` already
    says whether the weights are block-FP8 (`_weights_config`)."""
    import jax
    import jax.numpy as jnp

    dtype = None if args.dtype is None else jnp.dtype(jnp.bfloat16 if args.dtype == FP8 else args.dtype)
    with_mtp = args.spec == "mtp"
    # An orbax checkpoint restores every stored leaf, the MTP layer included, so its shardings must cover them all.
    shardings = _param_shardings(mesh, cfg, with_mtp=with_mtp or bool(args.checkpoint))
    if args.checkpoint:
        from conversion.orbax_io import load_params
        return load_params(args.checkpoint, dtype=dtype, shardings=shardings)
    if args.hf_dir:
        from conversion.load import load_hf
        return load_hf(args.hf_dir, dtype=dtype, with_mtp=with_mtp, fp8=True if args.dtype == FP8 else None,
                       shardings=shardings, progress=_is_main_process())
    from ling_jax.params import init_params

    if _is_main_process():
        print(f"ling-jax generate: random weights (preset {args.preset or 'toy'}), so the tokens mean nothing; for a "
              "real model pass --checkpoint DIR (from `ling-jax convert`) or --hf-dir DIR", file=sys.stderr)
    return cfg, init_params(cfg, jax.random.key(args.seed), dtype or jnp.float32, with_mtp=with_mtp,
                            shardings=shardings)


def _weights_config(args, cfg):
    """`cfg` as the loaded weights will be: block-FP8 with --dtype fp8 (an HF checkpoint or a preset is quantised;
    an orbax one must be already), else as stored."""
    return cfg.replace(quantization="fp8") if args.dtype == FP8 else cfg


def _generate(args, parser) -> int:
    _check_numbers(args, parser)
    _check_tp(args, parser)
    _check_processes(args, parser)
    _check_backend(args.backend, parser)
    if args.prompt is not None and args.tokenizer is None:
        parser.error("--prompt needs --tokenizer tokenizer.json (or pass --prompt-ids)")
    tokenizer = _load_tokenizer(args.tokenizer, parser)
    ids = _prompt_ids(args, parser, tokenizer)
    _check_spec_options(args, parser)
    cfg = _model_config(args, parser)
    _apply_fp8_activations(args, cfg, parser)
    _check_backend_fits(args.backend, _weights_config(args, cfg), parser)
    _check_prompt_fits(ids, args, cfg, parser)
    draft_cfg = _check_spec_model(args, cfg, parser)
    _check_checkpoint_fp8(args, cfg, parser)
    cfg = _weights_config(args, cfg)
    _start_processes(args, parser)
    mesh = _mesh(args, parser, cfg, *([draft_cfg] if draft_cfg is not None else []))
    _check_memory(cfg, args.dtype or ("float32" if not (args.checkpoint or args.hf_dir) else "bfloat16"),
                  len(ids), args.max_new_tokens, args.prefill_chunk, with_mtp=args.spec == "mtp", devices=args.tp)

    from ling_jax.engine.generate import generate
    from ling_jax.engine.sampling import make_sampler
    sampler = make_sampler(args.temperature, args.top_p)
    with _in_mesh(mesh):
        cfg, params = _load_weights(args, cfg, mesh)
        if args.spec == "none":
            run = lambda: generate(params, cfg, [ids], max_new_tokens=args.max_new_tokens,  # noqa: E731
                                   sampler=sampler, seed=args.seed, backend=args.backend,
                                   block_size=args.block_size, ignore_eos=args.ignore_eos,
                                   prefill_chunk=args.prefill_chunk)
        else:
            run = _speculative_run(args, cfg, params, draft_cfg, ids, sampler, mesh)
        result = _timed_run(run, args.warmup)
    if not _is_main_process():
        return 0
    if result.compiles:
        print(f"ling-jax generate: the timed run compiled {result.compiles} executable(s), so its times include "
              "compilation" + ("; pass --warmup 1 or more" if not args.warmup else ""), file=sys.stderr)
    _print_generation(args, result, tokenizer)
    return 0


def _print_generation(args, result, tokenizer) -> None:
    """The tokens and their times: one JSON object, or the text (or ids) on stdout and the times on stderr. A
    single token has no decode step, so no TPOT (and no accept length): null in JSON, n/a in the text."""
    tokens = result.tokens[0]
    tpot = None if result.tpot_s is None else 1e3 * result.tpot_s
    timing = dict(ttft_ms=1e3 * result.ttft_s, tpot_ms=tpot, tokens_per_s=result.tokens_per_s)
    if args.spec != "none":
        timing |= dict(accept_length=result.accept_length, verify_steps=result.verify_steps, drafted=result.drafted,
                       accepted=result.accepted)
    if args.json:
        print(json.dumps(dict(tokens=tokens, **timing)))
        return
    print(tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens)))
    spec = ""
    if args.spec != "none":
        accept = timing["accept_length"]
        spec = f" | spec {args.spec} k={args.num_draft}: accept length {'n/a' if accept is None else f'{accept:.2f}'}"
    print(f"[{len(tokens)} tokens | TTFT {timing['ttft_ms']:.1f} ms | TPOT "
          f"{'n/a' if tpot is None else f'{tpot:.2f} ms'} | {timing['tokens_per_s']:.1f} tok/s | backend {args.backend}"
          f"{spec}]", file=sys.stderr)


def _timed_run(run, warmup: int):
    """`warmup` untimed runs, then the timed one, repeated (up to EXTRA_WARMUPS times) while it still compiled."""
    for _ in range(warmup):
        run()
    result = run()
    for _ in range(EXTRA_WARMUPS if warmup else 0):  # the times must exclude compilation
        if not result.compiles:
            break
        result = run()
    return result


def _check_spec_options(args, parser) -> None:
    """The speculative options that go together, checked before anything loads."""
    if args.spec == "none":
        for option, value in (("--num-draft", args.num_draft), ("--draft-checkpoint", args.draft_checkpoint),
                              ("--oracle-ids", args.oracle_ids)):
            if value is not None:
                parser.error(f"{option} needs --spec (it has no effect on plain decoding): pass --spec "
                             f"{'model' if option == '--draft-checkpoint' else 'oracle' if option == '--oracle-ids' else 'mtp|suffix|oracle|model'}"
                             " or drop it")
        return
    args.num_draft = DEFAULT_DRAFTS if args.num_draft is None else args.num_draft
    if not 1 <= args.num_draft <= MAX_DRAFTS:
        parser.error(f"--num-draft {args.num_draft} must lie in 1..{MAX_DRAFTS} (a verify step runs K + 1 tokens "
                     "through the verify kernels)")
    if (args.spec == "oracle") != (args.oracle_ids is not None):
        parser.error("--spec oracle replays the continuation given by --oracle-ids 1,2,3 (e.g. a plain greedy "
                     "run's tokens): pass both or neither")
    if (args.spec == "model") != (args.draft_checkpoint is not None):
        parser.error("--spec model drafts with the model in --draft-checkpoint DIR: pass both or neither")
    if args.oracle_ids is not None:
        args.oracle = _id_list(args.oracle_ids, "--oracle-ids", parser)


def _check_spec_model(args, cfg, parser):
    """Config-level checks of the drafter against the target (before any weight): the draft model's config, the
    MTP layer's presence, the oracle's ids. Returns the draft model's config for --spec model."""
    if args.spec == "mtp" and not _has_mtp(args, cfg):
        parser.error("--spec mtp drafts with the checkpoint's NextN (MTP) layer, and this model has none "
                     f"(num_nextn_predict_layers={cfg.num_mtp_layers}, or no model.layers.{cfg.num_layers}.* "
                     "tensors): choose --spec suffix or --spec model")
    if args.spec == "oracle":
        bad = [t for t in args.oracle if not 0 <= t < cfg.vocab_size]
        if bad:
            parser.error(f"--oracle-ids {bad[:5]} lie outside the vocabulary [0, {cfg.vocab_size})")
    if args.spec != "model":
        return None
    path = args.draft_checkpoint
    draft_cfg = _draft_config(path, parser)
    if draft_cfg.vocab_size != cfg.vocab_size:
        parser.error(f"--draft-checkpoint {path} has vocab_size={draft_cfg.vocab_size} but the target has "
                     f"{cfg.vocab_size}: a draft model must share the target's tokenizer")
    return draft_cfg


def _draft_config(path: str, parser):
    from conversion.load import CheckpointError
    from conversion.orbax_io import is_hf_checkpoint, read_config
    from ling_jax.config import ConfigError, from_hf

    if not Path(path).is_dir():
        parser.error(f"--draft-checkpoint {path} does not exist: pass the draft model's ling-jax checkpoint or HF "
                     "directory")
    try:
        return from_hf(path) if is_hf_checkpoint(path) else read_config(path)
    except (CheckpointError, ConfigError) as e:
        parser.error(f"--draft-checkpoint: {e}")


def _has_mtp(args, cfg) -> bool:
    if not cfg.num_mtp_layers:
        return False
    if args.hf_dir:  # transformers' save_pretrained drops the MTP tensors and keeps the config's count
        from conversion.load import has_mtp_tensors, read_catalog
        return has_mtp_tensors(read_catalog(args.hf_dir)[0], cfg)
    return True


def _speculative_run(args, cfg, params, draft_cfg, ids, sampler, mesh):
    import jax.numpy as jnp

    from ling_jax.engine import drafters
    from ling_jax.engine.speculative import generate_speculative

    aux = None
    if args.spec == "oracle":
        cont = jnp.asarray([args.oracle], jnp.int32)
        drafter, aux = drafters.OracleDrafter(), (cont, jnp.zeros(cont.shape, bool))
    elif args.spec == "mtp":
        drafter = drafters.MTPDrafter()
    elif args.spec == "suffix":
        drafter = drafters.Suffix()
    else:
        draft_cfg, aux = _load_draft(args.draft_checkpoint, params, _param_shardings(mesh, draft_cfg))
        drafter = drafters.ModelDrafter(draft_cfg, backend=args.backend)
    return lambda: generate_speculative(params, cfg, [ids], max_new_tokens=args.max_new_tokens, sampler=sampler,
                                        drafter=drafter, k=args.num_draft, aux=aux, seed=args.seed,
                                        backend=args.backend, block_size=args.block_size,
                                        ignore_eos=args.ignore_eos, prefill_chunk=args.prefill_chunk)


def _load_draft(path: str, params, shardings):
    from conversion.orbax_io import is_hf_checkpoint

    dtype = params["embed"].dtype  # the draft model computes in the target's dtype
    if is_hf_checkpoint(path):
        from conversion.load import load_hf
        return load_hf(path, dtype=dtype, with_mtp=False, shardings=shardings)
    from conversion.orbax_io import load_params
    return load_params(path, dtype=dtype, shardings=shardings)


def _convert(args, parser) -> int:
    cfg = _hf_config(args.hf_dir, parser, orbax_fix=f"it is converted already: `ling-jax generate --checkpoint "
                                                    f"{args.hf_dir}` runs it")
    from conversion.orbax_io import PARAMS_DIR, convert

    if Path(args.out).resolve() == Path(args.hf_dir).resolve():
        parser.error(f"--out {args.out} is the --hf-dir: converting would overwrite its config.json; choose another "
                     "--out")
    if (Path(args.out) / PARAMS_DIR).exists() and not args.force:
        parser.error(f"--out {args.out} already holds a ling-jax checkpoint: pass --force to overwrite it, or "
                     "choose another --out")
    _check_tp(args, parser)
    import jax.numpy as jnp

    dtype = {None: None, FP8: jnp.bfloat16}.get(args.dtype, args.dtype)
    fp8 = None if args.dtype is None else args.dtype == FP8
    if fp8 is not None:  # quantised or dequantised while loading: the shardings are those of the leaves written
        cfg = cfg.replace(quantization="fp8" if fp8 else None)
    mesh = _mesh(args, parser, cfg)
    convert(args.hf_dir, args.out, dtype=None if dtype is None else jnp.dtype(dtype), with_mtp=not args.no_mtp,
            force=args.force, router_weight_dtype="float32" if args.router_fp32 else None, fp8=fp8,
            shardings=_param_shardings(mesh, cfg))
    print(f"wrote {args.out}")
    return 0


def _add_crosscheck(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, metavar="DIR",
                   help="the HF checkpoint (config.json + *.safetensors); transformers always reads it")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a ling-jax (orbax) checkpoint converted from --hf-dir, for the ling-jax side; its config "
                        "and its norm weights are compared with --hf-dir's first (default: --hf-dir)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids (default: a fixed 12-token "
                        "prompt)")
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text, encoded with --tokenizer")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json for --prompt")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32: both sides in float32, each layer within 1e-5; bfloat16: ling-jax in bf16 against "
                        "transformers in float32, within 3x transformers' own bf16 error")
    p.add_argument("--layers", metavar="A:B", help="check layers A..B-1 only: layers before A still run on both "
                   "sides, layers from B on do not (default: every layer)")
    p.add_argument("--decode-steps", type=int, default=CROSSCHECK_DECODE_STEPS, metavar="N",
                   help="greedy decode steps through both sides' caches; each one streams every layer again")
    p.add_argument("--backend", default="reference", metavar="SPEC",
                   help="ling-jax's ops: reference, pallas, fast, or per op (as `ling-jax generate`)")
    p.add_argument("--torch-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where transformers runs (auto: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per-layer rows included)")


def _crosscheck(args, parser) -> int:
    """`ling-jax crosscheck`: check the options, stream both models through the prompt (ling_jax.crosscheck.stream),
    print the report; 0 when every check is within tolerance, 1 otherwise. The option checks import neither JAX nor
    torch."""
    if args.decode_steps < 0:
        parser.error(f"--decode-steps {args.decode_steps} must be >= 0")
    if args.prompt is not None and args.tokenizer is None:
        parser.error("--prompt needs --tokenizer FILE (the checkpoint's tokenizer.json), or pass --prompt-ids")
    # JAX would otherwise take most of an accelerator's memory up front, leaving none to torch.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cfg = _hf_config(args.hf_dir, parser, orbax_fix=f"pass it as --checkpoint {args.hf_dir} and the HF "
                                                     "checkpoint it came from as --hf-dir")
    if args.checkpoint:
        _check_same_model(cfg, _checkpoint_config(args.checkpoint, parser), args, parser)
    window = _layer_window(args.layers, cfg.num_layers, parser)
    ids = _prompt_ids(args, parser, _load_tokenizer(args.tokenizer, parser))
    if max(ids) >= cfg.vocab_size or min(ids) < 0:
        parser.error(f"prompt ids lie in [{min(ids)}, {max(ids)}] but the vocabulary is [0, {cfg.vocab_size}): pass "
                     "ids of this model's tokenizer")
    _check_backend(args.backend, parser)
    _check_backend_fits(args.backend, cfg, parser)
    try:
        from ling_jax import crosscheck
        crosscheck.import_reference_model()
    except ImportError as e:
        parser.error(str(e))
    report = _crosscheck_stream(args, window, ids, parser)
    print(json.dumps(report.as_dict()) if args.json else report.format())
    return 0 if report.ok else 1


def _crosscheck_stream(args, window, ids, parser):
    import jax.numpy as jnp
    import torch

    from conversion.load import CheckpointError
    from ling_jax import crosscheck

    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    device = args.torch_device if args.torch_device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--torch-device cuda: torch sees no CUDA device; pass --torch-device cpu")
    try:
        ling = (crosscheck.LingFromOrbax(args.checkpoint, dtype) if args.checkpoint
                else crosscheck.LingFromHF(args.hf_dir, dtype))
        if args.checkpoint:
            crosscheck.check_same_weights(ling, args.hf_dir, dtype)
        # transformers 5.24 ignores the SwiGLU clamps, 5.25 on applies them (docs/model.md §6): ling-jax follows.
        cfg = ling.cfg.replace(apply_swiglu_clamps=crosscheck.reference_applies_swiglu_clamps())
        side = crosscheck.TorchFromHF(args.hf_dir, cfg, device)
    except CheckpointError as e:
        parser.error(str(e))
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    return crosscheck.stream(ling, side, ids, cfg, dtype=args.dtype, layers=window, decode_steps=args.decode_steps,
                             backend=args.backend, log=log)


def _layer_window(text: str | None, num_layers: int, parser) -> tuple[int, int]:
    if text is None:
        return 0, num_layers
    a, sep, b = text.partition(":")
    try:
        window = (int(a) if a.strip() else 0, int(b) if b.strip() else num_layers)
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1] <= num_layers:
        parser.error(f"--layers {text!r} must be A:B with 0 <= A < B <= {num_layers} (this model's layer count), "
                     "e.g. 0:6; A or B may be left out")
    return window


def _check_same_model(hf_cfg, orbax_cfg, args, parser) -> None:
    """The orbax checkpoint must be a conversion of the HF one's model: every field that shapes the math equal."""
    import dataclasses

    from conversion.load import without_mtp

    def shape(cfg):
        return without_mtp(cfg).replace(router_weight_dtype="float32", quantization=None)

    a, b = shape(hf_cfg), shape(orbax_cfg)
    differ = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    if differ:
        listed = ", ".join(f"{n} ({getattr(b, n)} vs {getattr(a, n)})" for n in differ[:6])
        parser.error(f"--checkpoint {args.checkpoint} is not a conversion of --hf-dir {args.hf_dir}: {listed}; pass "
                     "the orbax checkpoint `ling-jax convert` wrote from that HF directory")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv or ["generate"])
    sub = parser._subparsers._group_actions[0].choices[args.command]  # errors name the subcommand
    try:
        return {"generate": _generate, "convert": _convert, "bench": _bench, "crosscheck": _crosscheck,
                "layercheck": _layercheck}[args.command](args, sub)
    except _bad_input_errors() as e:
        sub.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
