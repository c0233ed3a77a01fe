"""Load an official Ling-3 checkpoint directory (config.json + safetensors shards) into a params pytree.

Everything is validated from the safetensors headers before a single tensor is read: one `CheckpointError`
lists every missing, unexpected, duplicate and mis-shaped tensor and a vocab mismatch, led by any layer whose
tensors are of another kind than config.json's layer schedule (`plan_hf`). Then the tensors stream one `hf.Entry`
at a time (`stream_hf`: one tensor; the E experts of one layer, stacked on [E]; or the projections one fused leaf
packs, each in its slice of that leaf) straight into the device shards that own them: each distinct shard is
assembled on the host from the slices of the sources it overlaps (an expert's rows read alone), cast, put on its
devices and freed. The host holds one source tensor (or a slice of it) and one shard at a time, never a whole
stacked expert array; a replicated leaf is one array. Sharded or not, the leaves hold the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from conversion import fp8_blocks, hf
from ling_jax.config import (DENSE, HF_FFN_NAMES, HF_MIXER_NAMES, KDA, MLA, MOE, LingConfig, from_hf,
                             read_config_json, read_json)
from ling_jax.params import is_leaf_spec, param_specs
from pallas_kernels.common.fp8 import OUT_IN, Fp8Weight, scale_shape

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
FP8_STORED = "F8_E4M3"
_MAX_LISTED = 40  # per problem kind; the count is always exact


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold the tensors its config.json describes; lists every problem."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str  # shard file name inside the checkpoint directory
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: BF16, F32, ...

    @property
    def nbytes(self) -> int:
        itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                    "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}.get(self.dtype, 1)
        return itemsize * int(np.prod(self.shape))


def read_catalog(hf_dir: str | Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """{name: TensorInfo} from the shard headers, plus problems (missing shard files, duplicates, stale index).

    The shards themselves are the truth; the index only says which files to open and must agree with them.
    """
    hf_dir = Path(hf_dir)
    problems: list[str] = []
    index_path = hf_dir / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        files = sorted(set(weight_map.values()))
    elif (hf_dir / SINGLE_NAME).is_file():
        weight_map, files = {}, [SINGLE_NAME]
    else:
        raise CheckpointError(f"no {INDEX_NAME} or {SINGLE_NAME} in {hf_dir}: not a safetensors checkpoint")
    absent = [file for file in files if not (hf_dir / file).is_file()]
    if absent:  # a copy problem, not a config one: named before any header is read
        raise CheckpointError(f"{len(absent)} shard file(s) named in {INDEX_NAME} are missing from {hf_dir}:\n  "
                              + "\n  ".join(absent) + "\n  re-download or re-copy them")
    catalog: dict[str, TensorInfo] = {}
    duplicates: dict[str, list[str]] = {}
    corrupt: list[str] = []
    for file in files:
        try:
            with safe_open(hf_dir / file, framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    info = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
                    if name in catalog:
                        duplicates.setdefault(name, [catalog[name].file]).append(file)
                    catalog[name] = info
        except SafetensorError as e:
            corrupt.append(f"{file}: {e}")
    if corrupt:
        raise CheckpointError(f"{len(corrupt)} safetensors shard(s) in {hf_dir} cannot be read (truncated or "
                              "corrupt):\n  " + "\n  ".join(corrupt) + "\n  re-download or re-copy these shard files")
    for name, where in duplicates.items():
        problems.append(f"duplicate tensor {name} in shards {', '.join(where)}")
    stale = [n for n, file in weight_map.items() if (hf_dir / file).is_file() and catalog.get(n, None) is None]
    if stale:
        problems.append(_listing(f"named in {INDEX_NAME} but absent from their shard", stale))
    misplaced = [n for n, file in weight_map.items() if n in catalog and catalog[n].file != file
                 and n not in duplicates]
    if misplaced:
        problems.append(_listing(f"in a different shard than {INDEX_NAME} says", misplaced))
    return catalog, problems


def _read_weight_map(index_path: Path) -> dict[str, str]:
    index = read_json(index_path, CheckpointError, "re-download or re-copy it")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index_path} has no \"weight_map\" object of tensor name -> shard file: re-download "
                              f"or re-copy it (or delete it to read a single {SINGLE_NAME})")
    return weight_map


def has_mtp_tensors(catalog: dict[str, TensorInfo], cfg: LingConfig) -> bool:
    prefix = hf.layer_prefix(cfg.num_layers)
    return any(n.startswith(prefix) for n in catalog)


def validate(cfg: LingConfig, catalog: dict[str, TensorInfo], entries: list[hf.Entry], *,
             ignore_prefix: str | None = None, problems: list[str] | None = None,
             schedule_lists: Sequence[str] = (), quantizing: bool = False) -> None:
    """Raise one CheckpointError naming every way `catalog` differs from what `entries` expect.

    A layer whose tensors describe another mixer or ffn than the schedule comes first, as its own problem: its
    missing and unexpected tensors follow from it. `schedule_lists` names the lists config.json holds
    (layer_types, mlp_layer_types), so that the message says where the schedule came from.

    Block-FP8 (docs/model.md §4): every F8_E4M3 tensor needs its `<name>_scale_inv` F32 [ceil(out/128),
    ceil(in/128)]; a float tensor feeding a leaf `param_specs` declares FP8 is quantised (`quantizing`; a warning
    lists them when the checkpoint is itself FP8, `quantizing` False); an F8 tensor feeding an unquantised leaf is
    dequantised.
    """
    conflicts = _schedule_conflicts(cfg, catalog, schedule_lists)
    problems = ([conflicts] if conflicts else []) + list(problems or [])
    expected: dict[str, tuple[hf.Entry, int]] = {}
    for entry in entries:
        for i, names in enumerate(entry.sources):
            for name in names:
                expected[name] = (entry, i)

    vocab_rows = {"model.word_embeddings.weight": 0, "lm_head.weight": 0}
    for name, axis in vocab_rows.items():
        if name in catalog and catalog[name].shape and catalog[name].shape[axis] != cfg.vocab_size:
            problems.append(f"vocab mismatch: {name} has {catalog[name].shape[axis]} rows but config.json "
                            f"vocab_size={cfg.vocab_size}; the config and the weights come from different models")

    missing, shapes, dtypes, aliases, scales, unquantised = [], [], [], [], [], []
    packed_into: dict[str, str] = {}  # a fused entry's source name -> what a missing-tensor line says of it
    for entry in entries:
        for i, names in enumerate(entry.sources):
            present = [n for n in names if n in catalog]
            if not present:
                missing.append(names[0])
                if entry.fused:
                    packed_into[names[0]] = f"one of the {len(entry.sources)} tensors packed into {_leaf_names(entry)}"
            elif len(present) > 1:
                aliases.append(f"{' and '.join(present)} (both name {_leaf_names(entry)})")
            for name in present:
                info, want = catalog[name], entry.source_shape(i)
                if info.shape != want and not (name in vocab_rows and info.shape[1:] == want[1:]):
                    shapes.append(f"{name}: expected {list(want)} (for {_leaf_names(entry)}), found {list(info.shape)}")
                if info.dtype == FP8_STORED:
                    scale = fp8_blocks.scale_name(name)
                    expected[scale] = (entry, i)
                    scales.extend(_scale_problems(name, scale, catalog, want))
                elif info.dtype not in _FLOAT_DTYPES:
                    dtypes.append(f"{name}: {info.dtype} (for {_leaf_names(entry)})")
                elif entry.fp8 and not quantizing:
                    unquantised.append(f"{name}: {info.dtype} (for {_leaf_names(entry)})")
    unexpected = [n for n in catalog if n not in expected and not (ignore_prefix and n.startswith(ignore_prefix))]

    if missing:
        problems.append(_listing("missing", missing, lambda n: packed_into.get(n, "")))
    if unexpected:
        problems.append(_listing("unexpected", unexpected, lambda n: hf.explain_unexpected(n, cfg)))
    if aliases:
        problems.append(_listing("duplicate (two names for one tensor)", aliases))
    if shapes:
        problems.append(_listing("wrong shape", shapes))
    if dtypes:
        problems.append(_listing("not a float or F8_E4M3 dtype (ling-jax reads the BF16 and the block-FP8 releases)",
                                 dtypes))
    if scales:
        problems.append(_listing("FP8 scale missing or malformed", scales))
    if unquantised:
        warnings.warn(_listing("stored as floats though the leaves they feed are block-FP8; quantised as the release "
                               "quantises (conversion/fp8_blocks.py)", unquantised), stacklevel=3)
    if problems:
        raise CheckpointError(f"checkpoint does not match its config.json ({len(problems)} problem kinds):\n  "
                              + "\n  ".join(problems))


def _scale_problems(name: str, scale: str, catalog: dict[str, TensorInfo], shape: tuple[int, ...]) -> list[str]:
    want = list(fp8_blocks.scale_shape(shape))
    if scale not in catalog:
        return [f"{scale}: absent, but {name} is F8_E4M3 (its 128x128 block scales, F32 {want})"]
    info = catalog[scale]
    if info.dtype != "F32":
        return [f"{scale}: stored {info.dtype}; block scales are F32 (the release's weight_scale_inv)"]
    if list(info.shape) != want:
        return [f"{scale}: expected {want} (ceil(out/128), ceil(in/128) of {name} {list(shape)}), found "
                f"{list(info.shape)}"]
    return []


def _schedule_conflicts(cfg: LingConfig, catalog: dict[str, TensorInfo], schedule_lists: Sequence[str]) -> str:
    """One line per main layer whose tensors are of another kind than the schedule says, and the fix; '' if none."""
    lines, fixes = [], {"layer_types": [], "mlp_layer_types": []}
    for layer, held in sorted(hf.held_kinds(list(catalog), cfg.num_layers).items()):
        for field, want, have in (("layer_types", cfg.mixer_kind(layer), held[0]),
                                  ("mlp_layer_types", cfg.ffn_kind(layer), held[1])):
            if have is None or have == want:
                continue
            names = HF_MIXER_NAMES if field == "layer_types" else HF_FFN_NAMES
            lines.append(f"layer {layer}: {_schedule_source(cfg, field, schedule_lists)} says {names[want]} "
                         f"({_KIND_NAMES[want]}) but the checkpoint holds {_KIND_NAMES[have]} tensors")
            fixes[field].append(f'{field}[{layer}] = "{names[have]}"')
    for field, items in fixes.items():
        if items:
            what = (f"correct {field} in config.json:" if _explicit(cfg, field, schedule_lists)
                    else f"add {field} to config.json (one entry per main layer) with")
            lines.append(f"fix: {what} {', '.join(items)}")
    if not lines:
        return ""
    return "layer schedule of config.json differs from the tensors:\n      " + "\n      ".join(lines)


_KIND_NAMES = {KDA: "KDA", MLA: "MLA", DENSE: "dense MLP", MOE: "MoE"}


def _explicit(cfg: LingConfig, field: str, schedule_lists: Sequence[str]) -> bool:
    return field in schedule_lists or bool(cfg.mixer_schedule if field == "layer_types" else cfg.ffn_schedule)


def _schedule_source(cfg: LingConfig, field: str, schedule_lists: Sequence[str]) -> str:
    if _explicit(cfg, field, schedule_lists):
        return f"config.json {field}"
    if field == "layer_types":
        return f"the layer_group_size={cfg.layer_group_size} rule (config.json has no layer_types)"
    return f"the first_k_dense_replace={cfg.first_k_dense_replace} rule (config.json has no mlp_layer_types)"


def load_hf(hf_dir: str | Path, *, dtype=None, shardings: Any = None, with_mtp: bool = True,
            progress: bool = True, router_weight_dtype: str | None = None,
            fp8: bool | None = None) -> tuple[LingConfig, Any]:
    """Read an official checkpoint directory into (cfg, params).

    Args:
      hf_dir: directory with config.json and `model.safetensors.index.json` + shards (or one `model.safetensors`).
      dtype: dtype of COMPUTE params; None (default) takes the checkpoint's, the stored dtype of
        `model.word_embeddings.weight` (BF16 -> bfloat16, F32 -> float32; any other must be passed explicitly).
        FP32-class params (A_log, dt_bias, convs, expert_bias) load as float32 whatever this is
        (`ParamSpec.dtype`), the routers as `router_weight_dtype` says.
      shardings: None (default device), one `jax.sharding.Sharding` for every leaf, or a pytree of shardings
        shaped like `param_specs(cfg)` (extra leaves, e.g. an unused "mtp" subtree, are ignored). Each device's
        shard is assembled on the host from the slices of the source tensors it owns, so the host holds one
        source tensor (or a slice of it) and one shard at a time, never a whole stacked [E, ...] expert array.
      with_mtp: True loads the MTP layer `model.layers.{num_hidden_layers}.*` when config.json declares it. If
        the checkpoint holds no tensor under that prefix at all (what transformers' `save_pretrained` writes),
        the model loads without it and a warning says so; a partial MTP layer is an error. False skips the MTP
        tensors (they are not reported as unexpected).
      progress: show a tqdm bar over the bytes read.
      router_weight_dtype: None keeps the routers (`mlp.gate.weight`) as stored: bfloat16 when every loaded one is
        stored BF16, else float32 (`stored_router_dtype`); "float32" widens them anyway. Either gives the same
        logits (fp32 products of the stored values); a bf16 router reads half the bytes.
      fp8: None keeps the checkpoint's format (block-FP8 when config.json has the release's quantization_config);
        True quantises float weights to block-FP8 as the release does (conversion/fp8_blocks.py); False
        dequantises FP8 weights to `dtype`. `cfg.quantization` says which the params hold.

    Returns:
      (cfg, params). `cfg` always describes `params`: when the MTP layer is not loaded, `cfg.num_mtp_layers` is 0,
      so `param_specs(cfg)` has the structure of `params`. Main-model logits never need the MTP layer.
      `cfg.router_weight_dtype` is the routers' dtype.

    Raises:
      ConfigError: config.json is missing, of an unknown model_type, or invalid.
      CheckpointError: the tensors differ from what config.json implies (every difference listed), a shard or the
        index cannot be read, or dtype=None and the stored dtype is neither BF16 nor F32.
    """
    plan = plan_hf(hf_dir, dtype=dtype, shardings=shardings, with_mtp=with_mtp,
                   router_weight_dtype=router_weight_dtype, fp8=fp8, stacklevel=3)
    arrays: dict[hf.Path, Any] = {}
    with contextlib.closing(stream_hf(plan, progress=progress)) as leaves:
        for _, placed in leaves:
            arrays.update(placed)
    specs = param_specs(plan.cfg)
    treedef = jax.tree.structure(specs, is_leaf=is_leaf_spec)
    return plan.cfg, jax.tree.unflatten(treedef, [arrays[p] for p in hf.spec_paths(specs)])


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """A checkpoint validated against its config, with every leaf's target sharding known; nothing read yet.

    `cfg` describes the params that `stream_hf` yields (the MTP layer dropped when it is not loaded); `placement`
    maps each array leaf (an FP8 weight's at path + ("q",) and + ("scale",)) to its Sharding, None for the default
    device."""
    hf_dir: Path
    cfg: LingConfig
    entries: list[hf.Entry]
    catalog: dict[str, TensorInfo]
    dtype: Any
    placement: dict[hf.Path, Any]

    def entry_bytes(self, entry: hf.Entry) -> int:
        """The checkpoint bytes `entry` reads: its source tensors and, for F8_E4M3 ones, their block scales."""
        total = 0
        for names in entry.sources:
            info = self.catalog[_present(names, self.catalog)]
            total += info.nbytes
            if info.dtype == FP8_STORED:
                total += self.catalog[fp8_blocks.scale_name(_present(names, self.catalog))].nbytes
        return total

    def leaf_bytes(self, entry: hf.Entry) -> int:
        """The bytes of the leaves `entry` becomes (FP8: values and scales)."""
        return sum(math.prod(shape) * dt.itemsize for _, shape, dt in _array_leaves(entry, self.dtype))


def plan_hf(hf_dir: str | Path, *, dtype=None, shardings: Any = None, with_mtp: bool = True,
            router_weight_dtype: str | None = None, fp8: bool | None = None, stacklevel: int = 2) -> LoadPlan:
    """Read config.json and the shard headers, validate them, and resolve every leaf's sharding (`load_hf`'s
    arguments and errors); no tensor is read."""
    if router_weight_dtype not in (None, "float32"):
        raise ValueError(f"{router_weight_dtype=} must be None (the routers as stored) or 'float32' (widened); a "
                         "bf16 copy of an fp32 router would move near-tie selections")
    hf_dir = Path(hf_dir)
    raw = read_config_json(hf_dir)
    cfg = from_hf(raw)
    catalog, problems = read_catalog(hf_dir)
    mtp_prefix = hf.layer_prefix(cfg.num_layers)
    load_mtp = bool(with_mtp and cfg.num_mtp_layers)
    if load_mtp and not has_mtp_tensors(catalog, cfg):
        msg = (f"{hf_dir}: config.json declares num_nextn_predict_layers={cfg.num_mtp_layers} but the checkpoint has "
               f"no {mtp_prefix}* tensors (transformers' save_pretrained drops them); loading without the MTP layer")
        warnings.warn(msg, stacklevel=stacklevel)
        load_mtp = False
    ignore = mtp_prefix if (cfg.num_mtp_layers and not load_mtp) else None
    stored_fp8 = cfg.quantization == "fp8"
    target_fp8 = stored_fp8 if fp8 is None else bool(fp8)
    cfg = cfg.replace(router_weight_dtype=router_weight_dtype or stored_router_dtype(catalog, ignore_prefix=ignore),
                      quantization="fp8" if target_fp8 else None)
    entries = hf.plan(cfg, with_mtp=load_mtp)
    validate(cfg, catalog, entries, ignore_prefix=ignore, problems=problems,
             schedule_lists=[n for n in ("layer_types", "mlp_layer_types") if raw.get(n) is not None],
             quantizing=target_fp8 and not stored_fp8)
    dtype = stored_compute_dtype(catalog) if dtype is None else dtype
    sharding_of = _sharding_lookup(shardings)
    placement = {path + part: sharding_of(path + part) for entry in entries for path in entry.paths
                 for part in ((("q",), ("scale",)) if entry.fp8 else ((),))}  # fail before reading
    return LoadPlan(hf_dir, cfg if load_mtp else without_mtp(cfg), entries, catalog, dtype, placement)


def stream_hf(plan: LoadPlan, *, progress: bool = True) -> Iterator[tuple[hf.Entry, dict[hf.Path, Any]]]:
    """Yield (entry, {params path: placed leaf}) for each entry of `plan` in params order: jax.Arrays, or
    Fp8Weights of them, already on the devices `plan.placement` names. Between two entries the host holds nothing
    of the checkpoint; a caller that frees the leaves it is given (orbax_io.convert) converts in bounded memory.

    Raises:
      CheckpointError: a shard cannot be read."""
    reader = _Reader(plan.hf_dir, plan.catalog)
    with _progress(sum(map(plan.entry_bytes, plan.entries)), f"load {plan.hf_dir.name}", progress) as bar:
        for entry in plan.entries:
            yield entry, _place_entry(entry, reader, plan)
            bar.update(plan.entry_bytes(entry))


class _Fp8Source(tuple):
    """An F8_E4M3 checkpoint tensor with its block scale: (q [out, in], scale_inv [ceil(out/128), ceil(in/128)])."""


_NP_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "BF16": np.dtype(jnp.bfloat16), FP8_STORED: fp8_blocks.FP8_NP}


class _Reader:
    """Source tensors, whole or sliced, read by the header offsets of their shard files (`fp8_blocks.read_raw`):
    plain reads, not a memory map, so what the host holds is what the loader keeps. Read errors as
    CheckpointError."""

    def __init__(self, hf_dir: Path, catalog: dict[str, TensorInfo]):
        self.hf_dir, self.catalog = hf_dir, catalog

    def name(self, names: tuple[str, ...]) -> str:
        return _present(names, self.catalog)

    def whole(self, names: tuple[str, ...]) -> np.ndarray | _Fp8Source:
        """The source tensor as stored; an F8_E4M3 one with its block scale."""
        name = self.name(names)
        if self.catalog[name].dtype == FP8_STORED:
            return _Fp8Source((self.slice(name, ()), self.slice(fp8_blocks.scale_name(name), ())))
        return self.slice(name, ())

    def slice(self, name: str, index: tuple) -> np.ndarray:
        """`name[index]`, reading only the rows `index` spans."""
        info = self.catalog[name]
        try:
            return fp8_blocks.read_raw(self.hf_dir / info.file, name, info.shape, _NP_DTYPES[info.dtype], index)
        except (OSError, ValueError, KeyError, struct.error) as e:
            if info.dtype == FP8_STORED or name.endswith(fp8_blocks.SCALE_SUFFIX):
                raise CheckpointError(f"{name} in {self.hf_dir} cannot be read ({e}): re-download or re-copy its "
                                      "shard") from None
            raise CheckpointError(f"shard {info.file} in {self.hf_dir} cannot be read ({e}): re-download or re-copy "
                                  "that shard file") from None


def _array_leaves(entry: hf.Entry, dtype) -> list[tuple[hf.Path, tuple[int, ...], np.dtype]]:
    """(path, shape, dtype) of each array the entry's leaves hold: an FP8 leaf's values and scale."""
    out = []
    for path, spec in zip(entry.paths, entry.specs):
        if entry.fp8:
            layout, n_in = entry.fp8
            out += [(path + ("q",), spec.shape, fp8_blocks.FP8_NP),
                    (path + ("scale",), scale_shape(spec.shape, layout, n_in), np.dtype(np.float32))]
        else:
            out.append((path, spec.shape, np.dtype(spec.dtype(dtype))))
    return out


def _place_entry(entry: hf.Entry, reader: _Reader, plan: LoadPlan) -> dict[hf.Path, Any]:
    """The entry's leaves on their devices. A tensor that fills whole leaves is read once and each shard cut from
    it; a stacked or fused leaf is assembled shard by shard, each source tensor read (sliced where its layout
    allows) for the shards it overlaps."""
    leaves = _array_leaves(entry, plan.dtype)
    if entry.stacked or entry.fused:
        arrays = [_place(shape, plan.placement[path],
                         functools.partial(_assemble, entry, shape, target,
                                           functools.partial(_piece, entry, reader, path[-1] if entry.fp8 else None)))
                  for path, shape, target in leaves]
    else:
        full = _whole_params(entry, reader)
        arrays = [_place(shape, plan.placement[path], lambda index, x=x, t=target: np.ascontiguousarray(x[index], t))
                  for (path, shape, target), x in zip(leaves, full)]
        del full
    if not entry.fp8:
        return {path: a for (path, _, _), a in zip(leaves, arrays)}
    layout, n_in = entry.fp8
    return {path: Fp8Weight(q, s, layout, n_in) for path, q, s in zip(entry.paths, arrays[::2], arrays[1::2])}


def _whole_params(entry: hf.Entry, reader: _Reader) -> list[np.ndarray]:
    """The params arrays of an entry of whole leaves, as `_array_leaves` lists them (FP8: q, scale per leaf), in
    the source's dtype or float32: each shard is cast on its own."""
    x = reader.whole(entry.sources[0])
    if not entry.fp8:
        return list(entry.source_to_params(0, fp8_blocks.dequantize(*x) if isinstance(x, _Fp8Source) else x))
    q, s = x if isinstance(x, _Fp8Source) else fp8_blocks.quantize(x)
    return [a for pair in zip(entry.source_to_params(0, q), entry.scale_to_params(0, s)) for a in pair]


