"""The ling-jax checkpoint: an orbax params tree plus the official config.json beside it.

    <path>/config.json     `ling_jax.config.to_hf_dict(cfg)`; `from_hf` reads it back
    <path>/params/         one orbax checkpoint written by partial saves (orbax.checkpoint.experimental.v1.partial)
    <path>/params/state/   its pytree, the structure of `param_specs(cfg)`

`convert` streams: it converts a group of leaves (`GROUP_BYTES` of them, or one larger entry), adds it to the
checkpoint with a partial save, frees it and goes on, so its host memory is about two groups (orbax copies the
arrays it writes) plus one source tensor, however large the model. The groups leave no trace on disk: the
finalised checkpoint is one tree. Checkpoints of older ling-jax versions, one StandardCheckpointer tree directly
under params/, still load; those whose leaves have an older layout are refused, naming it and the fix (convert
again). Block-FP8 projections stored [in, out] (IN_OUT) before they became [out, in] (ROWS) are among them: every
config has a one-input projection (w_kv_a, w_in, a dense MLP) whose two layouts differ in shape, so such a
checkpoint never passes the shape check.

`load_params` restores every leaf straight into its target sharding (orbax reads only each device's slice), so a
checkpoint written from any mesh restores onto any other that divides the sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.v1 import partial
from orbax.checkpoint.experimental.v1._src.partial.path import add_partial_save_suffix

from conversion import hf
from conversion.load import INDEX_NAME, CheckpointError, _sharding_lookup, plan_hf, router_dtype_of, stream_hf
from ling_jax.config import LingConfig, from_hf, to_hf_dict
from ling_jax.params import COMPUTE, is_fp8, is_spec, param_specs
from pallas_kernels.common.fp8 import IN_OUT, ROWS, scale_shape

PARAMS_DIR = "params"
TREE_DIR = "state"  # where orbax's v1 layout keeps the pytree inside params/
# Leaves that one partial save writes together. Small entries (norms, attention projections) share a save; an
# entry larger than this (a layer's stacked experts) is a group of its own: at Flash size, in bf16, ~2 GB.
GROUP_BYTES = 256 * 2**20


def save_params(path: str | Path, cfg: LingConfig, params: Any, *, force: bool = False) -> Path:
    """Write `params` (structure of `param_specs(cfg)`) and config.json under `path`; returns `path`.

    Raises:
      FileExistsError: `path` holds params/ already and `force` is False."""
    path = Path(path).absolute()
    _check_structure(cfg, jax.tree.map(lambda x: (x.shape, x.dtype), params), "params")
    _refuse_overwrite(path, force)
    path.mkdir(parents=True, exist_ok=True)
    with _partial_saves(path / PARAMS_DIR) as add:
        add(params)
    (path / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2) + "\n")
    return path


@contextlib.contextmanager
def _partial_saves(params_dir: Path):
    """`add(subtree)` writes a part of the params tree (None where other parts go); on exit the parts become one
    checkpoint at `params_dir`. A pending copy left by an interrupted conversion is discarded first, and an
    existing `params_dir` replaced (callers refuse to overwrite unless forced)."""
    pending = Path(add_partial_save_suffix(params_dir))
    for stale in (pending, params_dir):
        if stale.exists():
            shutil.rmtree(stale)
    yield lambda tree: partial.save(params_dir, tree)
    partial.finalize(params_dir)


def load_params(path: str | Path, *, shardings: Any = None, dtype=None) -> tuple[LingConfig, Any]:
    """Restore (cfg, params) from a directory `save_params` or `convert` wrote, from any mesh onto any other.

    Args:
      shardings: None (default device), one Sharding for every leaf, or a pytree shaped like `param_specs(cfg)`
        (e.g. `ling_jax.sharding.param_shardings(cfg, make_mesh(n))`); each device reads only its own slice.
      dtype: None keeps COMPUTE params' stored dtypes, otherwise they become `dtype`; FP32-class params are float32
        either way (`ParamSpec.dtype`), the routers as stored (`cfg.router_weight_dtype`: bfloat16 when every
        stored router is, else float32).

    Raises:
      CheckpointError: `path` is missing, is an HF safetensors directory (`load_hf` reads those), lacks params/ or
        config.json, or orbax cannot read params/; every message names the directory and the fix.
    """
    path = Path(path).absolute()
    cfg = read_config(path)
    tree_dir = _tree_dir(path / PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        stored = _stored_shapes(ckptr, tree_dir, path / PARAMS_DIR)
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
        with _absl_quiet(), explain_read_errors(path / PARAMS_DIR):  # orbax warns that v1's pytree directory
            params = ckptr.restore(tree_dir, target)                   # lacks a v0 _CHECKPOINT_METADATA
    return cfg, params


@contextlib.contextmanager
def explain_read_errors(params_dir: Path):
    """A failed restore as one CheckpointError naming the array that could not be read. tensorstore reports a
    truncated or missing data file from its read threads, wrapped (orbax raises a bare Exception around it); the
    reads still in flight then report into orbax's closed event loop, which `_quiet_abandoned_reads` silences."""
    try:
        yield
    except Exception as e:
        _quiet_abandoned_reads()
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        array = re.search(r'in "([^"/]+)/', str(cause))
        what = f"the stored array {array.group(1)}" if array else "it"
        raise CheckpointError(f"{params_dir}: orbax cannot restore {what} ({_read_failure(cause)}); its data files "
                              "are truncated or damaged: copy the checkpoint again, or convert the HF checkpoint "
                              "again (`ling-jax convert ... --force`)") from None


