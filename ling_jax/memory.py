"""Will the model, its caches and a prefill's activations fit the devices? Answered from shapes, before allocating.

`plan` adds, per device: the params (FP8 values and scales as stored; under tensor parallelism over n devices a
leaf with a `tp`-mapped axis holds 1/n of its bytes, a replicated one, as norms, routers and the embedding, all of
them), the caches for the prompt plus every token to
come, and the peak activations of one prefill chunk (`ling_jax.model.prefill_bytes`, the same estimate the prefill
checks itself against). `check` raises `MemoryPlanError` naming the sizes and the ways out: block-FP8 weights,
more devices, a shorter context or chunk.

The usable device bytes are what JAX may allocate: the runtime's `bytes_limit` when it reports one, otherwise
`device_bytes` (a GPU's size times JAX's memory fraction). Tests give it directly.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

import numpy as np

from ling_jax.config import LingConfig
from ling_jax.params import is_spec, param_specs

GIB = 2 ** 30
# What JAX preallocates of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
DEFAULT_MEM_FRACTION = 0.75
# A benchmark's fraction: the full FP8 model (~129 GB) fits an H200 (~140 GiB) only above JAX's default 75 %.
BENCH_MEM_FRACTION = 0.95
# Beside the estimates: XLA's workspace, cuBLAS handles, compiled executables, fragmentation.
RESERVE_BYTES = 2 * GIB


class MemoryPlanError(ValueError):
    """The requested model, context and device count do not fit; the message says by how much and what to change."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int
    caches: int
    activations: int
    capacity: int  # usable bytes per device
    devices: int

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.activations + RESERVE_BYTES

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def describe(self) -> str:
        return (f"~{self.total / GIB:.1f} GiB per device (weights {self.weights / GIB:.1f}, caches "
                f"{self.caches / GIB:.1f}, prefill activations {self.activations / GIB:.1f}, reserve "
                f"{RESERVE_BYTES / GIB:.0f}) of {self.capacity / GIB:.1f} GiB usable on each of {self.devices}")


def plan(cfg: LingConfig, *, dtype, prompt_len: int, max_new_tokens: int, chunk: int, devices: int = 1,
         capacity: int, with_mtp: bool = True) -> MemoryPlan:
    """Per-device bytes of serving `cfg` (params in `dtype`, or block-FP8 when cfg.quantization says so)."""
    from ling_jax.model import prefill_bytes

    itemsize = jnp.dtype(dtype).itemsize
    weights = weight_bytes_per_device(cfg, dtype, devices, with_mtp=with_mtp)
    need = prefill_bytes(cfg, 1, prompt_len, chunk, prompt_len + max_new_tokens, itemsize, tp=devices,
                         flash_attention=True)
    return MemoryPlan(weights, need["caches"], need["activations"], capacity, devices)


def weight_bytes_per_device(cfg: LingConfig, dtype, devices: int, *, with_mtp: bool = True) -> int:
    """The params' bytes on each of `devices` under `ling_jax.sharding.param_shardings`."""
    from ling_jax.sharding import RULES

    total = 0
    for spec in jax.tree.leaves(param_specs(cfg, with_mtp=with_mtp), is_leaf=is_spec):
        nbytes = int(np.prod(spec.shape)) * jnp.dtype(spec.dtype(dtype)).itemsize
        split = any(RULES.get(a) for a in spec.axes if a is not None)
        total += -(-nbytes // devices) if split else nbytes
    return total


def usable_bytes(device=None, device_bytes: int | None = None) -> int | None:
    """What JAX may allocate on `device`: `device_bytes` when given, else the runtime's limit (None on the CPU)."""
    if device_bytes is not None:
        return int(device_bytes)
    try:
        stats = device.memory_stats() if device is not None else None
    except Exception:  # a runtime without memory stats
        stats = None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check(p: MemoryPlan, cfg: LingConfig, dtype, *, with_mtp: bool = True) -> None:
    if p.fits:
        return
    ways = []
    if cfg.quantization != "fp8":
        fp8 = dataclasses.replace(p, weights=weight_bytes_per_device(cfg.replace(quantization="fp8"), dtype,
                                                                      p.devices, with_mtp=with_mtp))
        ways.append(f"block-FP8 weights (--dtype fp8: weights {fp8.weights / GIB:.1f} GiB per device"
                    + (", which fits)" if fp8.fits else ")"))
    need_devices = -(-p.weights * p.devices // max(p.capacity - p.caches - p.activations - RESERVE_BYTES, 1))
    ways.append(f"tensor parallelism over more devices (--tp N; in Python, params sharded with "
                f"ling_jax.sharding.param_shardings on a mesh; the weights alone need about {need_devices})")
    ways.append("a shorter context (fewer prompt or output tokens) or prefill chunk (--prefill-chunk)")
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if fraction is None or float(fraction) < BENCH_MEM_FRACTION:
        ways.append(f"a larger XLA_PYTHON_CLIENT_MEM_FRACTION (now {fraction or DEFAULT_MEM_FRACTION})")
    raise MemoryPlanError(f"the model does not fit: it needs {p.describe()}. Ways out: " + "; ".join(ways))