def _piece(entry: hf.Entry, reader: _Reader, part: str | None, i: int, index: tuple) -> np.ndarray:
    """`index` of source i's piece of a stacked or fused leaf (part "q"/"scale" of an FP8 one, None otherwise).

    An expert's tensor is its piece unchanged, so a stored tensor of the leaf's kind is read sliced; anything else
    (a fused part's transform, quantising a float source, dequantising an F8 one) reads the whole source tensor."""
    name = reader.name(entry.sources[i])
    stored_fp8 = reader.catalog[name].dtype == FP8_STORED
    as_stored = (entry.stacked and entry.transform is hf.IDENTITY
                 and entry.source_shape(i) == entry.source_specs(i)[0].shape)
    if as_stored and not entry.fp8 and not stored_fp8:
        return reader.slice(name, index)
    if as_stored and entry.fp8 and stored_fp8 and (part == "q" or entry.fp8[0] == OUT_IN):
        # OUT_IN scales are the checkpoint's own 128x128 blocks, so they too are read as stored.
        return reader.slice(name if part == "q" else fp8_blocks.scale_name(name), index)
    x = reader.whole(entry.sources[i])
    if not entry.fp8:
        return entry.source_to_params(i, fp8_blocks.dequantize(*x) if isinstance(x, _Fp8Source) else x)[0][index]
    q, s = x if isinstance(x, _Fp8Source) else fp8_blocks.quantize(x)
    return (entry.source_to_params(i, q) if part == "q" else entry.scale_to_params(i, s))[0][index]


