"""transformers' BailingHybridForCausalLM as the reference model for parity tests.

transformers picks its KDA implementation when `modeling_bailing_hybrid` is imported: with fla-core importable it
binds fla's GPU Triton kernels, which fail on CPU. `import_reference_model()` (ling_jax/crosscheck.py) imports it
with `fla` hidden, so it binds its pure-torch path, then un-hides fla so that `fla.ops.kda.naive` (an independent
KDA reference) still imports in the same process. `assert_torch_paths()` proves the binding took.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import torch

from ling_jax.crosscheck import import_reference_model
from tests.numerics import rel_err  # noqa: F401  (re-exported for the parity tests)


MOD = import_reference_model()


def assert_torch_paths():
    """The reference must run transformers' own torch code for KDA, not a kernel package: each KDA entry point is
    called on small CPU tensors while a profile hook records the code that runs. (Watching what runs rather than
    how the entry is bound: transformers wraps these functions differently from release to release.)"""
    fla_dir = str(Path(importlib.util.find_spec("fla").origin).parent) if importlib.util.find_spec("fla") else None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, 5, 2, 8, generator=g), torch.rand(1, 5, 2, generator=g)
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        ran = set()
        sys.setprofile(lambda frame, event, arg: ran.add((frame.f_code.co_filename, frame.f_code.co_name))
                       if event == "call" else None)
        try:
            getattr(MOD, name)(q, k, v, gate, beta, initial_state=None, output_final_state=True)
        finally:
            sys.setprofile(None)
        assert (MOD.__file__, name) in ran, f"{name} did not run transformers' own torch code"
        leaked = sorted({f for f, _ in ran if fla_dir and f.startswith(fla_dir)})
        assert not leaked, f"{name} ran fla's code ({leaked[:3]}): fla leaked into transformers"


@dataclasses.dataclass(frozen=True)
class SmallConfig:
    """A random small BailingHybrid config; fields are transformers' names."""

    name: str
    num_hidden_layers: int
    layer_group_size: int
    q_lora_rank: int | None
    first_k_dense_replace: int
    num_local_experts: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    rope_theta: float = 6_000_000.0
    rms_norm_eps: float = 1e-6
    kda_lower_bound: float = -5.0
    routed_scaling_factor: float = 2.5
    hidden_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 16  # KDA head dim; deliberately != qk_rope_head_dim (transformers overwrites head_dim)
    qk_rope_head_dim: int = 8
    qk_nope_head_dim: int = 16
    v_head_dim: int = 12
    kv_lora_rank: int = 32
    intermediate_size: int = 96
    moe_intermediate_size: int = 32
    vocab_size: int = 211
    norm_topk_prob: bool = True
    # None: transformers' own rule fills them in (and writes them into config.json either way).
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    # None: not given (transformers >= 5.25 writes zeros). 5.24 keeps them in config.json but never applies them.
    expert_swiglu_limit_list: tuple[float, ...] | None = None
    share_expert_swiglu_limit_list: tuple[float, ...] | None = None

    def hf(self):
        kw = dataclasses.asdict(self)
        kw.pop("name")
        for name in ("layer_types", "mlp_layer_types"):
            kw[name] = None if kw[name] is None else list(kw[name])
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            limits = kw.pop(name)
            if limits is not None:
                kw[name] = list(limits)
        cfg = MOD.BailingHybridConfig(num_key_value_heads=self.num_attention_heads, pad_token_id=0, eos_token_id=1,
                                      num_mtp_layers=0, **kw)
        cfg._attn_implementation = "eager"
        return cfg


# Checkpoints whose config.json layer_types / mlp_layer_types differ from ling-jax's rule (docs/model.md §1).
SCHEDULE_CONFIGS = [
    # transformers' rule makes the trailing partial group (layer 6) linear_attention, where ling-jax's own rule
    # would make it MLA: the layer_types that transformers writes must decide.
    SmallConfig("g3-tail-kda-dense1-e16g4", num_hidden_layers=7, layer_group_size=3, q_lora_rank=None,
                first_k_dense_replace=1, num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3),
    # A schedule no rule gives: MLA twice in a row, KDA last, and dense layers after MoE ones.
    SmallConfig("custom-schedule-e16g4", num_hidden_layers=7, layer_group_size=3, q_lora_rank=None,
                first_k_dense_replace=0, num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                layer_types=("linear_attention", "full_attention", "full_attention", "linear_attention",
                             "linear_attention", "full_attention", "linear_attention"),
                mlp_layer_types=("sparse", "dense", "sparse", "sparse", "dense", "sparse", "sparse")),
]

