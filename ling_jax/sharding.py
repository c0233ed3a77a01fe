"""Tensor parallelism over one mesh axis `tp` (docs/design.md §3): logical axes -> mesh axes, in one table.

Column-parallel by head (KDA q/k/v/f/g/b, MLA q, kv_b, gate) and by intermediate (dense, shared and every
expert's gate/up: all experts on every device, so batch-1 load stays balanced); row-parallel for o_proj/dense and
the down projections, where XLA inserts the all-reduce. lm_head is split by vocab. Activations are replicated.

XLA partitions the reference ops itself. A Pallas call is opaque to it, so the layers run each kernel per shard
through `per_shard` (a `shard_map` over the context mesh's `tp` axis): run sharded models under
`with jax.set_mesh(mesh):`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ling_jax.cache import KDACache, MLACache, ModelState
from ling_jax.config import DENSE, KDA, MLA, LingConfig
from ling_jax.params import is_spec, param_specs

TP = "tp"

RULES: dict[str, str | None] = {
    "heads": "tp",
    "ffn": "tp",
    "vocab": "tp",
    "embed": None,
    "experts": None,
}


def make_mesh(n: int | None = None, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices) if n is None else n
    if n < 1 or n > len(devices):
        raise ValueError(f"tensor parallelism over {n} devices needs {n} devices; {len(devices)} are visible "
                         f"({jax.default_backend()}). On CPU set --xla_force_host_platform_device_count={n}")
    return Mesh(np.asarray(devices[:n]), ("tp",))


def logical_to_spec(axes: tuple[str | None, ...]) -> PartitionSpec:
    mesh_axes = [RULES.get(a) if a is not None else None for a in axes]
    used = [a for a in mesh_axes if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {axes} map mesh axis {used} more than once; fix sharding.RULES")
    return PartitionSpec(*mesh_axes)


def check_divisible(cfg: LingConfig, n: int) -> None:
    sizes = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
             "moe_intermediate_size": cfg.moe_intermediate_size,
             "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "vocab_size": cfg.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % n}
    if bad:
        raise ValueError(f"tensor parallelism over {n} devices needs these sizes divisible by {n}: {bad}; "
                         f"choose a device count that divides them")
    if cfg.quantization == "fp8" and n > 1:
        # Row-split FP8 weights split their 128-row scale blocks too: each device needs whole blocks.
        mixers, ffns = ({cfg.mixer_kind(i) for i in range(cfg.num_layers)},
                        {cfg.ffn_kind(i) for i in range(cfg.num_layers)})
        rows = {"moe_intermediate_size / tp": cfg.moe_intermediate_size // n}
        if DENSE in ffns:
            rows["intermediate_size / tp"] = cfg.intermediate_size // n
        if cfg.num_shared_experts:
            rows["shared_expert_intermediate_size / tp"] = cfg.shared_expert_intermediate_size // n
        if KDA in mixers:
            rows["num_attention_heads / tp x head_dim"] = cfg.num_heads // n * cfg.head_dim
        if MLA in mixers or cfg.num_mtp_layers:
            rows["num_attention_heads / tp x v_head_dim"] = cfg.num_heads // n * cfg.v_head_dim
        split = {k: v for k, v in rows.items() if v % 128}
        if split:
            raise ValueError(f"block-FP8 weights over {n} devices need whole 128-row scale blocks per device: {split} "
                             "are not multiples of 128; choose a device count that keeps them whole, or bf16 weights")


def param_shardings(cfg: LingConfig, mesh: Mesh, *, with_mtp: bool = True):
    check_divisible(cfg, mesh.shape["tp"])
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.axes)), param_specs(cfg, with_mtp=with_mtp),
                        is_leaf=is_spec)


def state_shardings(state: ModelState, mesh: Mesh) -> ModelState:
    """KDA state and conv windows split by head; MLA latent caches replicated (every head reads them)."""
    rep = NamedSharding(mesh, PartitionSpec())

    def entry(e):
        if isinstance(e, KDACache):
            return KDACache(NamedSharding(mesh, PartitionSpec(None, None, None, "tp", None)),
                            NamedSharding(mesh, PartitionSpec(None, "tp", None, None)))
        assert isinstance(e, MLACache)
        return MLACache(rep)

    return ModelState(rep, tuple(entry(e) for e in state.layers))


def tp_size() -> int:
    """Size of the context mesh's `tp` axis (0 outside any mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 0 if mesh.empty or TP not in mesh.axis_names else mesh.shape[TP]


def per_shard(fn, in_specs, out_specs, *, sum_outputs: bool = False):
    """`fn` run on each device's shard over the context mesh's `tp` axis (its outputs summed across the axis with
    `sum_outputs`, for row-parallel partial results); `fn` itself without such a mesh."""
    if tp_size() <= 1:
        return fn
    body = (lambda *args: jax.lax.psum(fn(*args), TP)) if sum_outputs else fn
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, check_vma=False)
