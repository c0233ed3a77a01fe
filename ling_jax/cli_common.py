"""What the `ling-jax` subcommands share: the parser's one-line errors, the option groups, and the checks of the
model source, the backend, the devices and the memory plan that run before any weight loads.

Nothing here imports JAX at module level, so a bad option is refused before JAX starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")
FP8 = "fp8"  # block-FP8 weights (E4M3, 128x128 scales), bf16 activations
HF_DIR_HELP = "the HF checkpoint directory (config.json + *.safetensors)"
MAX_DRAFTS = 16  # engine.speculative.MAX_DRAFTS, restated so option errors need no JAX import
DEFAULT_DRAFTS = 3
PREFILL_CHUNK = 8192  # model.PREFILL_CHUNK, restated for the same reason
COORDINATOR_TIMEOUT_S = 300  # jax.distributed.initialize's own default


class _Parser(argparse.ArgumentParser):
    """Errors print one short usage line instead of argparse's synopsis of every option."""

    def error(self, message: str):
        if message.endswith(": expected one argument"):
            option = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += f" (a value that starts with '-' goes as {option}=VALUE)"
        commands = self._subparsers._group_actions[0].choices if self._subparsers else None
        synopsis = f"{self.prog} {{{','.join(commands)}}}" if commands else self.prog
        self.exit(2, f"usage: {synopsis} [options]  ({self.prog} --help lists them)\n"
                     f"{self.prog}: error: {message}\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (flags have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _add_tp(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N", help=f"tensor parallelism over N devices: {help_text}")


def _add_processes(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("several hosts (one process each, joined by jax.distributed; all three or none)")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="process 0's address, the same on every host (default: none, one process)")
    group.add_argument("--num-processes", type=int, default=None, metavar="P", help="processes in all (default: none)")
    group.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's index, 0..P-1; process 0 prints the results (default: none)")
    group.add_argument("--coordinator-timeout", type=int, default=COORDINATOR_TIMEOUT_S, metavar="S",
                       help="seconds to wait for the coordinator and the other processes")


def _check_backend(spec: str, parser) -> None:
    from ling_jax.backends import resolve

    try:
        resolve(spec)
    except ValueError as e:
        parser.error(f"--backend: {e}")


def _id_list(text: str, option: str, parser) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        parser.error(f"{option} {text!r} must be comma-separated integers, e.g. 1,2,3")
    if not ids:
        parser.error(f"{option} {text!r} holds no token id: pass comma-separated integers, e.g. 1,2,3")
    return ids


def _model_config(args, parser):
    """The chosen model's config, read before any weight, so every check that needs it runs before loading."""
    if args.checkpoint:
        return _checkpoint_config(args.checkpoint, parser)
    if args.hf_dir:
        return _hf_config(args.hf_dir, parser, orbax_fix=f"pass --checkpoint {args.hf_dir}")
    from ling_jax.config import ConfigError, preset

    try:
        return preset(args.preset or "toy")
    except ConfigError as e:
        parser.error(f"--preset: {e}")


def _checkpoint_config(path: str, parser):
    from conversion.load import CheckpointError
    from conversion.orbax_io import is_hf_checkpoint, read_config
    from ling_jax.config import ConfigError

    if is_hf_checkpoint(path):
        parser.error(f"--checkpoint {path} is an HF safetensors checkpoint, not a ling-jax (orbax) one: pass "
                     f"--hf-dir {path}, or convert it with `ling-jax convert --hf-dir {path} --out OUT`")
    try:
        return read_config(path)
    except (CheckpointError, ConfigError, json.JSONDecodeError) as e:
        parser.error(f"--checkpoint: {e}")


def _hf_config(path: str, parser, *, orbax_fix: str):
    """--hf-dir checked to be an HF checkpoint directory and its config.json read; `orbax_fix` is what to do
    when it is a ling-jax checkpoint instead."""
    from conversion.load import INDEX_NAME, SINGLE_NAME
    from conversion.orbax_io import PARAMS_DIR
    from ling_jax.config import ConfigError, from_hf

    where = Path(path)
    if not where.is_dir():
        parser.error(f"--hf-dir {path} {'is not a directory' if where.exists() else 'does not exist'}: pass "
                     f"{HF_DIR_HELP}")
    if (where / PARAMS_DIR).is_dir() and not any(where.glob("*.safetensors")):
        parser.error(f"--hf-dir {path} is a ling-jax (orbax) checkpoint, not an HF one: {orbax_fix}")
    if not (where / "config.json").is_file():
        parser.error(f"--hf-dir {path} has no config.json: pass {HF_DIR_HELP}")
    try:
        cfg = from_hf(where)
    except (ConfigError, json.JSONDecodeError) as e:
        parser.error(f"--hf-dir {path}: {e}")
    if not ((where / INDEX_NAME).is_file() or (where / SINGLE_NAME).is_file()):
        parser.error(f"--hf-dir {path} has config.json but no {INDEX_NAME} or {SINGLE_NAME}: pass the directory "
                     "that also holds the weights")
    return cfg


