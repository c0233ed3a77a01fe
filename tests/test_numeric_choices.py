"""Parity configs in which every numeric choice shows, against transformers' float64 BailingHybridForCausalLM.

Each test builds a small config (hidden 64) where one choice matters, checks ling-jax's float32 logits against the
reference within TOL_F32 (as tests/test_parity.py), and then flips the choice, in ling-jax's config or at the
reference's site, and asserts that the flip moves the compared logits by at least FLIP = 10 x TOL_F32: a bug in
that choice cannot hide under the tolerance. Where ling-jax has a separate decode path for the choice (KDA's
recurrent step, MLA's absorbed attention), the test prefills and then decodes, and checks both segments.

The mixers run at MIXER_SCALE_REALISTIC (tests/hf_ref.py): at the parity suite's 0.3 scale a one-bf16-rounding
error in an MLA layer's output moves the logits by ~4e-5, under FLIP; at 1.0 every mixer layer's moves them by
>= 6e-4 (test_one_mixer_layer_error_reaches_the_logits shows both).
"""

from __future__ import annotations

import contextlib
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import transformers

from conversion.load import load_hf
from ling_jax import model
from ling_jax.crosscheck import reference_applies_swiglu_clamps

from tests.hf_ref import MIXER_SCALE_REALISTIC, MOD, WEIGHT_SCALE, SmallConfig, build
from tests.numerics import input_seed, rel_err

TOL_F32 = 1e-5
FLIP = 10 * TOL_F32
PROMPT = 100  # not a multiple of 64: the chunked KDA prefill runs a padded second chunk
STEPS = 8  # decode steps after the prompt, where a test covers the decode path
# The size of one bf16 rounding: the scale of a rounding in the wrong place or a wrong eps in one layer.
ONE_LAYER_ERROR = 2.0 ** -8

MLA_ONLY = ("full_attention",)


