"""Load an official Ling-3 checkpoint directory (config.json + safetensors shards) into a params pytree.

Everything is validated from the safetensors headers before a single tensor is read: one `CheckpointError`
lists every missing, unexpected, duplicate and mis-shaped tensor and a vocab mismatch, led by any layer whose
tensors are of another kind than config.json's layer schedule. Then the tensors stream one `hf.Entry` at a time
(one tensor; the E experts of one layer stacked into one [E, ...] host array; or the projections one fused leaf
packs, each placed in its slice of that leaf), are cast on the host, put on device with their target sharding, and
freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from conversion import fp8_blocks, hf
from ling_jax.config import (DENSE, HF_FFN_NAMES, HF_MIXER_NAMES, KDA, MLA, MOE, LingConfig, from_hf,
                             read_config_json, read_json)
from ling_jax.params import is_leaf_spec, param_specs
from pallas_kernels.common.fp8 import Fp8Weight, scale_shape

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
    catalog: dict[str, TensorInfo] = {}
    duplicates: dict[str, list[str]] = {}
    corrupt: list[str] = []
    for file in files:
        if not (hf_dir / file).is_file():
            problems.append(f"shard file {file} named in {INDEX_NAME} does not exist")
            continue
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
        shaped like `param_specs(cfg)` (extra leaves, e.g. an unused "mtp" subtree, are ignored).
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
        warnings.warn(msg, stacklevel=2)
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
    out_cfg = cfg if load_mtp else without_mtp(cfg)

    sharding_of = _sharding_lookup(shardings)
    placement = {path + part: sharding_of(path + part) for entry in entries for path in entry.paths
                 for part in ((("q",), ("scale",)) if entry.fp8 else ((),))}  # fail before reading
    total = sum(catalog[_present(names, catalog)].nbytes for e in entries for names in e.sources)
    arrays: dict[hf.Path, jax.Array] = {}
    with contextlib.ExitStack() as stack, _progress(total, f"load {hf_dir.name}", progress) as bar:
        handles: dict[str, Any] = {}

        def read(names: tuple[str, ...]) -> np.ndarray:
            info = catalog[_present(names, catalog)]
            try:
                if info.dtype == FP8_STORED:
                    return _read_fp8(hf_dir, catalog, _present(names, catalog), bar)
                if info.file not in handles:
                    handles[info.file] = stack.enter_context(safe_open(hf_dir / info.file, framework="numpy"))
                x = handles[info.file].get_tensor(_present(names, catalog))
            except SafetensorError as e:
                raise CheckpointError(f"shard {info.file} in {hf_dir} cannot be read ({e}): re-download or re-copy "
                                      "that shard file") from None
            bar.update(info.nbytes)
            return x

        for entry in entries:
            for path, host in zip(entry.paths, _host_arrays(entry, read, dtype)):
                if isinstance(host, Fp8Weight):
                    arrays[path] = Fp8Weight(*(jax.device_put(a, placement[path + (k,)]).block_until_ready()
                                               for k, a in (("q", host.q), ("scale", host.scale))),
                                             host.layout, host.n_in)
                else:
                    arrays[path] = jax.device_put(host, placement[path]).block_until_ready()

    specs = param_specs(out_cfg)
    paths = hf.spec_paths(specs)
    treedef = jax.tree.structure(specs, is_leaf=is_leaf_spec)
    return out_cfg, jax.tree.unflatten(treedef, [arrays[p] for p in paths])


class _Fp8Source(tuple):
    """An F8_E4M3 checkpoint tensor with its block scale: (q [out, in], scale_inv [ceil(out/128), ceil(in/128)])."""


def _read_fp8(hf_dir: Path, catalog: dict[str, TensorInfo], name: str, bar) -> _Fp8Source:
    info, scale = catalog[name], catalog[fp8_blocks.scale_name(name)]
    try:
        q = fp8_blocks.read_raw(hf_dir / info.file, name, info.shape, fp8_blocks.FP8_NP)
        s = fp8_blocks.read_raw(hf_dir / scale.file, fp8_blocks.scale_name(name), scale.shape, np.dtype(np.float32))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{name} in {hf_dir} cannot be read ({e}): re-download or re-copy its shard") from None
    bar.update(info.nbytes + scale.nbytes)
    return _Fp8Source((q, s))


def _host_arrays(entry: hf.Entry, read: Callable[[tuple[str, ...]], np.ndarray], dtype) -> list[np.ndarray]:
    """The params leaves of one entry as host arrays in their target dtypes. Experts, and the parts of a fused leaf,
    fill one array slice by slice, so that no more than one source tensor is held beside it."""
    if entry.fp8:
        return _fp8_host_arrays(entry, read)
    targets = [np.dtype(s.dtype(dtype)) for s in entry.specs]
    read = _dequantizing(read)
    if entry.stacked or entry.fused:
        (spec,), (target,) = entry.specs, targets
        out = np.empty(spec.shape, target)
        for i, names in enumerate(entry.sources):
            out[entry.slot(i)] = entry.source_to_params(i, read(names))[0].astype(target)
        return [out]
    xs = entry.source_to_params(0, read(entry.sources[0]))
    return [np.ascontiguousarray(x.astype(t)) for x, t in zip(xs, targets)]


def _dequantizing(read: Callable) -> Callable[[tuple[str, ...]], np.ndarray]:
    """`read`, with an FP8 source dequantised to float32 (an unquantised leaf, or `load_hf(fp8=False)`)."""
    def read_float(names):
        x = read(names)
        return fp8_blocks.dequantize(*x) if isinstance(x, _Fp8Source) else x
    return read_float


def _fp8_host_arrays(entry: hf.Entry, read: Callable) -> list[Fp8Weight]:
    """The block-FP8 leaves of one entry as host Fp8Weights; a float source is quantised as the release is."""
    layout, n_in = entry.fp8

    def source(i: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        x = read(entry.sources[i])
        q, s = x if isinstance(x, _Fp8Source) else fp8_blocks.quantize(x)
        return entry.source_to_params(i, q), entry.scale_to_params(i, s)

    if entry.stacked or entry.fused:
        (spec,) = entry.specs
        q_out = np.empty(spec.shape, fp8_blocks.FP8_NP)
        s_out = np.empty(scale_shape(spec.shape, layout, n_in), np.float32)
        for i in range(len(entry.sources)):
            (q,), (s,) = source(i)
            q_out[entry.slot(i)], s_out[entry.slot(i)] = q, s
        return [Fp8Weight(q_out, s_out, layout, n_in)]
    qs, ss = source(0)
    return [Fp8Weight(np.ascontiguousarray(q), np.ascontiguousarray(s, np.float32), layout, n_in)
            for q, s in zip(qs, ss)]


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
