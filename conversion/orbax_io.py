"""The ling-jax checkpoint: an orbax params tree plus the official config.json beside it.

    <path>/config.json   `ling_jax.config.to_hf_dict(cfg)`; `from_hf` reads it back
    <path>/params/       orbax StandardCheckpointer tree, the structure of `param_specs(cfg)`

`load_params` restores every leaf straight into its target sharding (orbax reads only each device's slice).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from conversion import hf
from conversion.load import INDEX_NAME, CheckpointError, _sharding_lookup, load_hf, router_dtype_of
from ling_jax.config import LingConfig, from_hf, to_hf_dict
from ling_jax.params import COMPUTE, is_spec, param_specs

PARAMS_DIR = "params"


def save_params(path: str | Path, cfg: LingConfig, params: Any, *, force: bool = False) -> Path:
    """Write `params` (structure of `param_specs(cfg)`) and config.json under `path`; returns `path`."""
    path = Path(path).absolute()
    _check_structure(cfg, jax.tree.map(lambda x: (x.shape, x.dtype), params), "params")
    _refuse_overwrite(path, force)
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params, force=force)
        ckptr.wait_until_finished()
    (path / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2) + "\n")
    return path


def load_params(path: str | Path, *, shardings: Any = None, dtype=None) -> tuple[LingConfig, Any]:
    """Restore (cfg, params) from `save_params`' directory.

    Args:
      shardings: None (default device), one Sharding for every leaf, or a pytree shaped like `param_specs(cfg)`.
      dtype: None keeps COMPUTE params' stored dtypes, otherwise they become `dtype`; FP32-class params are float32
        either way (`ParamSpec.dtype`), the routers as stored (`cfg.router_weight_dtype`: bfloat16 when every
        stored router is, else float32).

    Raises:
      CheckpointError: `path` is missing, is an HF safetensors directory (`load_hf` reads those), lacks params/ or
        config.json, or orbax cannot read params/; every message names the directory and the fix.
    """
    path = Path(path).absolute()
    cfg = read_config(path)
    with ocp.StandardCheckpointer() as ckptr:
        stored = _stored_shapes(ckptr, path / PARAMS_DIR)
        stored_by_path = _check_structure(cfg, stored, str(path / PARAMS_DIR))
        cfg = cfg.replace(router_weight_dtype=router_dtype_of(
            jnp.dtype(dt).name for p, (_, dt) in stored_by_path.items() if p[-1] == "router"))
        specs = param_specs(cfg)
        sharding_of = _sharding_lookup(shardings)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # dtype None keeps COMPUTE params as stored; fixed-dtype params (FP32, the routers as cfg now says: mixed
        # stored routers come back float32) always take their spec's dtype.
        targets = [jax.ShapeDtypeStruct(spec.shape,
                                        stored_by_path[p][1] if dtype is None and spec.dtype_class == COMPUTE
                                        else spec.dtype(dtype),
                                        sharding=sharding_of(p) or default)
                   for p, spec in hf.array_paths(specs).items()]
        target = jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), targets)
        try:
            params = ckptr.restore(path / PARAMS_DIR, target)
        except ValueError as e:  # tensorstore's report of a missing or damaged array file
            raise CheckpointError(f"{path / PARAMS_DIR}: orbax cannot restore it ({_first_line(e)}); the copy is "
                                  "incomplete or damaged: copy it again, or convert the HF checkpoint again "
                                  "(`ling-jax convert ... --force`)") from e
    return cfg, params


def read_config(path: str | Path) -> LingConfig:
    """The config.json of a `save_params` directory, after checking the directory is one (nothing restored)."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist: pass the directory `ling-jax convert --out` (or `save_params`) "
                              "wrote")
    if is_hf_checkpoint(path):
        raise CheckpointError(f"{path} is an HF safetensors checkpoint, not a ling-jax (orbax) one: read it with "
                              f"conversion.load.load_hf('{path}'), or convert it with "
                              f"`ling-jax convert --hf-dir {path} --out OUT`")
    missing = [name for name in (f"{PARAMS_DIR}/", "config.json") if not (path / name).exists()]
    if missing:
        raise CheckpointError(f"{path} lacks {' and '.join(missing)}: a ling-jax checkpoint holds params/ and "
                              f"config.json, as `ling-jax convert --hf-dir HF_DIR --out {path} --force` writes them")
    return from_hf(path / "config.json")