def _add_fp8_activations(p) -> None:
    p.add_argument("--fp8-activations", action="store_true",
                   help="the decode and verify steps' block-FP8 projections (attention mixers, dense MLP) through "
                        "the W8A8 kernel: activations quantised per token and 128 columns to E4M3 (SGLang's recipe; "
                        "~2.5e-2 from the weight-only numerics per projection, so not the reference's tokens); the "
                        "MoE experts and prefill stay weight-only; needs FP8 weights and a Pallas gemv")


def _apply_fp8_activations(args, cfg, parser) -> None:
    """--fp8-activations checked against the weights and the kernel's sizes, then folded into --backend (gemv=w8a8),
    so every later check and the result rows name it."""
    if not args.fp8_activations:
        return
    from ling_jax.backends import w8a8_limits, with_fp8_activations

    if args.dtype != FP8 and cfg.quantization != "fp8":
        parser.error("--fp8-activations quantises the activations of block-FP8 projections, but these weights are "
                     "not FP8: pass --dtype fp8 (or a checkpoint converted with --dtype fp8)")
    if w8a8_limits(cfg):
        parser.error(f"--fp8-activations: the W8A8 kernel takes projection inputs in whole 128-column groups, and "
                     f"this config has {', '.join(w8a8_limits(cfg))}: run it without --fp8-activations")
    try:
        args.backend = with_fp8_activations(args.backend)
    except ValueError as e:
        parser.error(str(e))


def _check_backend_fits(spec: str, cfg, parser) -> None:
    from ling_jax.backends import check_config
    from ling_jax.config import ConfigError

    try:
        check_config(cfg, spec)
    except ConfigError as e:
        parser.error(f"--backend: {e}")


def _check_tp(args, parser) -> None:
    if args.tp < 1:
        parser.error(f"--tp {args.tp} must be >= 1 (1: one device)")


def _check_processes(args, parser) -> None:
    """--coordinator, --num-processes and --process-id: all three or none, the id in range, the address well formed.
    Checked with the other options, before any device is touched."""
    flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return
    if len(given) < len(flags):
        missing = [flag for flag in flags if flag not in given]
        parser.error(f"{' and '.join(given)} needs --coordinator HOST:PORT, --num-processes P and --process-id I "
                     f"together: pass {' and '.join(missing)} too, or drop {' and '.join(given)} for one process")
    if args.num_processes < 1:
        parser.error(f"--num-processes {args.num_processes} must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} must lie in 0..{args.num_processes - 1} (--num-processes "
                     f"{args.num_processes}); process 0 serves the coordinator")
    if args.coordinator_timeout < 1:
        parser.error(f"--coordinator-timeout {args.coordinator_timeout} must be >= 1 second")
    _coordinator_address(args.coordinator, parser)


def _coordinator_address(text: str, parser) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"--coordinator {text!r} must be HOST:PORT, e.g. 10.0.0.1:8476 (process 0's host and a free "
                     "port there)")
    return host.strip("[]"), int(port)


def _start_processes(args, parser) -> None:
    """jax.distributed joins the processes, before JAX starts its devices. Process 0 serves the coordinator: its port
    must be free. The others first wait (up to --coordinator-timeout) until it listens, so an unreachable address is
    one message, not the runtime's abort."""
    if getattr(args, "coordinator", None) is None:
        return
    host, port = _coordinator_address(args.coordinator, parser)
    deadline = time.monotonic() + args.coordinator_timeout
    if args.process_id == 0:
        try:
            socket.create_server(("", port)).close()
        except OSError as e:
            parser.error(f"--coordinator {args.coordinator}: process 0 serves the coordinator on port {port} and "
                         f"cannot bind it ({e.strerror}): choose a free port, the same on every process")
    else:
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    parser.error(f"--coordinator {args.coordinator} cannot be reached within "
                                 f"{args.coordinator_timeout} s: start process 0 (--process-id 0) with the same "
                                 "--coordinator, check the host and port, or raise --coordinator-timeout")
                time.sleep(0.2)
    import jax

    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=max(int(deadline - time.monotonic()), 1))


def _mesh(args, parser, *cfgs):
    """The --tp mesh, the sizes of each config in `cfgs` checked against it; None for --tp 1 on one process (the
    single-device run). With several processes it must span all their devices."""
    several = getattr(args, "coordinator", None) is not None
    if args.tp == 1 and not several:
        return None
    import jax

    from ling_jax.sharding import check_divisible, make_mesh

    if several and args.tp != jax.device_count():
        parser.error(f"--tp {args.tp} must span the devices of all {args.num_processes} processes, "
                     f"{jax.device_count()} in all ({jax.local_device_count()} here): pass --tp {jax.device_count()}")
    try:
        mesh = make_mesh(args.tp)
        for cfg in cfgs:
            check_divisible(cfg, args.tp)
    except ValueError as e:
        parser.error(f"--tp {args.tp}: {e}")
    return mesh


