"""The checkpoint side of block-FP8 (docs/model.md §4): a [out, in] tensor and its 128x128 `weight_scale_inv`.

`quantize` is what the `-fp8` release did to its bf16 weights (scale_inv = block amax / 448, q = w / scale_inv
rounded to E4M3), so `ling-jax convert --dtype fp8` and the synthetic writer produce that layout from float
weights; `dequantize` is its inverse up to E4M3's rounding. Numpy on the host, one source tensor at a time.
`read_raw` reads any tensor, or the rows of one, by the shard's header offsets.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from pallas_kernels.common.fp8 import BLOCK, FP8_MAX

FP8_NP = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The checkpoint scale of a [out, in] weight: [ceil(out/128), ceil(in/128)]."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def _expand(scale_inv: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scale_inv, BLOCK, 0)[:shape[0]], BLOCK, 1)[:, :shape[1]]


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)])."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    po, pi = -o % BLOCK, -i % BLOCK
    blocks = np.pad(np.abs(w), [(0, po), (0, pi)]).reshape((o + po) // BLOCK, BLOCK, (i + pi) // BLOCK, BLOCK)
    amax = blocks.max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(w / _expand(scale_inv, w.shape), -FP8_MAX, FP8_MAX).astype(FP8_NP)
    return q, scale_inv


def dequantize(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """q · scale_inv per block, float32."""
    return q.astype(np.float32) * _expand(scale_inv, q.shape)


@functools.lru_cache(maxsize=64)
def _header(path: Path, mtime_ns: int) -> tuple[int, dict]:
    """(data start, header) of a safetensors file, parsed once per file (a shard holds thousands of tensors)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return 8 + header_len, json.loads(f.read(header_len))


def read_raw(path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype, index: tuple = ()) -> np.ndarray:
    """`tensor[index]` read straight from a safetensors file by its header offsets, any dtype: safetensors' numpy
    reader has no float8 type (numpy lacks one; ml_dtypes supplies it), and a plain read, unlike its memory map,
    leaves no file pages in the process's memory. Only the rows `index[0]` spans are read, so a row-split shard of
    an expert's matrix costs its own bytes."""
    data_start, header = _header(Path(path), Path(path).stat().st_mtime_ns)
    start, end = header[name]["data_offsets"]
    if end - start != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{path.name}: tensor {name} holds {end - start} bytes, not the {math.prod(shape)} of its "
                         f"shape {list(shape)}: the shard is truncated or corrupt")
    rows = index[0] if index and shape else slice(None)
    first, stop, _ = rows.indices(shape[0]) if shape else (0, 1, 1)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    with open(path, "rb") as f:
        f.seek(data_start + start + first * row_bytes)
        data = f.read((stop - first) * row_bytes)
    if len(data) != (stop - first) * row_bytes:
        raise ValueError(f"{path.name}: tensor {name} ends {(stop - first) * row_bytes - len(data)} bytes early: "
                         "the shard is truncated or corrupt")
    x = np.frombuffer(data, dtype).reshape((stop - first,) + tuple(shape[1:]) if shape else ())
    return x[(slice(None),) + tuple(index[1:])] if shape else x
