"""The MTP (NextN) layer against a float64 implementation written here from docs/model.md §5.

transformers implements no MTP, so the test builds its own: the block itself is a transformers decoder layer
(MLA + MoE) made as an extra layer N of an (N+1)-layer model, and the glue around it (enorm/hnorm, eh_proj over
[embedding | hidden], final norm, the shared lm_head) is written below in float64 torch. The checkpoint is the
(N+1)-layer model saved by transformers, plus the four MTP-only tensors, with config.json saying N layers + 1 MTP
layer: exactly the official layout of `model.layers.N.*`.
"""


import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conversion.load import load_hf
from ling_jax import model
from ling_jax.cache import mla_cache

from tests.hf_ref import rel_err, save_with_mtp

N = 4
T = 37
TOL_F32 = 1e-5  # as the main-model parity: float32 vs float64, far below any structural error


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    return save_with_mtp(tmp_path_factory.mktemp("mtp_ckpt"), N)


def reference_mtp_logits(m64, extra, ids: np.ndarray) -> np.ndarray:
    """docs/model.md §5 in float64: logits at i from h_i (main model, after model.norm) and the embedding of token i+1."""
    inner = m64.model
    ids_t = torch.as_tensor(ids)
    inner.config.num_hidden_layers = N  # the main model: the first N layers only
    with torch.no_grad():
        h = inner(ids_t).last_hidden_state[:, :-1]
        e = inner.embed_tokens(ids_t[:, 1:])
        w = lambda name: extra[f"model.layers.{N}.{name}.weight"]  # noqa: E731
        u = torch.cat([_rms(e, w("enorm")), _rms(h, w("hnorm"))], -1) @ w("eh_proj").T
        steps = u.shape[1]
        pos = torch.arange(steps)[None]
        mask = torch.full((steps, steps), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        u = inner.layers[N](u, attention_mask=mask, position_ids=pos, position_embeddings=inner.rotary_emb(u, pos))
        return m64.lm_head(_rms(u, w("final_layernorm"))).numpy()


def test_mtp_layer_matches_float64_spec(mtp_case):
    cfg, params = load_hf(mtp_case["dir"], dtype=jnp.float32, progress=False)
    assert cfg.num_mtp_layers == 1 and "mtp" in params
    ids = np.random.default_rng(3).integers(2, cfg.vocab_size, size=(1, T + 1))
    want = reference_mtp_logits(mtp_case["m64"], mtp_case["extra"], ids)

    _, _, hidden = model.prefill(params, jnp.asarray(ids), cfg, max_len=T + 1, all_logits=True)
    cache = mla_cache(cfg, 1, T, jnp.float32)
    got, _, _ = model.mtp_forward(params, hidden[:, :-1], jnp.asarray(ids[:, 1:]), cache, jnp.int32(0), cfg,
                                  mode="prefill")
    assert rel_err(got, want) < TOL_F32

    # The same positions through the MTP layer's own cache: prefill a prefix, then one position at a time.
    P = T - 5
    _, _, cache = model.mtp_forward(params, hidden[:, :P], jnp.asarray(ids[:, 1:P + 1]), cache, jnp.int32(0), cfg,
                                    mode="prefill")
    steps = []
    for i in range(P, T):
        step, _, cache = model.mtp_forward(params, hidden[:, i:i + 1], jnp.asarray(ids[:, i + 1:i + 2]), cache,
                                           jnp.int32(i), cfg, mode="decode")
        steps.append(step)
    assert rel_err(jnp.concatenate(steps, 1), want[:, P:]) < TOL_F32