def _param_shardings(mesh, cfg, *, with_mtp: bool = True):
    """The params' shardings on `mesh` (None without a mesh: the default device)."""
    if mesh is None:
        return None
    from ling_jax.sharding import param_shardings
    return param_shardings(cfg, mesh, with_mtp=with_mtp)


def _in_mesh(mesh):
    """The sharded run's context: the Pallas kernels run per shard under it (ling_jax.sharding.per_shard)."""
    if mesh is None:
        return contextlib.nullcontext()
    import jax
    return jax.set_mesh(mesh)


def _is_main_process() -> bool:
    """Process 0 prints and writes the results (every process computes them)."""
    import jax
    return jax.process_index() == 0


def _check_checkpoint_fp8(args, cfg, parser) -> None:
    """--dtype fp8 on an unquantised orbax checkpoint, refused from its config before anything loads (orbax
    restores what it stores; an HF directory is quantised while it loads)."""
    if args.dtype == FP8 and args.checkpoint and cfg.quantization != "fp8":
        parser.error(f"--checkpoint {args.checkpoint} holds unquantised weights: convert the HF checkpoint with "
                     "`ling-jax convert --dtype fp8`, or run this one with --dtype bfloat16")


def _add_weights_source(p: argparse.ArgumentParser, preset_help: str, random_help: str, layers_help: str) -> None:
    """The options naming the weights of a bench-style command: a preset with --random-weights (sliced by --layers),
    an orbax checkpoint or an HF directory (`_weights_config` reads them)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", default=None, help=preset_help)
    src.add_argument("--checkpoint", metavar="DIR", help="ling-jax (orbax) checkpoint (default: none)")
    src.add_argument("--hf-dir", metavar="DIR", help=f"{HF_DIR_HELP} (default: none)")
    p.add_argument("--random-weights", action="store_true", help=random_help)
    p.add_argument("--layers", type=int, default=None, metavar="N", help=layers_help)

def _weights_config(args, parser, default_preset: str, all_layers: str):
    """The config of the weights a bench-style command will run: a checkpoint's (block-FP8 with --dtype fp8), or the
    preset's (`default_preset` without --preset) sliced to --layers; `all_layers` ends the --layers range message."""
    if args.checkpoint or args.hf_dir:
        cfg = _model_config(args, parser)
        _check_checkpoint_fp8(args, cfg, parser)
        return cfg.replace(quantization="fp8") if args.dtype == FP8 else cfg
    from ling_jax import bench
    from ling_jax.config import ConfigError, preset

    name = args.preset or default_preset
    try:
        layers = preset(name).num_layers
        if args.layers is not None and not 1 <= args.layers <= layers:
            parser.error(f"--layers {args.layers} must lie in 1..{layers}: preset {name} has {layers} layers (leave "
                         f"--layers out to {all_layers})")
        return bench.bench_config(name, args.layers, args.dtype)
    except ConfigError as e:
        parser.error(f"--preset: {e}")

def _check_memory(cfg, dtype: str, prompt_len: int, new_tokens: int, chunk: int, *, with_mtp: bool,
                  device_gb: float | None = None, devices: int = 1) -> None:
    """The memory plan (ling_jax/memory.py) of each of `devices` against this process's first device, before any
    weight exists; skipped where the runtime reports no limit (the CPU) unless `device_gb` gives one."""
    import jax

    from ling_jax import memory

    capacity = memory.usable_bytes(jax.local_devices()[0], None if device_gb is None else int(device_gb * 1e9))
    if capacity is None:
        return
    compute = "bfloat16" if dtype == FP8 else dtype
    plan = memory.plan(cfg, dtype=compute, prompt_len=prompt_len, max_new_tokens=new_tokens, chunk=chunk,
                       capacity=capacity, with_mtp=with_mtp, devices=devices)
    memory.check(plan, cfg, compute, with_mtp=with_mtp)


def _bad_input_errors() -> tuple[type[Exception], ...]:
    """The exception types our code raises for bad input. CheckpointError's module imports JAX, so it is named only
    once loaded (it cannot have been raised otherwise) and option errors stay quick."""
    from ling_jax.config import ConfigError, DeviceMemoryError

    loaded = sys.modules.get("conversion.load")
    plan = sys.modules.get("ling_jax.memory")
    return (ConfigError, DeviceMemoryError, FileNotFoundError, FileExistsError) + (
        (plan.MemoryPlanError,) if plan else ()) + (
        (loaded.CheckpointError,) if loaded else ())
