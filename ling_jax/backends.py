"""Which implementation runs each op: `backend` is "reference", "pallas", "fast", or per op, e.g.
"kda=pallas,moe_decode=pallas,mla_decode=reference".

"pallas" means every op's Pallas kernel (what the tests exercise); "fast" means, per op, whichever implementation
measured faster on the H200 (experiments/RESULTS.md; update it with every new measurement). This table is the only
place that picks: ops never fall back on their own.
"""

from __future__ import annotations

import functools

from ling_jax.config import ConfigError, LingConfig

# gemv: the projections (and the greedy lm_head) of steps of at most 16 tokens (ling_jax.layers.linear.dense).
OPS = ("kda", "moe_decode", "moe_prefill", "mla_decode", "mla_prefill", "gemv")
NO_KERNEL: tuple[str, ...] = ()  # ops without a Pallas kernel (none today); they run the reference everywhere
CHOICES = ("reference", "pallas")
# The gemv op's third choice: the FP8 projections of decode and verify steps (the mixers' and the dense MLP's)
# through the W8A8 kernel (activations quantised per token and 128 columns to E4M3, pallas_kernels/gemv/w8a8.py);
# float weights and the greedy head run "pallas", the MoE experts and prefill their own kernels. FP8 configs only.
W8A8 = "w8a8"
OP_CHOICES = {op: CHOICES + ((W8A8,) if op == "gemv" else ()) for op in OPS}
PROFILES = {
    "reference": dict.fromkeys(OPS, "reference"),
    "pallas": {op: "reference" if op in NO_KERNEL else "pallas" for op in OPS},
    # Per op on the H200 (experiments/RESULTS.md): MoE layer at T = 1 33.4 µs Pallas vs 150-181 µs XLA; KDA decode
    # 5.3 µs per layer vs fla's 5.3-6.4 µs core alone; MLA decode 11 / 23 / 50 µs at L = 1k / 8k / 32k vs XLA's
    # 18 / 51 / 147 µs. Prefill at 8192 tokens: the grouped-GEMM MoE 2.8-3.1 ms of routed experts where XLA's
    # ragged dot asks for 160 GiB (at 2048: 2.1 vs 148 ms); MLA flash 2.6 ms vs the eager reference's 11.4 ms (cuDNN
    # with V padded to 192: 1.6 ms, not wired in). Every op with a kernel is faster in Pallas today, so "fast"
    # equals "pallas"; it stays a separate profile because a kernel that loses a later measurement leaves "fast" and
    # stays in "pallas" (what the tests run).
    "fast": {"kda": "pallas", "moe_decode": "pallas", "moe_prefill": "pallas", "mla_decode": "pallas",
             "mla_prefill": "pallas", "gemv": "pallas"},
}


@functools.cache
def resolve(backend: str) -> dict[str, str]:
    if backend in PROFILES:
        return PROFILES[backend]
    chosen = dict(PROFILES["reference"])
    for item in backend.split(","):
        op, _, choice = item.partition("=")
        if op not in OPS or choice not in OP_CHOICES[op]:
            raise ValueError(f"backend={backend!r}: expected one of {tuple(PROFILES)}, or comma-separated op=choice "
                             f"with op in {OPS} and choice in {CHOICES} (gemv also {W8A8!r})")
        if op in NO_KERNEL and choice == "pallas":
            raise ValueError(f"backend {op}=pallas: {op} has no Pallas kernel; use reference")
        chosen[op] = choice
    return chosen


def op_backend(backend: str, op: str) -> str:
    return resolve(backend)[op]


def with_fp8_activations(backend: str) -> str:
    """`backend` with its FP8 projections through the W8A8 kernel (`--fp8-activations`): the same spec, gemv=w8a8.
    Refused where the gemv op runs XLA, which has no W8A8 path."""
    chosen = dict(resolve(backend))
    if chosen["gemv"] == "reference":
        raise ValueError(f"--fp8-activations runs the W8A8 GEMV kernel, but backend={backend!r} runs the projections "
                         "on XLA (gemv=reference): use --backend fast or pallas, or gemv=pallas in a per-op spec")
    chosen["gemv"] = W8A8
    return ",".join(f"{op}={choice}" for op, choice in chosen.items())


def check_partitioning(params, backend: str) -> None:
    """Pallas calls are opaque to XLA's partitioner: sharded params need the mesh in context, so the layers can
    run each kernel per shard (`ling_jax.sharding.per_shard`) instead of XLA all-gathering its weights."""
    if all(choice == "reference" for choice in resolve(backend).values()):
        return
    try:
        devices = params["lm_head"].sharding.device_set
    except Exception:  # a tracer inside an outer jit: the caller's sharding is not visible here
        return
    from ling_jax.sharding import tp_size

    if len(devices) > 1 and tp_size() != len(devices):
        raise ValueError(f"backend={backend!r} runs Pallas kernels on params sharded over {len(devices)} devices; "
                         f"run under `with jax.set_mesh(mesh):` (a mesh whose 'tp' axis spans those devices) so "
                         "each kernel runs per shard, or use backend='reference'")


def _pow2(v: int, least: int = 1) -> bool:
    return v >= least and not v & (v - 1)


