"""`ling-jax` command line: convert | generate.

    ling-jax convert --hf-dir DIR --out DIR [--dtype bfloat16|float32] [--router-fp32]
    ling-jax generate (--checkpoint DIR | --hf-dir DIR | --preset NAME)
                      (--prompt-ids 1,2,3 | --prompt TEXT --tokenizer tokenizer.json) --max-new-tokens N
                      [--temperature T --top-p P --seed S] [--dtype float32|bfloat16] [--backend reference|pallas]
                      [--block-size N] [--ignore-eos] [--json]

With no arguments, `generate` runs the embedded default: the `toy` preset with random weights, a fixed prompt and
64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT_IDS = "7,41,3,99,12,250,18,5,77,301,64,9"
DTYPES = ("float32", "bfloat16")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ling-jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="HF safetensors checkpoint -> orbax checkpoint")
    conv.add_argument("--hf-dir", required=True, help="directory with config.json, *.safetensors and the index")
    conv.add_argument("--out", required=True, help="output directory for the orbax checkpoint")
    conv.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    conv.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    conv.add_argument("--force", action="store_true", help="overwrite an existing --out checkpoint")
    conv.add_argument("--router-fp32", action="store_true",
                      help="widen bf16-stored MoE routers to float32 (same logits, twice the router bytes); by "
                           "default they stay as stored")

    gen = sub.add_parser("generate", help="generate tokens")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="orbax checkpoint written by `ling-jax convert`")
    src.add_argument("--hf-dir", help="HF checkpoint directory (converted on the fly)")
    src.add_argument("--preset", help="random weights for a preset: toy, ling-3.0-tiny, ling-3.0-flash")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    gen.add_argument("--tokenizer", help="tokenizer.json for --prompt and for decoding the output")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (and weight seed for --preset)")
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="compute dtype (default: float32 for --preset, the checkpoint's otherwise)")
    gen.add_argument("--backend", default="reference",
                     help="reference | pallas | fast (per op, the faster on the H200) | per op, e.g. "
                     "kda=pallas,moe_decode=pallas (ling_jax/backends.py)")
    gen.add_argument("--block-size", type=int, default=16, help="decode steps per jitted block")
    gen.add_argument("--ignore-eos", action="store_true", help="always produce --max-new-tokens tokens")
    gen.add_argument("--warmup", type=int, default=1,
                     help="untimed runs first, so the reported times exclude compilation (default 1)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, ttft_ms, tpot_ms, "
                     "tokens_per_s")
    return parser


def _prompt_ids(args, parser, tokenizer) -> list[int]:
    if args.prompt is not None:
        if tokenizer is None:
            parser.error("--prompt needs --tokenizer tokenizer.json (or pass --prompt-ids)")
        return tokenizer.encode(args.prompt).ids
    text = args.prompt_ids if args.prompt_ids is not None else DEFAULT_PROMPT_IDS
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--prompt-ids {text!r} must be comma-separated integers, e.g. 1,2,3")
    if not ids:
        parser.error("--prompt-ids is empty")
    return ids


def _load_tokenizer(path, parser):
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        parser.error("--tokenizer needs the `tokenizers` package (pip install tokenizers)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own exception types
        parser.error(f"--tokenizer {path}: cannot read it as a tokenizer.json ({e})")


def _load_model(args, parser):
    import jax
    import jax.numpy as jnp

    from ling_jax.config import ConfigError, preset
    from ling_jax.params import init_params

    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    if args.checkpoint:
        from conversion.orbax_io import load_params
        return load_params(args.checkpoint, dtype=dtype)
    if args.hf_dir:
        from conversion.load import load_hf
        return load_hf(args.hf_dir, dtype=dtype or jnp.bfloat16, with_mtp=False)
    name = args.preset or "toy"
    try:
        cfg = preset(name)
    except ConfigError as e:
        parser.error(str(e))
    return cfg, init_params(cfg, jax.random.key(args.seed), dtype or jnp.float32, with_mtp=False)


def _generate(args, parser) -> int:
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.block_size < 1:
        parser.error(f"--block-size {args.block_size} must be >= 1")
    from ling_jax.backends import resolve
    try:
        resolve(args.backend)
    except ValueError as e:
        parser.error(str(e))
    from ling_jax.engine.sampling import make_sampler
    try:
        sampler = make_sampler(args.temperature, args.top_p)
    except ValueError as e:
        parser.error(f"--temperature/--top-p: {e}")
    tokenizer = _load_tokenizer(args.tokenizer, parser)
    ids = _prompt_ids(args, parser, tokenizer)

    from ling_jax.engine.generate import generate
    cfg, params = _load_model(args, parser)
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        parser.error(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {cfg.vocab_size})")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be >= 0")
    for _ in range(args.warmup + 1):
        result = generate(params, cfg, [ids], max_new_tokens=args.max_new_tokens, sampler=sampler,
                          seed=args.seed, backend=args.backend, block_size=args.block_size,
                          ignore_eos=args.ignore_eos)
    tokens = result.tokens[0]
    timing = dict(ttft_ms=1e3 * result.ttft_s, tpot_ms=1e3 * result.tpot_s, tokens_per_s=result.tokens_per_s)
    if args.json:
        print(json.dumps(dict(tokens=tokens, **timing)))
    else:
        print(tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens)))
        print(f"[{len(tokens)} tokens | TTFT {timing['ttft_ms']:.1f} ms | "
              f"TPOT {timing['tpot_ms']:.2f} ms | {timing['tokens_per_s']:.1f} tok/s | backend {args.backend}]",
              file=sys.stderr)
    return 0


def _convert(args) -> int:
    import jax.numpy as jnp

    from conversion.orbax_io import convert
    convert(args.hf_dir, args.out, dtype=jnp.dtype(args.dtype), with_mtp=not args.no_mtp, force=args.force,
            router_weight_dtype="float32" if args.router_fp32 else None)
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv or ["generate"])
    sub = parser._subparsers._group_actions[0].choices[args.command]  # errors name the subcommand
    from conversion.load import CheckpointError
    from ling_jax.config import ConfigError
    try:
        return _generate(args, sub) if args.command == "generate" else _convert(args)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        sub.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