def is_hf_checkpoint(path: str | Path) -> bool:
    """A safetensors checkpoint directory (shards or their index, no params/): what `load_hf` reads."""
    path = Path(path)
    return (not (path / PARAMS_DIR).exists()
            and ((path / INDEX_NAME).is_file() or any(path.glob("*.safetensors"))))


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype=None, shardings: Any = None,
            with_mtp: bool = True, progress: bool = True, force: bool = False,
            router_weight_dtype: str | None = None, fp8: bool | None = None) -> LingConfig:
    """`load_hf` then `save_params` (`fp8`: as `load_hf`'s, True quantising to block-FP8). The whole model passes through device memory: for the full-size preset pass
    `shardings` that spread it over the devices (or a CPU sharding on a host with the RAM)."""
    _refuse_overwrite(Path(out_dir).absolute(), force)  # before minutes of loading, not after
    cfg, params = load_hf(hf_dir, dtype=dtype, shardings=shardings, with_mtp=with_mtp, progress=progress,
                          router_weight_dtype=router_weight_dtype, fp8=fp8)
    if progress:
        print(f"saving orbax checkpoint to {out_dir}", file=sys.stderr)
    save_params(out_dir, cfg, params, force=force)
    return cfg


def _refuse_overwrite(path: Path, force: bool) -> None:
    if (path / PARAMS_DIR).exists() and not force:
        raise FileExistsError(f"{path / PARAMS_DIR} exists; pass force=True to overwrite it, or choose another "
                              "directory")


def _stored_shapes(ckptr: ocp.StandardCheckpointer, params_dir: Path) -> Any:
    """The stored tree of (shape, dtype) pairs; CheckpointError when orbax finds no readable checkpoint there."""
    with _absl_quiet():  # orbax logs each failed read itself; the error below says it once
        try:
            tree = ckptr.metadata(params_dir).item_metadata
            reason = "its metadata files are missing or unreadable"
        except (ValueError, OSError) as e:
            tree, reason = None, _first_line(e)
    if tree is None:
        raise CheckpointError(f"{params_dir}: orbax cannot read it ({reason}); it was not written by "
                              "`ling-jax convert` or the copy is incomplete: copy it again, or convert the HF "
                              "checkpoint again (`ling-jax convert ... --force`)")
    return jax.tree.map(lambda m: (tuple(m.shape), jnp.dtype(m.dtype)), tree.tree,
                        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


@contextlib.contextmanager
def _absl_quiet():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if len(line) <= 200 else line[:200] + "..."


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _check_structure(cfg: LingConfig, tree: Any, what: str) -> dict[hf.Path, tuple]:
    """`tree` of (shape, dtype) pairs must have param_specs(cfg)'s structure and shapes; name every difference."""
    specs = hf.array_paths(param_specs(cfg))
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_pair)
    got = {tuple(_k(k) for k in kp): v for kp, v in flat}
    missing = [hf.path_str(p) for p in specs if p not in got]
    extra = [hf.path_str(p) for p in got if p not in specs]
    shapes = [f"{hf.path_str(p)}: expected {list(s.shape)}, found {list(got[p][0])}"
              for p, s in specs.items() if p in got and tuple(got[p][0]) != s.shape]
    problems = [f"{kind} ({len(items)}): {', '.join(items[:20])}" for kind, items in
                (("missing", missing), ("unexpected", extra), ("wrong shape", shapes)) if items]
    if problems:
        hints = []
        if _has_separate_projections(got, specs):
            hints.append("it holds the separate-projection layout of an older ling-jax (mixer.w_q, mixer.conv_q, ... "
                         "where ling-jax now packs them into mixer.w_in, mixer.conv_qkv and mixer.w_qg): run "
                         "`ling-jax convert` on the HF checkpoint again")
        if shapes:
            hints.append("a checkpoint written by an older ling-jax has older layouts, e.g. the MoE router [D, E] "
                         "before it became [E, D], or the expert down projections [E, Ie, D] before they became "
                         "[E, D, Ie]: run `ling-jax convert` on the HF checkpoint again")
        raise CheckpointError(f"{what} does not match param_specs of its config:\n  " + "\n  ".join(problems)
                              + "".join(f"\n  ({h})" for h in hints))
    return got


# The mixer leaves that ling-jax held before it packed the projections of one input into one fused leaf.
_SEPARATE_PROJECTIONS = frozenset(("w_q", "w_k", "w_v", "w_f", "w_g", "w_b", "conv_q", "conv_k", "conv_v"))
_FUSED_PROJECTIONS = frozenset(("w_in", "conv_qkv", "w_qg"))


def _has_separate_projections(got: dict[hf.Path, tuple], specs: dict[hf.Path, Any]) -> bool:
    """Whether a mixer of `got` holds the separate projections where `specs` declares fused ones."""
    return any(p[-1] in _FUSED_PROJECTIONS and p not in got
               and any(p[:-1] + (old,) in got for old in _SEPARATE_PROJECTIONS) for p in specs)


def _k(k: Any) -> Any:
    # orbax metadata trees may come back with string list indices
    key = hf._key(k)
    return int(key) if isinstance(key, str) and key.isdigit() else key