def _assemble(entry: hf.Entry, shape: tuple[int, ...], target: np.dtype, piece: Callable[[int, tuple], np.ndarray],
              index: tuple) -> np.ndarray:
    """The shard `index` of a stacked or fused leaf of `shape`: each source whose slot overlaps it contributes the
    overlapping part of its piece (`piece(i, index into the piece)`)."""
    bounds = [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(_full_index(index, len(shape)), shape)]
    out = np.empty([hi - lo for lo, hi in bounds], target)
    for i in range(len(entry.sources)):
        dst, src = [], []
        for (lo, hi), slot, n in zip(bounds, _full_index(entry.slot(i), len(shape)), shape):
            if isinstance(slot, int):  # the piece lacks this axis
                if not lo <= slot < hi:
                    break
                dst.append(slot - lo)
                continue
            start, stop = slot.start or 0, n if slot.stop is None else slot.stop
            a, b = max(start, lo), min(stop, hi)
            if a >= b:
                break
            dst.append(slice(a - lo, b - lo))
            src.append(slice(a - start, b - start))
        else:
            out[tuple(dst)] = piece(i, tuple(src)).astype(target, copy=False)
    return out


def _full_index(index: tuple, ndim: int) -> list:
    """`index` (slices, ints, at most one Ellipsis) as one int or slice per axis."""
    index = tuple(index)
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (ndim - len(index) + 1) + index[k + 1:]
    return list(index) + [slice(None)] * (ndim - len(index))


