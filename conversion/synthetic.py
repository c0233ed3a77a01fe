"""Random checkpoints in the official Ling-3 layout (docs/model.md §4, §5) for any config, MTP layer included.

The names, shapes and order come from `conversion.hf.plan`; values are drawn in the params layout with the scales
of `ling_jax.params.init_value` (so activations stay O(1)) and mapped to the official layout with the inverse
transforms. Each tensor has its own generator seeded from (seed, name), so `synthetic_tensor` regenerates any one
of them: an expert's matrix is drawn as its slice of the stacked leaf, and each projection a fused leaf packs as
its piece of that leaf, with the leaf's fan-in (D for w_in and w_qg, W taps for conv_qkv). Shards are planned from
the shapes alone, then written tensor by tensor (header first, then the bytes), so the writer holds one tensor at a
time: the full `ling-3.0-flash` preset (~255 GB) only needs disk.

Block-FP8 configs (`cfg.quantization` "fp8") get the `-fp8` release's layout: each quantised weight is drawn in
float as above (a projection as its ROWS leaf, [*out, *in], with the fan-in of its input axes), then quantised per
128x128 block (conversion/fp8_blocks.py) and written as F8_E4M3 plus its
`weight_scale_inv` F32. COMPUTE params are written in `dtype`; FP32-class params (A_log, dt_bias, convs, expert_bias) in float32, as
transformers writes them; the routers in `cfg.router_weight_dtype` (float32 by default, as transformers writes them;
bfloat16 to mimic a checkpoint that stores them so).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from conversion import fp8_blocks, hf
from conversion.load import INDEX_NAME, without_mtp
from ling_jax.config import LingConfig, to_hf_dict
from ling_jax.params import ParamSpec, _fan_in

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(jnp.bfloat16): "BF16",
              fp8_blocks.FP8_NP: "F8_E4M3"}


def _draw(rng: np.random.Generator, spec: ParamSpec, full: ParamSpec) -> np.ndarray:
    """`ling_jax.params.init_value` in numpy (float32, scaled in place); `full` is the leaf whose slice `spec` is
    (an expert's, or a fused part's), whose fan-in it keeps."""
    shape = spec.shape
    if spec.init == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if spec.init == "dt_bias":
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
    x = rng.standard_normal(shape, np.float32)
    if spec.init == "norm":
        x *= 0.1
        x += 1.0
    elif spec.init == "small":
        x *= 0.02
    elif spec.init == "conv":
        x /= math.sqrt(shape[0])
    elif spec.init != "embed":
        x /= math.sqrt(_fan_in(full))
    return x


def _stored_dtype(entry: hf.Entry, dtype) -> np.dtype:
    return np.dtype(entry.specs[0].dtype(jnp.dtype(dtype)))


def synthetic_tensor(entry: hf.Entry, index: int, *, seed: int = 0, dtype="bfloat16") -> np.ndarray:
    """Source tensor `index` of `entry` (expert `index` when stacked, part `index` when fused), in the official
    layout and stored dtype (an FP8 entry's float weight before quantisation: `synthetic_tensors` quantises)."""
    name = entry.names[index]
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    xs = [_draw(rng, s, full) for s, full in zip(entry.source_specs(index), entry.specs)]
    x = entry.source_to_hf(index, xs)
    assert x.shape == entry.source_shape(index), (name, x.shape, entry.source_shape(index))
    return np.ascontiguousarray(x.astype(np.float32 if entry.fp8 else _stored_dtype(entry, dtype)))


def synthetic_tensors(entry: hf.Entry, index: int, *, seed: int = 0, dtype="bfloat16") -> dict[str, np.ndarray]:
    """{name: array} of what the checkpoint stores for source `index`: the tensor, or an FP8 weight and its
    block scale."""
    x = synthetic_tensor(entry, index, seed=seed, dtype=dtype)
    name = entry.names[index]
    if not entry.fp8:
        return {name: x}
    q, s = fp8_blocks.quantize(x)
    return {name: q, fp8_blocks.scale_name(name): s}


def _stored(entry: hf.Entry, index: int, dtype) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor `synthetic_tensors` gives, known before drawing."""
    name, shape = entry.names[index], entry.source_shape(index)
    if not entry.fp8:
        return [(name, _stored_dtype(entry, dtype), shape)]
    return [(name, fp8_blocks.FP8_NP, shape),
            (fp8_blocks.scale_name(name), np.dtype(np.float32), fp8_blocks.scale_shape(shape))]


def shard_plan(cfg: LingConfig, *, dtype="bfloat16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               with_mtp: bool = True) -> list[list[tuple[hf.Entry, int, int]]]:
    """Shards as lists of (entry, source index, nbytes), filled in plan order up to `max_shard_bytes` each; an FP8
    weight and its scale share a shard."""
    shards: list[list[tuple[hf.Entry, int, int]]] = [[]]
    size = 0
    for entry in hf.plan(cfg, with_mtp=with_mtp):
        for i in range(len(entry.sources)):
            nbytes = sum(math.prod(shape) * dt.itemsize for _, dt, shape in _stored(entry, i, dtype))
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((entry, i, nbytes))
            size += nbytes
    return shards


def write_synthetic(out_dir: str | Path, cfg: LingConfig, *, seed: int = 0, dtype="bfloat16",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, with_mtp: bool = True,
                    progress: bool = True, workers: int = 1) -> Path:
    """Write config.json, `model-0000i-of-0000n.safetensors` shards and the index for `cfg` into `out_dir`.

    The MTP layer (`model.layers.{num_hidden_layers}.*`) is written when cfg.num_mtp_layers == 1 and with_mtp.
    `workers` > 1 writes that many shards at once, each in its own process (drawing the values is CPU-bound and one
    core draws ~0.1 GB/s); the files are the same bytes as a serial write's. Returns `out_dir`.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(cfg, dtype=dtype, max_shard_bytes=max_shard_bytes, with_mtp=with_mtp)
    total = sum(n for shard in shards for _, _, n in shard)
    weight_map = {name: _shard_file(k, len(shards)) for k, shard in enumerate(shards)
                  for entry, i, _ in shard for name, _, _ in _stored(entry, i, dtype)}
    with tqdm(total=total, desc=f"write {out_dir.name}", unit="B", unit_scale=True, unit_divisor=1024,
              disable=not progress) as bar:
        if workers <= 1:
            for k, shard in enumerate(shards):
                _write_shard(out_dir / _shard_file(k, len(shards)), shard, seed, dtype, bar.update)
        else:
            _write_shards_parallel(out_dir, cfg, shards, workers, bar.update,
                                   seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes, with_mtp=with_mtp)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = to_hf_dict(cfg if with_mtp else without_mtp(cfg))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _shard_file(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _write_shard(path: Path, shard, seed: int, dtype, advance=lambda nbytes: None) -> None:
    """One safetensors file: the header first, then each source's tensors drawn and written one at a time."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry, i, _ in shard:
        for name, dt, shape in _stored(entry, i, dtype):
            size = math.prod(shape) * dt.itemsize
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for entry, i, nbytes in shard:
            xs = synthetic_tensors(entry, i, seed=seed, dtype=dtype)
            assert sum(x.nbytes for x in xs.values()) == nbytes
            for x in xs.values():
                f.write(np.ascontiguousarray(x).view(np.uint8).reshape(-1).data)
            advance(nbytes)
            del xs


def _write_shard_of_plan(out_dir: str, cfg: LingConfig, k: int, seed: int, dtype, max_shard_bytes: int,
                         with_mtp: bool) -> int:
    """A worker's shard k, re-planned from the config (a plan's entries do not cross processes); its bytes."""
    shards = shard_plan(cfg, dtype=dtype, max_shard_bytes=max_shard_bytes, with_mtp=with_mtp)
    _write_shard(Path(out_dir) / _shard_file(k, len(shards)), shards[k], seed, dtype)
    return sum(n for _, _, n in shards[k])


def _write_shards_parallel(out_dir: Path, cfg: LingConfig, shards, workers: int, advance, **plan) -> None:
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: the parent may hold JAX's threads, which a forked child inherits broken.
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(shards)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(_write_shard_of_plan, str(out_dir), cfg, k, plan["seed"], plan["dtype"],
                            plan["max_shard_bytes"], plan["with_mtp"]) for k in range(len(shards))]
        for job in concurrent.futures.as_completed(jobs):
            advance(job.result())