def small(name: str, **fields) -> SmallConfig:
    """A 1-group config with a dense FFN unless `fields` say otherwise."""
    base = dict(num_hidden_layers=1, layer_group_size=2, q_lora_rank=None, first_k_dense_replace=1,
                num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    return SmallConfig(name, **(base | fields))


def checkpoint(cfg: SmallConfig, path, *, seed: int = 0, mixer_scale: float = MIXER_SCALE_REALISTIC, **scales):
    """(float64 reference model, ling-jax cfg, float32 params) of one random checkpoint saved by transformers."""
    m32, m64 = build(cfg, seed, mixer_scale=mixer_scale, **scales)
    m32.save_pretrained(path, max_shard_size="200KB")
    lcfg, params = load_hf(path, dtype=jnp.float32, progress=False)
    return m64, lcfg, params


def token_ids(cfg: SmallConfig, batch: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(input_seed(seed))
    return rng.integers(2, cfg.vocab_size, size=(batch, PROMPT + STEPS))


def reference(m64, ids: np.ndarray) -> np.ndarray:
    """Full-sequence float64 logits; no cache (a KDA-only model has no attention layer to size one from)."""
    with torch.no_grad():
        return m64(torch.as_tensor(ids), use_cache=False).logits.double().numpy()


def ours(params, cfg, ids: np.ndarray, *, decode: bool = False) -> np.ndarray:
    """ling-jax logits at every position of `ids`: one prefill, or a prefill of PROMPT then one decode per token."""
    ids = jnp.asarray(ids)
    if not decode:
        return np.asarray(model.prefill(params, ids, cfg, max_len=ids.shape[1], all_logits=True)[0])
    logits, state, _ = model.prefill(params, ids[:, :PROMPT], cfg, max_len=ids.shape[1], all_logits=True)
    steps = [np.asarray(logits)]
    for t in range(PROMPT, ids.shape[1]):
        step, state, _ = model.decode(params, state, ids[:, t], cfg)
        steps.append(np.asarray(step)[:, None])
    return np.concatenate(steps, axis=1)


def segments(got: np.ndarray, want: np.ndarray, decode: bool):
    """(name, got, want) per compared segment: the prefill's positions, and the decode steps' when the run decoded."""
    if not decode:
        return [("prefill", got, want)]
    return [("prefill", got[:, :PROMPT], want[:, :PROMPT]), ("decode", got[:, PROMPT:], want[:, PROMPT:])]


def assert_matches(got: np.ndarray, want: np.ndarray, what: str, decode: bool = False) -> None:
    for part, g, w in segments(got, want, decode):
        err = rel_err(g, w)
        print(f"{what} [{part}]: rel err {err:.2e} (tolerance {TOL_F32:.0e})")
        assert err <= TOL_F32, f"{what} [{part}]: ling-jax is {err:.2e} from the reference (tolerance {TOL_F32:.0e})"


def assert_flip_shows(flipped: np.ndarray, want: np.ndarray, what: str, decode: bool = False) -> None:
    """The flipped variant must land >= FLIP away: otherwise a bug in this choice would pass the parity check."""
    for part, f, w in segments(flipped, want, decode):
        moved = rel_err(f, w)
        print(f"flip {what} [{part}]: moves the logits {moved:.2e} (needs >= {FLIP:.0e})")
        assert moved >= FLIP, (f"flipping {what} moves the [{part}] logits only {moved:.2e} < {FLIP:.0e}: this config "
                               "cannot see a bug in that choice; make the choice matter more")


# ---- rms_norm_eps -----------------------------------------------------------------------------------------------

EPS = 1e-2
# Embedding rows at rms 0.1 make mean(h^2) ~ EPS, so the eps of every norm site changes its output.
EPS_EMBED_SCALE = 0.1
EPS_CONFIG = small("eps-1e-2", num_hidden_layers=2, q_lora_rank=24, first_k_dense_replace=2, rms_norm_eps=EPS)
# Norm modules of the reference that read config.rms_norm_eps, by name suffix.
EPS_SITES = ("input_layernorm", "post_attention_layernorm", "model.norm", "o_norm")
# Norms whose eps is fixed at 1e-6 whatever rms_norm_eps says (docs/model.md §3.3): the MLA latent norms.
FIXED_EPS_SITES = ("q_a_layernorm", "kv_a_layernorm")


@contextlib.contextmanager
def eps_at(m64, suffixes: tuple[str, ...], eps: float):
    """The reference with every norm whose module name ends with one of `suffixes` at `eps`."""
    mods = [m for name, m in m64.named_modules() if name.endswith(suffixes)]
    assert mods, f"no reference module ends with {suffixes}"
    saved = [m.variance_epsilon for m in mods]
    for m in mods:
        m.variance_epsilon = eps
    try:
        yield
    finally:
        for m, e in zip(mods, saved):
            m.variance_epsilon = e


@contextlib.contextmanager
def kda_l2norm_eps(flipped: float):
    """The reference's KDA q/k L2 normalisation with another eps (it is a fixed 1e-6, not rms_norm_eps)."""
    original = MOD.l2norm
    MOD.l2norm = lambda x, dim=-1, eps=None: original(x, dim=dim, eps=flipped)
    try:
        yield
    finally:
        MOD.l2norm = original


@pytest.fixture(scope="module")
def eps_case(tmp_path_factory):
    m64, cfg, params = checkpoint(EPS_CONFIG, tmp_path_factory.mktemp("eps"), embed_scale=EPS_EMBED_SCALE)
    assert cfg.rms_norm_eps == EPS
    ids = token_ids(EPS_CONFIG, seed=1)
    return dict(m64=m64, cfg=cfg, params=params, ids=ids, got=ours(params, cfg, ids, decode=True))


def test_rms_norm_eps_shows_at_every_site(eps_case):
    """eps = 1e-2 at small-norm activations, prefill then decode. Each site that reads rms_norm_eps, set back to 1e-6
    in the reference, and each fixed-eps site (the MLA latent norms, KDA's q/k L2 norm), given rms_norm_eps, moves
    the logits >= FLIP: ling-jax using the wrong eps at any one site fails the parity check."""
    m64, ids = eps_case["m64"], eps_case["ids"]
    want = reference(m64, ids)
    assert_matches(eps_case["got"], want, "rms_norm_eps=1e-2", decode=True)
    for site in EPS_SITES:
        with eps_at(m64, (site,), 1e-6):
            assert_flip_shows(reference(m64, ids), want, f"the eps of {site} to 1e-6", decode=True)
    for site in FIXED_EPS_SITES:
        with eps_at(m64, (site,), EPS):
            assert_flip_shows(reference(m64, ids), want, f"the eps of {site} to rms_norm_eps", decode=True)
    with kda_l2norm_eps(EPS):
        assert_flip_shows(reference(m64, ids), want, "the KDA q/k L2-norm eps to rms_norm_eps", decode=True)


# ---- weight scale -----------------------------------------------------------------------------------------------

SCALE_CONFIG = small("kda-mla-x2", num_hidden_layers=4, first_k_dense_replace=4)


@contextlib.contextmanager
def mixer_output_error(m64, layer: int, size: float, seed: int = 0):
    """The reference with layer `layer`'s mixer output times (1 + size * noise): a relative L2 error of `size`."""
    g = torch.Generator().manual_seed(seed)

    def perturb(module, args, out):
        y = out[0] if isinstance(out, tuple) else out
        y = y * (1 + size * torch.randn(y.shape, generator=g, dtype=y.dtype))
        return (y, *out[1:]) if isinstance(out, tuple) else y

    handle = m64.model.layers[layer].self_attn.register_forward_hook(perturb)
    try:
        yield
    finally:
        handle.remove()


def one_layer_errors(m64, ids: np.ndarray) -> list[float]:
    want = reference(m64, ids)
    moved = []
    for layer in range(len(m64.model.layers)):
        with mixer_output_error(m64, layer, ONE_LAYER_ERROR):
            moved.append(rel_err(reference(m64, ids), want))
    return moved


def test_one_mixer_layer_error_reaches_the_logits(tmp_path):
    """At the realistic mixer scale an error of one bf16 rounding in any single mixer layer's output (KDA and MLA,
    two of each) moves the logits >= FLIP; at the parity suite's 0.3 scale some layer's stays under it."""
    ids = token_ids(SCALE_CONFIG, seed=2)[:, :PROMPT]
    m64, cfg, params = checkpoint(SCALE_CONFIG, tmp_path / "realistic")
    want = reference(m64, ids)
    assert_matches(ours(params, cfg, ids), want, f"mixer scale {MIXER_SCALE_REALISTIC}")
    realistic = one_layer_errors(m64, ids)
    print("one-layer error reach, realistic scale:", [f"{e:.1e}" for e in realistic])
    kinds = [m64.config.layer_types[i] for i in range(len(realistic))]
    assert min(realistic) >= FLIP, (f"an error of {ONE_LAYER_ERROR:.1e} in one mixer layer moves the logits only "
                                    f"{min(realistic):.2e} < {FLIP:.0e} ({dict(zip(kinds, realistic))})")
    _, weak = build(SCALE_CONFIG, 0, mixer_scale=WEIGHT_SCALE)
    diluted = one_layer_errors(weak, ids)
    print("one-layer error reach, 0.3 scale:", [f"{e:.1e}" for e in diluted])
    assert min(diluted) < FLIP, "the 0.3 scale already shows every layer: the realistic scale is not needed"


# ---- KDA gate lower bound ---------------------------------------------------------------------------------------

def test_kda_lower_bound_minus_2(tmp_path):
    """Gate lower bound -2 (Ling ships -5): a bound read as the default -5 moves the prefill and the recurrent
    decode logits >= FLIP."""
    small_cfg = small("kda-lb-2", kda_lower_bound=-2.0, layer_types=("linear_attention",))
    m64, cfg, params = checkpoint(small_cfg, tmp_path)
    assert cfg.kda_lower_bound == -2.0 and cfg.kda_layers == (0,)
    ids = token_ids(small_cfg, seed=3)
    want = reference(m64, ids)
    assert_matches(ours(params, cfg, ids, decode=True), want, "kda_lower_bound=-2", decode=True)
    assert_flip_shows(ours(params, cfg.replace(kda_lower_bound=-5.0), ids, decode=True), want,
                      "kda_lower_bound to -5", decode=True)


# ---- norm_topk_prob ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw-scores"])
def test_norm_topk_prob(tmp_path, renormalize):
    small_cfg = small(f"topk-norm-{renormalize}", first_k_dense_replace=0, layer_types=MLA_ONLY,
                      norm_topk_prob=renormalize)
    m64, cfg, params = checkpoint(small_cfg, tmp_path)
    assert cfg.norm_topk_prob is renormalize
    ids = token_ids(small_cfg, seed=4)[:, :PROMPT]
    want = reference(m64, ids)
    assert_matches(ours(params, cfg, ids), want, f"norm_topk_prob={renormalize}")
    assert_flip_shows(ours(params, cfg.replace(norm_topk_prob=not renormalize), ids), want,
                      f"norm_topk_prob to {not renormalize}")


# ---- SwiGLU clamps ----------------------------------------------------------------------------------------------

# Two MoE layers; the routed experts clamp on layer 1 only and the shared expert on layer 0 only, so the lists'
# per-layer indexing shows. At these limits (gate/up activations ~0.3 rms) the clamps engage on >= 5 % of the
# SiLU outputs and >= 30 % of the up projections.
ROUTED_LIMITS = (0.0, 0.2)
SHARED_LIMITS = (0.24, 0.0)
CLAMP_CONFIG = small("clamps", num_hidden_layers=2, first_k_dense_replace=0, layer_types=MLA_ONLY * 2,
                     expert_swiglu_limit_list=ROUTED_LIMITS, share_expert_swiglu_limit_list=SHARED_LIMITS)


class ClampedSwiGLU:
    """docs/model.md §6's clamped SwiGLU in float64, counting where each clamp engages."""

    def __init__(self, form: str = "post_silu"):
        self.form = form
        self.engaged: list[tuple[float, float]] = []  # (fraction of SiLU outputs clamped, of up values clamped)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        if limit == 0:
            return F.silu(gate) * up
        self.engaged.append(((F.silu(gate) > limit).double().mean().item(), (up.abs() > limit).double().mean().item()))
        act = F.silu(gate).clamp(max=limit) if self.form == "post_silu" else F.silu(gate.clamp(max=limit))
        return act * up.clamp(-limit, limit)


def clamp_reference_(m64, swiglu: ClampedSwiGLU, routed: tuple[float, ...], shared: tuple[float, ...]) -> None:
    """Make the reference's experts and shared experts clamp by `swiglu`, per layer (whatever transformers does)."""
    def experts_forward(limit):
        def forward(self, x, top_k_index, top_k_weights):
            gate, up = torch.einsum("td,tkid->tki", x, self.gate_up_proj[top_k_index]).chunk(2, dim=-1)
            y = torch.einsum("tki,tkdi->tkd", swiglu(gate, up, limit), self.down_proj[top_k_index])
            return (y * top_k_weights[..., None]).sum(1)
        return forward

    def shared_forward(limit):
        return lambda self, x: self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), limit))

    for layer, r, s in zip(m64.model.layers, routed, shared):
        layer.mlp.experts.forward = types.MethodType(experts_forward(r), layer.mlp.experts)
        layer.mlp.shared_experts.forward = types.MethodType(shared_forward(s), layer.mlp.shared_experts)