def _place(shape: tuple[int, ...], sharding: Any, build: Callable[[tuple], np.ndarray]) -> jax.Array:
    """A jax.Array of `shape` laid out as `sharding` (None: the default device), each distinct shard built on the
    host by `build(index)` and freed once on its devices: the host holds one shard at a time."""
    if sharding is None:
        return jax.device_put(build(tuple(slice(None) for _ in shape))).block_until_ready()
    index_map = sharding.addressable_devices_indices_map(shape)
    owners: dict[tuple, tuple[tuple, list]] = {}
    for device, index in index_map.items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        owners.setdefault(key, (index, []))[1].append(device)
    shards = {}
    for index, devices in owners.values():
        host = build(index)
        for device in devices:
            shards[device] = jax.device_put(host, device).block_until_ready()
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in index_map])


_STORED_COMPUTE_DTYPES = {"BF16": jnp.bfloat16, "F32": jnp.float32}


def stored_compute_dtype(catalog: dict[str, TensorInfo]) -> Any:
    """The compute dtype a checkpoint stores, read off `model.word_embeddings.weight`: bfloat16 or float32."""
    info = catalog["model.word_embeddings.weight"]  # validate has reported it when absent
    if info.dtype not in _STORED_COMPUTE_DTYPES:
        raise CheckpointError(f"model.word_embeddings.weight is stored {info.dtype}, which ling-jax does not compute "
                              "in: pass dtype=jnp.bfloat16 or dtype=jnp.float32 to load_hf (--dtype bfloat16 or "
                              "--dtype float32)")
    return _STORED_COMPUTE_DTYPES[info.dtype]


