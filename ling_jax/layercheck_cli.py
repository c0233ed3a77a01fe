"""`ling-jax layercheck`: its options, their checks against the model's config, and the weights (random, drawn on the
device, or a checkpoint). The comparison itself is ling_jax.layercheck."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ling_jax.cli_common import (DEFAULT_DRAFTS, DTYPES, FP8, MAX_DRAFTS, PREFILL_CHUNK, _check_backend,
                                 _check_backend_fits, _check_memory, _id_list, _add_weights_source, _weights_config)
from ling_jax.layercheck import MODES, PATHS

DEFAULT_PROMPT_LEN = 64


def _add_layercheck(p: argparse.ArgumentParser) -> None:
    _add_weights_source(p, "a preset with random weights (needs --random-weights): toy, ling-3.0-tiny, "
                           "ling-3.0-flash (default: toy, when no checkpoint is given)",
                        "with --preset: weights drawn leaf by leaf on the device",
                        "with --preset: its last N layers only, at its exact widths (default: all)")
    p.add_argument("--compare", choices=MODES, default="verify-vs-decode",
                   help="verify-vs-decode: the verify forward over K + 1 positions against K + 1 sequential decode "
                        "steps (the baseline); backends: --path on --backend against --path on the reference")
    p.add_argument("--path", choices=PATHS, default=None,
                   help="with --compare backends: the path run (default: verify)")
    p.add_argument("--backend", default=None, metavar="SPEC",
                   help="as `generate --backend` (default: reference for verify-vs-decode, fast for backends)")
    p.add_argument("--dtype", choices=DTYPES + (FP8,), default="float32",
                   help="weights and activations; fp8: block-FP8 weights (quantised from --hf-dir, random for "
                        "--preset) with --activations. A checkpoint stored in FP8 keeps its FP8 weights and computes "
                        "in --dtype")
    p.add_argument("--activations", choices=DTYPES, default=None,
                   help="with --dtype fp8: the activations' dtype (default: bfloat16, as everywhere else)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", metavar="IDS", help="the prompt prefilled first, comma-separated ids "
                        "(default: none, so --prompt-len)")
    prompt.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, metavar="N",
                        help="a random prompt of N ids drawn with --seed")
    p.add_argument("--num-draft", type=int, default=None, metavar="K",
                   help=f"drafts per verify: the check runs K + 1 positions, 1..{MAX_DRAFTS} (default: "
                        f"{DEFAULT_DRAFTS}, or as many as --verify-ids gives)")
    p.add_argument("--verify-ids", metavar="IDS",
                   help="the K + 1 ids fed after the prompt: the last committed token, then the drafts (default: "
                        "drawn with --seed)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="weight and random-id seed")
    p.add_argument("--tolerance", type=float, default=None, metavar="X",
                   help="each layer's bound on the hidden state's relative L2 error (default: 1e-5 with float32 "
                        "activations; none with bfloat16, whose rounding flips routes on near-ties: reported only)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per-layer rows included)")


def _layercheck(args, parser) -> int:
    """Check the options, load the weights, run ling_jax.layercheck.check, print the report; 0 when every layer is
    within the bound (or none applies), 1 otherwise."""
    _check_options(args, parser)
    cfg = _weights_config(args, parser, "toy", "check all of them")
    activations = args.activations or ("bfloat16" if args.dtype == FP8 else args.dtype)
    prompt, verify = _ids(args, cfg, parser)
    _check_backend_fits(args.backend, cfg, parser)  # the baseline's reference takes every config
    _check_memory(cfg, activations, len(prompt), len(verify), PREFILL_CHUNK, with_mtp=False)

    from ling_jax import layercheck

    cfg, params = _weights(args, cfg, activations)
    report = layercheck.check(params, cfg, prompt, verify, mode=args.compare, backend=args.backend, path=args.path,
                              bound=args.tolerance)
    print(json.dumps(_finite(report.as_dict()), allow_nan=False) if args.json else report.format())
    return 0 if report.ok else 1


def _finite(value):
    """`value` with every non-finite float as None: strict JSON has no Infinity or NaN (an error over a zero
    baseline, a boundary gap where nothing is dropped)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _check_options(args, parser) -> None:
    """The options on their own, before JAX starts."""
    from_checkpoint = args.checkpoint or args.hf_dir
    if from_checkpoint and (args.random_weights or args.layers is not None):
        parser.error("--random-weights and --layers go with --preset; a checkpoint is checked on its own weights")
    if not from_checkpoint and not args.random_weights:
        parser.error("--preset checks random weights: pass --random-weights to say so (or --checkpoint DIR / "
                     "--hf-dir DIR for real ones)")
    if args.activations is not None and args.dtype != FP8:
        parser.error(f"--activations goes with --dtype fp8; --dtype {args.dtype} computes in {args.dtype} (an FP8 "
                     "checkpoint keeps its FP8 weights and computes in --dtype): drop --activations")
    if args.path is not None and args.compare != "backends":
        parser.error("--path picks the path --compare backends runs; verify-vs-decode runs both: drop --path or pass "
                     "--compare backends")
    args.path = args.path or "verify"
    args.backend = args.backend or ("fast" if args.compare == "backends" else "reference")
    _check_backend(args.backend, parser)
    if args.compare == "backends":
        from ling_jax.backends import resolve
        if all(choice == "reference" for choice in resolve(args.backend).values()):
            parser.error(f"--compare backends runs --backend against the reference, and --backend {args.backend} "
                         "is the reference: pass --backend fast, pallas or a per-op spec")
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error(f"--tolerance {args.tolerance} must be > 0 (a relative L2 error)")
    if args.seed < 0:
        parser.error(f"--seed {args.seed} must be >= 0")
    if args.prompt_ids is None and args.prompt_len < 1:
        parser.error(f"--prompt-len {args.prompt_len} must be >= 1")
    if args.num_draft is not None and not 1 <= args.num_draft <= MAX_DRAFTS:
        parser.error(f"--num-draft {args.num_draft} must lie in 1..{MAX_DRAFTS} (a verify runs K + 1 positions "
                     "through the verify kernels)")


