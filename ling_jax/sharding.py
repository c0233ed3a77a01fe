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
                         f"({jax.default_backend()}). On a CPU, start with the environment variable "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} to get {n} devices")
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


def state_specs(state: ModelState) -> ModelState:
    """KDA state and conv windows split by head; MLA latent caches replicated (every head reads them)."""
    def entry(e):
        if isinstance(e, KDACache):
            return KDACache(PartitionSpec(None, None, None, TP, None), PartitionSpec(None, TP, None, None))
        assert isinstance(e, MLACache)
        return MLACache(PartitionSpec())

    return ModelState(PartitionSpec(), tuple(entry(e) for e in state.layers))


def state_shardings(state: ModelState, mesh: Mesh) -> ModelState:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def constrain_state(state: ModelState) -> ModelState:
    """`state` laid out as `state_specs` says under a context mesh with `tp` > 1 (inside jit: the caches a prefill
    leaves are then split by head whatever XLA's propagation would pick); `state` itself otherwise."""
    if tp_size() <= 1:
        return state
    return jax.tree.map(jax.lax.with_sharding_constraint, state, state_specs(state),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def replicated(tree, like: jax.Array):
    """`tree`'s arrays and host values replicated over the mesh of `like` (a param) when that mesh spans several
    processes: the engine's inputs then join its programs as global arrays, which a process-local array cannot.
    Every process must pass the same values. Arrays already spanning other processes are kept; on one process the
    tree is returned as it is."""
    if like.is_fully_addressable:
        return tree
    rep = NamedSharding(like.sharding.mesh, PartitionSpec())

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(x)), rep),
                                            impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), rep)

    return jax.tree.map(one, tree)


def host_values(tree):
    """`tree`'s arrays on the host, read from this process's replica: a replicated array that spans other
    processes' devices is read from its first local shard (no collective); any other array as a whole."""
    def local(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and x.is_fully_replicated:
            return x.addressable_shards[0].data
        return x

    return jax.device_get(jax.tree.map(local, tree))


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