def test_swiglu_clamps_that_engage(tmp_path):
    """With the clamps engaged (>= 5 % of SiLU outputs, >= 30 % of up values), ling-jax's default (clamps on)
    matches the float64 reference whose experts clamp by docs/model.md §6's formula, written out here, in prefill
    and decode. transformers >= 5.25 applies that formula itself, so its own logits match ling-jax's default and the
    written-out reference; 5.24 ignores the lists, and ling-jax with apply_swiglu_clamps=False matches it. Turning
    the clamps off, zeroing either list, shifting them to the other layer, or clamping before the SiLU each moves
    the logits >= FLIP."""
    m64, cfg, params = checkpoint(CLAMP_CONFIG, tmp_path)
    assert (cfg.expert_swiglu_limits, cfg.shared_swiglu_limits) == (ROUTED_LIMITS, SHARED_LIMITS)
    ids = token_ids(CLAMP_CONFIG, seed=5)
    applies = reference_applies_swiglu_clamps(MOD)
    transformers_logits = reference(m64, ids)
    unclamped = cfg.replace(apply_swiglu_clamps=False)
    assert_matches(ours(params, cfg if applies else unclamped, ids), transformers_logits,
                   f"transformers {transformers.__version__} ({'clamps' if applies else 'no clamps'}) vs ling-jax")

    swiglu = ClampedSwiGLU()
    clamp_reference_(m64, swiglu, ROUTED_LIMITS, SHARED_LIMITS)
    want = reference(m64, ids)
    (shared_silu, shared_up), (routed_silu, routed_up) = swiglu.engaged
    print(f"clamped fraction: shared silu {shared_silu:.1%} up {shared_up:.1%}; routed silu {routed_silu:.1%} "
          f"up {routed_up:.1%}")
    assert min(shared_silu, routed_silu) >= 0.05 and min(shared_up, routed_up) >= 0.3, "the clamps barely engage"
    assert_matches(ours(params, cfg, ids, decode=True), want, "clamped", decode=True)
    if applies:
        assert rel_err(transformers_logits, want) <= TOL_F32, "transformers' own clamps are not the written formula"

    assert_flip_shows(ours(params, unclamped, ids), want, "the clamps off")
    assert_flip_shows(ours(params, cfg.replace(expert_swiglu_limits=(0.0, 0.0)), ids), want, "the routed limits to 0")
    assert_flip_shows(ours(params, cfg.replace(shared_swiglu_limits=(0.0, 0.0)), ids), want, "the shared limits to 0")
    shifted = cfg.replace(expert_swiglu_limits=ROUTED_LIMITS[::-1], shared_swiglu_limits=SHARED_LIMITS[::-1])
    assert_flip_shows(ours(params, shifted, ids), want, "the limits to the other layer")
    clamp_reference_(m64, ClampedSwiGLU("pre_silu"), ROUTED_LIMITS, SHARED_LIMITS)
    assert_flip_shows(reference(m64, ids), want, "the clamp to before the SiLU")


