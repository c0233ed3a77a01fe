"""`ling-jax crosscheck`: ling-jax against transformers' BailingHybridForCausalLM, layer by layer, in bounded memory.

    ling-jax crosscheck --hf-dir DIR [--checkpoint ORBAX] [--prompt-ids 1,2,3 | --prompt TEXT --tokenizer FILE]
                        [--dtype float32|bfloat16] [--layers A:B] [--decode-steps N] [--backend SPEC]
                        [--torch-device auto|cpu|cuda] [--json]

transformers always reads --hf-dir; ling-jax reads --checkpoint when given (a `ling-jax convert` output of the same
model), else --hf-dir. The comparison itself is `ling_jax.crosscheck.stream`. Exit status: 0 when every check is
within its tolerance, 1 when one is not, 2 for a bad option or checkpoint. The option checks import neither JAX
nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_DECODE_STEPS = 32


def add_crosscheck_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, metavar="DIR",
                   help="the HF checkpoint (config.json + *.safetensors); transformers always reads it")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a ling-jax (orbax) checkpoint of the same model for the ling-jax side (default: --hf-dir)")
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
    p.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS, metavar="N",
                   help="greedy decode steps through both sides' caches; each one streams every layer again")
    p.add_argument("--backend", default="reference", metavar="SPEC",
                   help="ling-jax's ops: reference, pallas, fast, or per op (as `ling-jax generate`)")
    p.add_argument("--torch-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where transformers runs (auto: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per-layer rows included)")


def run_crosscheck(args, parser: argparse.ArgumentParser | None = None) -> int:
    """The command: check the options, stream both models through the prompt, print the report; 0 when every
    check is within tolerance, 1 otherwise."""
    parser = parser or _parser()
    if args.decode_steps < 0:
        parser.error(f"--decode-steps {args.decode_steps} must be >= 0")
    if args.prompt is not None and args.tokenizer is None:
        parser.error("--prompt needs --tokenizer FILE (the checkpoint's tokenizer.json), or pass --prompt-ids")
    # JAX would otherwise take most of an accelerator's memory up front, leaving none to torch.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from ling_jax import cli

    cfg = cli._hf_config(args.hf_dir, parser, orbax_fix=f"pass it as --checkpoint {args.hf_dir} and the HF "
                                                          "checkpoint it came from as --hf-dir")
    if args.checkpoint:
        _check_same_model(cfg, cli._checkpoint_config(args.checkpoint, parser), args, parser)
    window = _window(args.layers, cfg.num_layers, parser)
    ids = cli._prompt_ids(args, parser, cli._load_tokenizer(args.tokenizer, parser))
    if max(ids) >= cfg.vocab_size or min(ids) < 0:
        parser.error(f"prompt ids lie in [{min(ids)}, {max(ids)}] but the vocabulary is [0, {cfg.vocab_size}): pass "
                     "ids of this model's tokenizer")
    cli._check_backend(args.backend, parser)
    cli._check_backend_fits(args.backend, cfg, parser)
    try:
        from ling_jax import crosscheck
        crosscheck.import_reference_model()
    except ImportError as e:
        parser.error(str(e))
    report = _stream(args, window, ids, parser)
    print(json.dumps(report.as_dict()) if args.json else report.format())
    return 0 if report.ok else 1


def _stream(args, window, ids, parser):
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
        # transformers ignores the SwiGLU clamps (docs/model.md §6): ling-jax leaves them out to compare.
        cfg = ling.cfg.replace(apply_swiglu_clamps=False)
        side = crosscheck.TorchFromHF(args.hf_dir, cfg, device)
    except CheckpointError as e:
        parser.error(str(e))
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    return crosscheck.stream(ling, side, ids, cfg, dtype=args.dtype, layers=window, decode_steps=args.decode_steps,
                             backend=args.backend, log=log)


def _window(text: str | None, num_layers: int, parser) -> tuple[int, int]:
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


def _parser() -> argparse.ArgumentParser:
    from ling_jax.cli import _DefaultsFormatter, _Parser

    p = _Parser(prog="ling-jax crosscheck", formatter_class=_DefaultsFormatter,
                description="ling-jax against transformers' BailingHybridForCausalLM, layer by layer")
    add_crosscheck_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """`ling-jax crosscheck ARGS` as its own entry point (ling_jax.cli dispatches to `run_crosscheck`)."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from ling_jax.config import ConfigError

    try:
        return run_crosscheck(args, parser)
    except (ConfigError, FileNotFoundError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