def stored_router_dtype(catalog: dict[str, TensorInfo], *, ignore_prefix: str | None = None) -> str:
    """"bfloat16" when every MoE router (`*.mlp.gate.weight`, outside `ignore_prefix`) is stored BF16, else
    "float32" (F32 as stored; F16 or F64 widened or rounded to float32 as before). Kept bf16, a router reads half
    the bytes and its fp32 products are those of the widened copy transformers computes with."""
    return router_dtype_of({"BF16": "bfloat16"}.get(info.dtype, info.dtype) for name, info in catalog.items()
                           if name.endswith(".mlp.gate.weight")
                           and not (ignore_prefix and name.startswith(ignore_prefix)))


def router_dtype_of(stored_dtypes) -> str:
    """`LingConfig.router_weight_dtype` for routers stored in these dtypes (names): "bfloat16" when all are, else
    "float32"."""
    return "bfloat16" if set(stored_dtypes) == {"bfloat16"} else "float32"


def without_mtp(cfg: LingConfig) -> LingConfig:
    """`cfg` describing a model loaded without its MTP layer (limit lists trimmed to the main layers)."""
    if not cfg.num_mtp_layers:
        return cfg
    return cfg.replace(num_mtp_layers=0,
                       expert_swiglu_limits=cfg.expert_swiglu_limits[:cfg.num_layers],
                       shared_swiglu_limits=cfg.shared_swiglu_limits[:cfg.num_layers])