# ---- batch ------------------------------------------------------------------------------------------------------

def test_batch_of_three(tmp_path):
    """Three prompts in one batch, KDA + MLA with MoE, prefill then decode: each row matches its own reference row,
    and the rows differ (a row mix-up moves the logits >= FLIP). The API takes tokens [B, T] with one length per
    batch (ModelState.length is a scalar), so prompts of different lengths cannot share a batch."""
    small_cfg = small("batch3", num_hidden_layers=2, first_k_dense_replace=0)
    m64, cfg, params = checkpoint(small_cfg, tmp_path)
    ids = token_ids(small_cfg, batch=3, seed=6)
    want = reference(m64, ids)
    got = ours(params, cfg, ids, decode=True)
    for row in range(3):
        assert_matches(got[row:row + 1], want[row:row + 1], f"batch row {row}", decode=True)
    assert_flip_shows(got[[1, 2, 0]], want, "the rows' order", decode=True)


# ---- RoPE -------------------------------------------------------------------------------------------------------

ROPE_DIM = 16  # the parity configs use 8


def interleave_as_halves(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """NeoX rotate-half pairs (x_i, x_{i+P/2}) in place of Ling's interleaved (x_2i, x_2i+1)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotate(q), rotate(k)


@contextlib.contextmanager
def rope_layout(fn):
    original = MOD.apply_rotary_pos_emb_interleave
    MOD.apply_rotary_pos_emb_interleave = fn
    try:
        yield
    finally:
        MOD.apply_rotary_pos_emb_interleave = original


@contextlib.contextmanager
def rope_frequencies_over(m64, dims: int, theta: float):
    """The reference's inverse frequencies spread as if the rope had `dims` dims (its own count of pairs kept)."""
    rotary = m64.model.rotary_emb
    saved = rotary.inv_freq.clone()
    rotary.inv_freq.copy_(1.0 / theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float) / dims))
    try:
        yield
    finally:
        rotary.inv_freq.copy_(saved)