def _ids(args, cfg, parser) -> tuple[list[int], list[int]]:
    """(prompt ids, the K + 1 verified ids), given or drawn with --seed, checked against the vocabulary and the
    model's positions."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    prompt = (_id_list(args.prompt_ids, "--prompt-ids", parser) if args.prompt_ids is not None
              else rng.integers(0, cfg.vocab_size, args.prompt_len).tolist())
    if args.verify_ids is None:
        verify = rng.integers(0, cfg.vocab_size, (args.num_draft or DEFAULT_DRAFTS) + 1).tolist()
    else:
        verify = _id_list(args.verify_ids, "--verify-ids", parser)
        if not 2 <= len(verify) <= MAX_DRAFTS + 1:
            parser.error(f"--verify-ids holds {len(verify)} ids; a verify runs K + 1 of them with K in 1..{MAX_DRAFTS}"
                         ": pass 2 to 17 ids")
        if args.num_draft is not None and args.num_draft + 1 != len(verify):
            parser.error(f"--num-draft {args.num_draft} runs {args.num_draft + 1} positions but --verify-ids holds "
                         f"{len(verify)}: drop --num-draft (the ids set it) or pass K + 1 ids")
    for option, ids in (("--prompt-ids", prompt), ("--verify-ids", verify)):
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            parser.error(f"{option}: ids {bad[:5]} lie outside the model's vocabulary [0, {cfg.vocab_size}): pass ids "
                         "of this model's tokenizer")
    if len(prompt) + len(verify) > cfg.max_position_embeddings:
        parser.error(f"the prompt ({len(prompt)} ids) + {len(verify)} verified ids exceed the model's "
                     f"max_position_embeddings={cfg.max_position_embeddings}: shorten the prompt")
    return prompt, verify


def _weights(args, cfg, activations: str):
    """(cfg, params): the params in the activations' dtype (block-FP8 leaves kept as such), on the default device;
    `cfg` as the loader reads it (the routers' stored dtype)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(activations)
    if args.checkpoint:
        from conversion.orbax_io import load_params
        return load_params(args.checkpoint, dtype=dtype)
    if args.hf_dir:
        from conversion.load import load_hf
        return load_hf(args.hf_dir, dtype=dtype, with_mtp=False, fp8=True if args.dtype == FP8 else None,
                       progress=not args.json)
    from ling_jax.params import abstract_params, init_params

    print(f"ling-jax layercheck: random weights (preset {args.preset or 'toy'}), drawn with seed {args.seed}",
          file=sys.stderr)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # drawn on the device: the host never holds them
    shardings = jax.tree.map(lambda _: device, abstract_params(cfg, dtype, with_mtp=False))
    return cfg, jax.block_until_ready(init_params(cfg, jax.random.key(args.seed), dtype, with_mtp=False,
                                                  shardings=shardings))