def kernel_limits(cfg: LingConfig) -> dict[str, list[str]]:
    """Per op with a kernel, the config values its Pallas kernel cannot take ([] = it runs `cfg`)."""
    group = cfg.num_experts // cfg.n_group
    shared = cfg.shared_expert_intermediate_size
    moe = [  # the router and experts kernels; prefill adds the grouped GEMM, whose needs these include
        (_pow2(cfg.num_experts), f"num_experts={cfg.num_experts} (a power of two)"),
        (_pow2(group), f"num_experts / n_group = {group} (a power of two)"),
        (_pow2(cfg.num_experts_per_tok), f"num_experts_per_tok={cfg.num_experts_per_tok} (a power of two)"),
        (cfg.hidden_size % 16 == 0, f"hidden_size={cfg.hidden_size} (a multiple of 16)"),
        (cfg.moe_intermediate_size % 16 == 0,
         f"moe_intermediate_size={cfg.moe_intermediate_size} (a multiple of 16)"),
        (not cfg.num_shared_experts or shared == cfg.moe_intermediate_size,
         f"the shared expert's width {shared} (equal to moe_intermediate_size={cfg.moe_intermediate_size})"),
    ]
    widths = {"hidden_size": cfg.hidden_size, "num_heads x head_dim": cfg.num_heads * cfg.head_dim,
              "num_heads x v_head_dim": cfg.num_heads * cfg.v_head_dim, "intermediate_size": cfg.intermediate_size}
    checks = {
        "gemv": [(v % 16 == 0, f"{name} = {v} (a multiple of 16: the input width of a projection)")
                 for name, v in widths.items()],
        "kda": [(_pow2(cfg.head_dim, 16), f"head_dim={cfg.head_dim} (a power of two >= 16)")],
        "moe_decode": moe,
        "moe_prefill": moe,  # prompts up to 64 tokens run the decode kernels
        "mla_prefill": [(cfg.qk_head_dim % 16 == 0, f"qk_nope_head_dim + qk_rope_head_dim = {cfg.qk_head_dim} "
                                                    "(a multiple of 16)"),
                        (cfg.v_head_dim % 16 == 0, f"v_head_dim={cfg.v_head_dim} (a multiple of 16)"),
                        (_prefill_tiles_fit(cfg), f"qk_head_dim + v_head_dim = {cfg.qk_head_dim + cfg.v_head_dim} "
                                                  "narrow enough for 16 x 16 float32 tiles in the shared memory")],
        "mla_decode": [(_pow2(cfg.kv_lora_rank, 16), f"kv_lora_rank={cfg.kv_lora_rank} (a power of two >= 16)"),
                       (_pow2(cfg.qk_rope_head_dim, 16),
                        f"qk_rope_head_dim={cfg.qk_rope_head_dim} (a power of two >= 16)")],
    }
    return {op: [why for ok, why in items if not ok] for op, items in checks.items()}


def _prefill_tiles_fit(cfg: LingConfig) -> bool:
    """Whether the MLA prefill kernel has a tiling within the shared memory in float32, the widest compute dtype
    (bf16 then fits too; a config that fits only in bf16 is refused too, at head dims far beyond Ling's 192 + 128)."""
    from pallas_kernels.mla.prefill import fitting_tuning

    return fitting_tuning("float32", cfg.qk_head_dim, cfg.v_head_dim) is not None


def w8a8_limits(cfg: LingConfig) -> list[str]:
    """The projection input widths the W8A8 GEMV cannot take (it quantises activations in whole 128-column
    groups); [] for every Ling release."""
    widths = {"hidden_size": cfg.hidden_size, "num_heads x head_dim": cfg.num_heads * cfg.head_dim,
              "num_heads x v_head_dim": cfg.num_heads * cfg.v_head_dim, "intermediate_size": cfg.intermediate_size}
    return [f"{name} = {v} (not a multiple of 128)" for name, v in widths.items() if v % 128]


@functools.cache
def check_config(cfg: LingConfig, backend: str) -> None:
    """Refuse, before any tracing, a backend whose Pallas kernels cannot take `cfg`'s sizes; the message names the
    config fields and the backend spec that runs this model."""
    chosen = resolve(backend)
    if chosen["gemv"] == W8A8:
        if cfg.quantization != "fp8":
            raise ConfigError(f"backend={backend!r}: gemv=w8a8 quantises the activations of block-FP8 projections, but "
                              "this model's weights are not FP8: load them with --dtype fp8 (fp8=True), or use "
                              "gemv=pallas")
        if w8a8_limits(cfg):
            raise ConfigError(f"backend={backend!r}: the W8A8 kernel takes projection inputs in whole 128-column "
                              f"groups, and this config has {', '.join(w8a8_limits(cfg))}: use gemv=pallas")
    limits = kernel_limits(cfg)
    blocked = {op: why for op, why in limits.items() if why and chosen[op] != "reference"}
    if not blocked:
        return
    runs = ",".join(f"{op}={'reference' if op in blocked or op in NO_KERNEL else chosen[op]}" for op in OPS)
    reasons = "; ".join(f"{op} needs {', '.join(why)}" for op, why in blocked.items())
    raise ConfigError(f"backend={backend!r}: the Pallas kernels cannot run this config: {reasons}. Run it with "
                      f"backend={runs!r} (or 'reference')")


@functools.cache
def prepare(backend: str) -> None:
    """Run one tiny Pallas kernel before anything is traced. A first pallas_call imports modules (the interpreter on
    the CPU) that add tracing-context state to jit's cache key: tracing the model first would make its second call
    miss the cache and recompile, so a timed run after one warm-up would include compilation."""
    if all(choice == "reference" for choice in resolve(backend).values()):
        return
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from pallas_kernels.common.interpret import interpret_mode

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    x = jnp.arange(16, dtype=jnp.float32)
    jax.block_until_ready(pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         interpret=interpret_mode())(x))