@pytest.mark.parametrize("theta", [1e4, 6e6], ids=["theta1e4", "theta6e6"])
def test_rope_theta_and_dims(tmp_path, theta):
    """16 rope dims at theta 1e4 and 6e6, prefill then absorbed-MLA decode: the other theta, NeoX halves instead of
    interleaved pairs, and frequencies spread over 8 dims each move the logits >= FLIP."""
    small_cfg = small(f"rope-{theta:g}", layer_types=MLA_ONLY, rope_theta=theta, qk_rope_head_dim=ROPE_DIM)
    m64, cfg, params = checkpoint(small_cfg, tmp_path)
    assert (cfg.rope_theta, cfg.qk_rope_head_dim) == (theta, ROPE_DIM)
    ids = token_ids(small_cfg, seed=7)
    want = reference(m64, ids)
    assert_matches(ours(params, cfg, ids, decode=True), want, f"rope theta {theta:g}", decode=True)
    other = 6e6 if theta == 1e4 else 1e4
    assert_flip_shows(ours(params, cfg.replace(rope_theta=other), ids, decode=True), want, f"theta to {other:g}",
                      decode=True)
    with rope_layout(interleave_as_halves):
        assert_flip_shows(reference(m64, ids), want, "the rope pairs to NeoX halves", decode=True)
    with rope_frequencies_over(m64, 8, theta):
        assert_flip_shows(reference(m64, ids), want, "the rope frequencies to 8 dims", decode=True)