CONFIGS = [
    SmallConfig("g2-qnull-dense1-e16g4", num_hidden_layers=4, layer_group_size=2, q_lora_rank=None,
                first_k_dense_replace=1, num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3),
    # Non-default theta, eps, gate bound and routed scale: a key that from_hf silently defaulted would show here.
    SmallConfig("g3-qlora24-dense0-e24g3", num_hidden_layers=6, layer_group_size=3, q_lora_rank=24,
                first_k_dense_replace=0, num_local_experts=24, n_group=3, topk_group=2, num_experts_per_tok=4,
                rope_theta=10_000.0, rms_norm_eps=1e-5, kda_lower_bound=-3.0, routed_scaling_factor=1.7),
    SmallConfig("g4-qnull-dense2-e32g8", num_hidden_layers=4, layer_group_size=4, q_lora_rank=None,
                first_k_dense_replace=2, num_local_experts=32, n_group=8, topk_group=4, num_experts_per_tok=6,
                num_attention_heads=2, head_dim=32),
] + SCHEDULE_CONFIGS


# Weight scale over 1/sqrt(fan_in). At 1.0 the random stack is chaotic: transformers' own bf16 run lands 0.1-0.4
# away from its float64 run (routing flips compound). At 0.3 its bf16 run is ~0.7e-2 away, like a trained model.
WEIGHT_SCALE = 0.3


# A mixer weight scale at which each layer's output is as large as the residual it joins, as in a trained model:
# a small numerics error in any one mixer then reaches the logits instead of being diluted by the 0.3 stack.
MIXER_SCALE_REALISTIC = 1.0


def randomize_(model: torch.nn.Module, seed: int, *, mixer_scale: float = WEIGHT_SCALE,
               embed_scale: float = 1.0) -> None:
    """O(1)-activation random weights (transformers' 0.02 init leaves logits nearly flat and routing trivial).
    `mixer_scale` sets the KDA / MLA projections (over 1/sqrt(fan_in)), `embed_scale` the embedding rows' rms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep transformers' realistic gate init
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.copy_(embed_scale * torch.randn(p.shape, generator=g))
            else:
                scale = mixer_scale if ".self_attn." in name else WEIGHT_SCALE
                p.copy_(scale * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def build(small: SmallConfig, seed: int = 0, **scales):
    """(float32 model, float64 model) with the same random weights; `scales` go to `randomize_`."""
    torch.manual_seed(seed)
    m32 = MOD.BailingHybridForCausalLM(small.hf()).eval()
    randomize_(m32, seed, **scales)
    m64 = MOD.BailingHybridForCausalLM(small.hf()).eval()
    m64.load_state_dict(m32.state_dict())
    m64.config._experts_implementation = "eager"  # the grouped-matmul default rejects float64
    return m32, m64.double()


def saved_checkpoint(small: SmallConfig, tmp_path_factory):
    """`build(small)` seeded by its place in CONFIGS, its float32 model written as a sharded transformers
    checkpoint -> (float32 model, float64 model, checkpoint directory)."""
    m32, m64 = build(small, seed=CONFIGS.index(small))
    hf_dir = tmp_path_factory.mktemp(small.name)
    m32.save_pretrained(hf_dir, max_shard_size="200KB")
    return m32, m64, hf_dir


def logits64(model64, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model64(torch.as_tensor(ids, dtype=torch.long)).logits.double().numpy()



def save_with_mtp(out, n_layers: int = 4) -> dict:
    """A transformers checkpoint in the official layout with an MTP layer: an (n + 1)-layer BailingHybrid saved by
    transformers (layer n: MLA + MoE, the NextN block), the four MTP-only tensors added, config.json saying n layers
    + 1 MTP layer. Returns {dir, m32 (the (n + 1)-layer float32 model), m64 (float64 copy), extra (the MTP-only
    tensors, float64)}."""
    import json

    from safetensors.torch import save_file

    small = SmallConfig("mtp", num_hidden_layers=n_layers + 1, layer_group_size=2, q_lora_rank=None,
                        first_k_dense_replace=1, num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    hf_cfg = small.hf()
    hf_cfg.layer_types = ["linear_attention", "full_attention"] * (n_layers // 2) + ["full_attention"]
    hf_cfg.mlp_layer_types = ["dense"] + ["sparse"] * n_layers
    torch.manual_seed(0)
    m = MOD.BailingHybridForCausalLM(hf_cfg).eval()
    randomize_(m, seed=11)
    m.save_pretrained(out, max_shard_size="200KB")

    g = torch.Generator().manual_seed(5)
    D = small.hidden_size
    extra = {f"model.layers.{n_layers}.{name}.weight": 1 + 0.1 * torch.randn(D, generator=g)
             for name in ("enorm", "hnorm", "final_layernorm")}
    extra[f"model.layers.{n_layers}.eh_proj.weight"] = 0.3 * torch.randn(D, 2 * D, generator=g) / np.sqrt(2 * D)
    save_file(extra, out / "mtp-extra.safetensors")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "mtp-extra.safetensors" for k in extra})
    index_path.write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=n_layers, num_nextn_predict_layers=1)
    for key in ("layer_types", "mlp_layer_types"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))

    m64 = copy.deepcopy(m).double()
    m64.config._experts_implementation = "eager"
    return dict(dir=out, m32=m, m64=m64, extra={k: v.double() for k, v in extra.items()})
