"""The ling-jax checkpoint: an orbax params tree plus the official config.json beside it.

    <path>/config.json   `ling_jax.config.to_hf_dict(cfg)`; `from_hf` reads it back
    <path>/params/       orbax StandardCheckpointer tree, the structure of `param_specs(cfg)`

`load_params` restores every leaf straight into its target sharding (orbax reads only each device's slice).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from conversion import hf
from conversion.load import CheckpointError, _sharding_lookup, load_hf, router_dtype_of
from ling_jax.config import LingConfig, from_hf, to_hf_dict
from ling_jax.params import COMPUTE, is_spec, param_specs

PARAMS_DIR = "params"


def save_params(path: str | Path, cfg: LingConfig, params: Any, *, force: bool = False) -> Path:
    """Write `params` (structure of `param_specs(cfg)`) and config.json under `path`; returns `path`."""
    path = Path(path).absolute()
    _check_structure(cfg, jax.tree.map(lambda x: (x.shape, x.dtype), params), "params")
    if (path / PARAMS_DIR).exists() and not force:
        raise FileExistsError(f"{path / PARAMS_DIR} exists; pass force=True to overwrite")
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
    """
    path = Path(path).absolute()
    cfg = from_hf(path / "config.json")
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(path / PARAMS_DIR).item_metadata.tree
        stored = jax.tree.map(lambda m: (tuple(m.shape), jnp.dtype(m.dtype)), stored,
                              is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
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
                   for p, spec in hf.spec_paths(specs).items()]
        target = jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), targets)
        params = ckptr.restore(path / PARAMS_DIR, target)
    return cfg, params


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype=jnp.bfloat16, shardings: Any = None,
            with_mtp: bool = True, progress: bool = True, force: bool = False,
            router_weight_dtype: str | None = None) -> LingConfig:
    """`load_hf` then `save_params`. The whole model passes through device memory: for the full-size preset pass
    `shardings` that spread it over the devices (or a CPU sharding on a host with the RAM)."""
    cfg, params = load_hf(hf_dir, dtype=dtype, shardings=shardings, with_mtp=with_mtp, progress=progress,
                          router_weight_dtype=router_weight_dtype)
    if progress:
        print(f"saving orbax checkpoint to {out_dir}", file=sys.stderr)
    save_params(out_dir, cfg, params, force=force)
    return cfg


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _check_structure(cfg: LingConfig, tree: Any, what: str) -> dict[hf.Path, tuple]:
    """`tree` of (shape, dtype) pairs must have param_specs(cfg)'s structure and shapes; name every difference."""
    specs = hf.spec_paths(param_specs(cfg))
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_pair)
    got = {tuple(_k(k) for k in kp): v for kp, v in flat}
    missing = [hf.path_str(p) for p in specs if p not in got]
    extra = [hf.path_str(p) for p in got if p not in specs]
    shapes = [f"{hf.path_str(p)}: expected {list(s.shape)}, found {list(got[p][0])}"
              for p, s in specs.items() if p in got and tuple(got[p][0]) != s.shape]
    problems = [f"{kind} ({len(items)}): {', '.join(items[:20])}" for kind, items in
                (("missing", missing), ("unexpected", extra), ("wrong shape", shapes)) if items]
    if problems:
        hint = ("\n  (a checkpoint written by an older ling-jax has older layouts, e.g. the MoE router [D, E] before "
                "it became [E, D], or the expert down projections [E, Ie, D] before they became [E, D, Ie]: run "
                "`ling-jax convert` on the HF checkpoint again)") if shapes else ""
        raise CheckpointError(f"{what} does not match param_specs of its config:\n  " + "\n  ".join(problems) + hint)
    return got


def _k(k: Any) -> Any:
    # orbax metadata trees may come back with string list indices
    key = hf._key(k)
    return int(key) if isinstance(key, str) and key.isdigit() else key