def _present(names: tuple[str, ...], catalog: dict[str, TensorInfo]) -> str:
    return next(n for n in names if n in catalog)


def _leaf_names(entry: hf.Entry) -> str:
    return " + ".join(hf.path_str(p) for p in entry.paths)


def _sharding_lookup(shardings: Any) -> Callable[[hf.Path], Any]:
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return lambda path: shardings
    flat, _ = jax.tree_util.tree_flatten_with_path(shardings,
                                                   is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    table = {tuple(hf._key(k) for k in kp): s for kp, s in flat}

    def lookup(path: hf.Path):
        if path not in table:
            raise ValueError(f"shardings has no entry for params {hf.path_str(path)}: pass a pytree shaped like "
                             "param_specs(cfg), one Sharding, or None")
        return table[path]
    return lookup


def _listing(kind: str, items: list[str], explain: Callable[[str], str] | None = None) -> str:
    """'missing (3): a, b, c' with expert indices folded ({0-511}) and long lists cut (the count stays exact)."""
    folded = _fold_experts(items)
    lines = []
    for item in folded[:_MAX_LISTED]:
        why = explain(item) if explain and "{" not in item else ""
        lines.append(f"{item}  [{why}]" if why else item)
    more = f"\n      ... and {len(folded) - _MAX_LISTED} more" if len(folded) > _MAX_LISTED else ""
    return f"{kind} ({len(items)}):\n      " + "\n      ".join(lines) + more


def _fold_experts(items: list[str]) -> list[str]:
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for item in items:
        m = re.search(r"\.experts\.(\d+)\.", item)
        key = item if m is None else item[:m.start(1)] + "{}" + item[m.end(1):]
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m is not None:
            groups[key].append(int(m.group(1)))
    out = []
    for key in order:
        idx = groups[key]
        if not idx:
            out.append(key)
        elif len(idx) == 1:
            out.append(key.replace("{}", str(idx[0])))
        else:
            out.append(key.replace("{}", "{" + _ranges(sorted(idx)) + "}"))
    return out


def _ranges(idx: list[int]) -> str:
    spans, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(spans)


@contextlib.contextmanager
def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)
    try:
        yield bar
    finally:
        bar.close()