def _read_failure(e: Exception) -> str:
    """tensorstore's reason for a failed read, without the paths and offsets that lead up to it."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line.rpartition(": ")[2] or line


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
            router_weight_dtype: str | None = None, fp8: bool | None = None,
            group_bytes: int = GROUP_BYTES) -> LingConfig:
    """Convert an official checkpoint directory to a ling-jax one at `out_dir`, streaming: each group of leaves
    (`group_bytes` of them, or one larger entry) is converted straight into `shardings` (as `load_hf` does), added
    to the orbax checkpoint and freed before the next is read. Host memory stays about two groups plus one source
    tensor (on CPU the devices' shards live in host memory too), whatever the model's size.

    Args:
      hf_dir, dtype, shardings, with_mtp, progress, router_weight_dtype, fp8: as `load_hf`'s (`fp8` True
        quantises to block-FP8).
      force: replace an existing `out_dir`/params.
      group_bytes: leaf bytes one partial save writes; more saves take longer, larger ones hold more memory.

    Returns:
      The cfg of the written params (`load_hf`'s).

    Raises:
      FileExistsError: `out_dir`/params exists and `force` is False (checked before anything is read).
      CheckpointError, ConfigError: as `load_hf`.
    """
    out_dir = Path(out_dir).absolute()
    _refuse_overwrite(out_dir, force)  # before minutes of loading, not after
    plan = plan_hf(hf_dir, dtype=dtype, shardings=shardings, with_mtp=with_mtp,
                   router_weight_dtype=router_weight_dtype, fp8=fp8, stacklevel=3)
    ends = _group_ends([plan.leaf_bytes(e) for e in plan.entries], group_bytes)
    if progress:
        print(f"writing orbax checkpoint to {out_dir} in {len(ends)} parts", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _partial_saves(out_dir / PARAMS_DIR) as add, contextlib.closing(stream_hf(plan, progress=progress)) as stream:
        group: dict[hf.Path, Any] = {}
        # No enumerate: its reused result tuple would hold one entry's leaves while the next entry is placed.
        for k in range(len(plan.entries)):
            group.update(next(stream)[1])
            if k in ends:
                add(_subtree(group))
                group.clear()
                _release_memory()
    (out_dir / "config.json").write_text(json.dumps(to_hf_dict(plan.cfg), indent=2) + "\n")
    return plan.cfg


def _release_memory() -> None:
    """Return a written group's memory now: glibc keeps the freed pages of tensorstore's write buffers (some
    hundred MB per large leaf on CPU) unless asked; collecting first frees whatever only reference cycles held."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to return
        ctypes.CDLL(None).malloc_trim(0)


def _group_ends(sizes: list[int], group_bytes: int) -> set[int]:
    """Indices of the entries that close a group: consecutive entries fill a group up to `group_bytes`; one larger
    entry is a group of its own."""
    ends, size = set(), 0
    for k, n in enumerate(sizes):
        if size and size + n > group_bytes:
            ends.add(k - 1)
            size = 0
        size += n
    return ends | {len(sizes) - 1} if sizes else ends


def _subtree(leaves: dict[hf.Path, Any]) -> dict:
    """The params tree holding only `leaves` (lists padded with None before the layers they hold)."""
    root: dict = {}
    for path, value in leaves.items():
        node = root
        for key, below in zip(path[:-1], path[1:]):
            node = _child(node, key, [] if isinstance(below, int) else {})
        _put(node, path[-1], value)
    return root


def _child(node: dict | list, key: Any, empty: dict | list) -> dict | list:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _put(node: dict | list, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def _refuse_overwrite(path: Path, force: bool) -> None:
    if (path / PARAMS_DIR).exists() and not force:
        raise FileExistsError(f"{path / PARAMS_DIR} exists; pass force=True to overwrite it, or choose another "
                              "directory")


def _tree_dir(params_dir: Path) -> Path:
    """Where the orbax pytree of params/ lives: params/state (partial saves), or params/ itself (the one
    StandardCheckpointer tree of older ling-jax versions)."""
    return params_dir if (params_dir / "_METADATA").is_file() else params_dir / TREE_DIR


def _stored_shapes(ckptr: ocp.StandardCheckpointer, tree_dir: Path, params_dir: Path) -> Any:
    """The stored tree of (shape, dtype) pairs; CheckpointError (naming `params_dir`) when orbax finds no readable
    checkpoint there."""
    _check_store(tree_dir, params_dir)
    with _absl_quiet():  # orbax logs each failed read itself; the error below says it once
        try:
            tree = ckptr.metadata(tree_dir).item_metadata
            reason = "its metadata files are missing or unreadable"
        except (ValueError, OSError) as e:
            tree, reason = None, _first_line(e)
    if tree is None:
        _quiet_abandoned_reads()
        raise CheckpointError(f"{params_dir}: orbax cannot read it ({reason}); it was not written by "
                              "`ling-jax convert` or the copy is incomplete: copy it again, or convert the HF "
                              "checkpoint again (`ling-jax convert ... --force`)")
    return jax.tree.map(lambda m: (tuple(m.shape), jnp.dtype(m.dtype)), tree.tree,
                        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def _check_store(tree_dir: Path, params_dir: Path) -> None:
    """The OCDBT database under `tree_dir` (its manifest and index files) listed directly. orbax's own metadata
    read swallows a damaged index file and reports missing metadata instead, then leaves reads running into its
    closed event loop; listing first names the file and starts nothing."""
    if not (tree_dir / "manifest.ocdbt").is_file():
        return
    import tensorstore as ts

    try:
        ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tree_dir}/"}).result().list().result()
    except ValueError as e:
        file = re.search(r'local file "([^"]+)"', str(e))
        name = Path(file.group(1)).relative_to(params_dir.parent) if file else tree_dir.relative_to(params_dir.parent)
        raise CheckpointError(f"{params_dir}: its file {name} is truncated or damaged ({_read_failure(e)}): copy "
                              "the checkpoint again, or convert the HF checkpoint again (`ling-jax convert ... "
                              "--force`)") from None


def _quiet_abandoned_reads() -> None:
    """After a failed restore, the reads orbax abandoned finish into its closed event loop: each prints `RuntimeError:
    Event loop is closed` (as an unraisable exception), `Future exception was never retrieved`, or, for a read
    coroutine closed with its own read error pending, that error as an unraisable exception. Those lines only
    repeat the error already raised, so they are dropped from then on; every other report passes."""
    previous = sys.unraisablehook

    def hook(unraisable):
        closed_loop = isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
            unraisable.exc_value)
        code = getattr(unraisable.object, "cr_code", None)
        abandoned_read = getattr(code, "co_name", "") == "_read_array_index_and_device_put"
        if not (closed_loop or abandoned_read):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())


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
        in_out = _in_out_projection(got, cfg)
        if in_out:
            hints.append(f"it holds the block-FP8 projections of an older ling-jax, stored [in, out] with one scale "
                         f"per 128 input rows and output column ({in_out}); ling-jax now stores them [out, in], "
                         "each output row contiguous for the FP8 GEMV: run `ling-jax convert` on the HF checkpoint "
                         "again")
        elif shapes:
            hints.append("a checkpoint written by an older ling-jax has older layouts, e.g. the MoE router [D, E] "
                         "before it became [E, D], or the expert down projections [E, Ie, D] before they became "
                         "[E, D, Ie]: run `ling-jax convert` on the HF checkpoint again")
        raise CheckpointError(f"{what} does not match param_specs of its config:\n  " + "\n  ".join(problems)
                              + "".join(f"\n  ({h})" for h in hints))
    return got


def _in_out_projection(got: dict[hf.Path, tuple], cfg: LingConfig) -> str:
    """'path [stored] where [out, in] is [declared]' of the first block-FP8 projection that `got` holds in the
    older IN_OUT layout ([*in, *out], pallas_kernels/common/fp8.py) where param_specs declares ROWS; '' if none."""
    for path, spec in hf.spec_paths(param_specs(cfg)).items():
        if not (is_fp8(spec) and spec.layout == ROWS):
            continue
        n_out = len(spec.q.shape) - spec.n_in
        old = spec.q.shape[n_out:] + spec.q.shape[:n_out]
        stored = tuple(got.get(path + ("q",), ((),))[0]), tuple(got.get(path + ("scale",), ((),))[0])
        if stored == (old, scale_shape(old, IN_OUT, spec.n_in)) != (spec.q.shape, spec.scale.shape):
            return f"{hf.path_str(path + ('q',))} {list(old)} where [out, in] is {list(spec.q.shape)}"
    return ""


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
