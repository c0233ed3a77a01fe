"""Ling-3 forward passes: `prefill`, `decode`, `verify` (+ `mtp_forward`), all pure and jittable.

All three run one `forward`: embed -> 42 pre-norm blocks (KDA or MLA mixer, dense or MoE FFN) -> final norm ->
lm_head. The mode only picks how the mixers use their caches:

    prefill  fresh sequence, T tokens: chunked KDA, expanded MLA attention; returns a ModelState. A prompt longer
             than `chunk` runs as chunks, each a forward in mode "extend" from the state the previous one left
             (KDA from its state and conv window, MLA over the latent cache so far), so the MoE's and the
             queries' activations scale with the chunk, not the prompt (the MLA keys with the cache length)
    decode   one token per sequence from a ModelState: recurrent KDA, absorbed MLA over the latent cache
    verify   T tokens from a ModelState (last committed + drafts): every position's logits and a StagedState;
             `ling_jax.cache.commit(staged, n)` keeps the first n positions

Einsum letters: b batch, t tokens, d hidden, h heads, k/v KDA head dims, r kv_lora_rank, n/e MLA head dims,
i intermediate, c latent + rope. The compute dtype is the dtype of `params["embed"]`; logits come back as float32.
`backend` selects the implementation of each op in pallas_kernels: "reference", "pallas", "fast", or per op
(ling_jax/backends.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.backends import check_config, check_partitioning, op_backend
from ling_jax.cache import MLACache, ModelState, StagedState, cache_capacity, init_state, layers_capacity
from ling_jax.config import KDA, MLA, MOE, DeviceMemoryError, LingConfig
from ling_jax.layers.kda import kda_block
from ling_jax.layers.linear import dense_argmax, proj, uses_gemv
from ling_jax.layers.mla import mla_block
from ling_jax.layers.mlp import dense_mlp
from ling_jax.layers.moe import moe_block
from ling_jax.layers.norms import rms_norm
from ling_jax.params import LM_HEAD_AXES, as_params


PREFILL_MODES = ("prefill", "extend")
# Prompt tokens per prefill forward: a one-shot prefill up to this length, chunks beyond it. The MoE prefill's
# sorted pairs grow with the chunk, and smaller chunks cost time (1.55x at 8192 in chunks of 2048 on the H200,
# experiments/RESULTS.md "Prefill"); 8192 covers SGLang's prompt in one forward.
PREFILL_CHUNK = 8192


def _check_call(params: dict, cfg: LingConfig, backend: str) -> None:
    """Checks that need only the call's static arguments and the params' placement: run before tracing."""
    check_config(cfg, backend)
    check_partitioning(params, backend)


def _check_tokens(tokens, cfg: LingConfig, what: str) -> None:
    """Shape and dtype always; the ids' range too when they are concrete (outside jit: the raw API's inputs)."""
    shape, dtype = jnp.shape(tokens), jnp.result_type(tokens)
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"{what}.shape={tuple(shape)} must be [batch, T] with T >= 1 (an empty prompt has no "
                         "position to predict from)")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{what}.dtype={dtype} must be an integer type (token ids)")
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{what} holds ids in [{ids.min()}, {ids.max()}] but the vocabulary is [0, {cfg.vocab_size})"
                         f"; pass ids of this model's tokenizer")


def _check_capacity(state, t: int) -> None:
    """`checked=True`: read the length on the host and refuse a step that would write past the latent caches."""
    capacity = cache_capacity(state)
    length = int(jax.device_get(state.length))
    if capacity is not None and length + t > capacity:
        raise ValueError(f"the caches hold {capacity} positions and {length} are used: {t} more token(s) do not "
                         "fit; prefill with a larger max_len")


def embed_lookup(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of `embed`; an id outside the vocabulary gives a NaN row (so NaN logits), never a clamped neighbour."""
    return jnp.take(embed, tokens, axis=0, mode="fill", fill_value=jnp.nan)


def _poison_overflow(h: jax.Array, layers: tuple, start: jax.Array, t: int) -> jax.Array:
    """NaN head inputs, hence NaN logits, for a step whose positions pass the latent caches' end (the cache write
    clamps, so the step and every later one would read wrong keys): visible on the device, with no host read."""
    capacity = layers_capacity(layers)
    if capacity is None:
        return h
    return jnp.where(start + t > capacity, jnp.nan, h)


def block(p: dict, h: jnp.ndarray, entry, start: jax.Array, cfg: LingConfig, layer: int, *, mixer: str, ffn: str,
          mode: str, backend: str):
    """One pre-norm residual block; `layer` indexes the clamp lists (the MTP layer passes num_layers). The mixer
    takes h and its norm (the projection kernels normalise in their prologue) and adds its output to h."""
    eps = cfg.rms_norm_eps
    gemv = op_backend(backend, "gemv")
    norm = (p["input_norm"], eps)
    if mixer == KDA:
        h, entry = kda_block(p["mixer"], h, norm, entry, cfg, mode=mode, backend=op_backend(backend, "kda"),
                             gemv=gemv, residual=h)
    else:
        mla_op = "mla_prefill" if mode in PREFILL_MODES else "mla_decode"
        h, entry = mla_block(p["mixer"], h, norm, entry, start, cfg, mode=mode, backend=op_backend(backend, mla_op),
                             gemv=gemv, residual=h)
    if ffn == MOE:
        moe_op = "moe_prefill" if mode in PREFILL_MODES else "moe_decode"
        return moe_block(p["ffn"], h, (p["post_norm"], eps), cfg, layer, backend=op_backend(backend, moe_op),
                         residual=h), entry
    return dense_mlp(p["ffn"], h, (p["post_norm"], eps), cfg, gemv=gemv, residual=h), entry


def forward(params: dict, tokens: jax.Array, layers: tuple, start: jax.Array, cfg: LingConfig, *, mode: str,
            backend: str, all_logits: bool = True, head: str = "logits"):
    """tokens [B, T] at positions start.. -> (logits [B, T or 1, V] f32, final-normed hidden [B, T, D], layers).

    head="greedy": the first output is the greedy tokens [B, T or 1] int32 instead, argmax of the same logits
    (`greedy_tokens`); with the `gemv` op on Pallas the logits are never written.
    """
    if head not in ("logits", "greedy"):
        raise ValueError(f"head={head!r} must be 'logits' or 'greedy'")
    h = embed_lookup(params["embed"], tokens)
    new_layers = []
    for i, (p, entry) in enumerate(zip(params["layers"], layers)):
        mixer, ffn = cfg.layer_kinds[i]
        with jax.named_scope(f"layer{i}_{mixer}_{ffn}"):
            h, entry = block(p, h, entry, start, cfg, i, mixer=mixer, ffn=ffn, mode=mode, backend=backend)
        new_layers.append(entry)
    hidden = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    # A step past the caches' end gives NaN logits: greedy then picks id 0, as jnp.argmax over NaN logits does.
    if head == "greedy":
        head_h = _poison_overflow(h if all_logits else h[:, -1:], layers, start, tokens.shape[1])
        return greedy_tokens(params, head_h, cfg, backend=backend), hidden, tuple(new_layers)
    head_in = _poison_overflow(hidden if all_logits else hidden[:, -1:], layers, start, tokens.shape[1])
    logits = proj("btd,dv->btv", head_in, params["lm_head"]).astype(jnp.float32)
    return logits, hidden, tuple(new_layers)


def greedy_tokens(params: dict, h: jax.Array, cfg: LingConfig, *, backend: str) -> jax.Array:
    """The greedy next tokens from the last block's output h [B, T, D] -> int32 [B, T]: argmax over the
    vocabulary of the logits `forward` returns, the lowest id among equal maxima (as jnp.argmax). With the `gemv`
    op on Pallas (and at most 16 tokens) the final norm, lm_head and argmax are one kernel per vocabulary block
    and a reduce over the blocks' maxima."""
    norm = (params["final_norm"], cfg.rms_norm_eps)
    if uses_gemv(op_backend(backend, "gemv"), h.shape[0] * h.shape[1]):
        return dense_argmax(h, params["lm_head"], LM_HEAD_AXES, norm=norm)
    logits = proj("btd,dv->btv", rms_norm(h, *norm), params["lm_head"]).astype(jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def prefill(params: dict, tokens: jax.Array, cfg: LingConfig, *, max_len: int, backend: str = "reference",
            all_logits: bool = False, chunk: int | None = None):
    """Start sequences from `tokens` [B, T] -> (logits [B, T or 1, V], ModelState, hidden [B, T, D]).

    `max_len` sizes the MLA latent caches (prompt + every token to come; rounded up, see cache.cache_len).
    `chunk` (default PREFILL_CHUNK): prompt tokens per forward; a longer prompt runs in chunks of this size (the
    first takes the remainder), which gives the same result as one forward up to rounding order.
    Token ids are range-checked on the host when they are concrete (called outside jit), and the caches plus one
    chunk's activations are checked against the device's free memory before anything is allocated.
    """
    params = as_params(params)
    _check_call(params, cfg, backend)
    _check_tokens(tokens, cfg, "tokens")
    B, T = jnp.shape(tokens)
    if T > max_len:
        raise ValueError(f"prompt length {T} exceeds max_len={max_len}: pass a max_len that "
                         "holds the prompt and every token to come")
    chunk = min(check_chunk(chunk), T)  # any chunk >= T is the one-shot prefill: one compiled program
    check_prefill_memory(params, cfg, B, T, chunk, max_len, backend, all_logits=all_logits)
    return _prefill(params, tokens, cfg, max_len=max_len, backend=backend, all_logits=all_logits, chunk=chunk)


def check_chunk(chunk: int | None) -> int:
    if chunk is None:
        return PREFILL_CHUNK
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"prefill chunk={chunk!r} must be an int >= 1 (prompt tokens per prefill forward)")
    return chunk


def _prefill_chunks(T: int, chunk: int) -> tuple[int, int]:
    """(tokens of the first forward, number of full chunks after it): the remainder goes first, so the rest is one
    scan over equal chunks (one compiled body)."""
    head = T % chunk or min(T, chunk)
    return head, (T - head) // chunk


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "backend", "all_logits", "chunk"))
def _prefill(params, tokens, cfg, *, max_len, backend, all_logits, chunk=PREFILL_CHUNK):
    B, T = tokens.shape
    state = init_state(cfg, B, max_len, params["embed"].dtype)
    head, n_chunks = _prefill_chunks(T, chunk)
    logits, hidden, layers = forward(params, tokens[:, :head], state.layers, state.length, cfg, mode="prefill",
                                     backend=backend, all_logits=all_logits)
    state = ModelState(jnp.asarray(head, jnp.int32), layers)
    if not n_chunks:
        return logits, state, hidden

    def one_chunk(state, piece):
        lg, hd, layers = forward(params, piece, state.layers, state.length, cfg, mode="extend", backend=backend,
                                 all_logits=all_logits)
        return ModelState(state.length + chunk, layers), (lg, hd)

    pieces = tokens[:, head:].reshape(B, n_chunks, chunk).swapaxes(0, 1)  # [n, B, C]
    state, (lgs, hds) = jax.lax.scan(one_chunk, state, pieces)
    hidden = jnp.concatenate([hidden, hds.swapaxes(0, 1).reshape(B, T - head, -1)], axis=1)
    logits = jnp.concatenate([logits, lgs.swapaxes(0, 1).reshape(B, T - head, -1)], 1) if all_logits else lgs[-1]
    return logits, state, hidden


def prefill_bytes(cfg: LingConfig, batch: int, prompt_len: int, chunk: int, max_len: int, itemsize: int, *,
                  tp: int = 1, flash_attention: bool = False, dense_moe: bool = False,
                  all_logits: bool = False) -> dict:
    """Per-device bytes a prefill allocates beside the params: the caches, and an estimate of one chunk's largest
    live activations: the MoE's sorted pairs (or XLA's dense form of the reference's ragged dots, `dense_moe`), the
    MLA keys and values (over the whole cache in a later chunk), and the reference attention's score matrix."""
    from ling_jax.cache import cache_len

    n_mla = sum(cfg.mixer_kind(i) == MLA for i in range(cfg.num_layers))
    n_kda = cfg.num_layers - n_mla
    L, c = cache_len(max_len), min(prompt_len, chunk)
    keys_len = L if prompt_len > chunk else c
    H, K = cfg.num_heads // tp, cfg.head_dim
    caches = (n_mla * batch * L * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
              + n_kda * batch * (H * K * K * 4 + (cfg.conv_kernel_size - 1) * 3 * H * K * itemsize))
    pairs = batch * c * cfg.num_experts_per_tok
    # Sorted inputs and expert outputs in the compute dtype, weighted contributions and their [N, K, D] scatter in
    # fp32, gate/up/activation rows.
    moe = pairs * (cfg.hidden_size * (2 * itemsize + 8) + 3 * cfg.moe_intermediate_size * itemsize)
    if dense_moe:  # XLA:GPU expands each ragged dot into [pairs, E·D] (experiments/RESULTS.md, "Prefill")
        moe += pairs * cfg.num_experts * cfg.hidden_size * itemsize
    keys = batch * keys_len * H * (cfg.qk_head_dim + cfg.v_head_dim) * itemsize
    scores = 0 if flash_attention else batch * H * c * keys_len * (itemsize + 4)
    logits = batch * (prompt_len if all_logits else 1) * cfg.vocab_size * 4
    return dict(caches=caches, activations=max(moe, keys + scores) + logits, moe=moe, attention=keys + scores)


def check_prefill_memory(params, cfg: LingConfig, batch: int, prompt_len: int, chunk: int, max_len: int,
                         backend: str, *, all_logits: bool = False) -> None:
    """Refuse a prefill whose caches plus one chunk's activations exceed the device's free memory, with the sizes,
    before any allocation. Skipped where the runtime reports no memory limit (the CPU) and inside an outer jit."""
    from ling_jax.backends import op_backend
    from ling_jax.sharding import tp_size

    try:
        device = next(iter(params["embed"].sharding.device_set))
        stats = device.memory_stats()
    except Exception:  # a tracer, or a runtime without memory stats
        return
    if not stats or "bytes_limit" not in stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    flash = op_backend(backend, "mla_prefill") != "reference"
    dense_moe = op_backend(backend, "moe_prefill") == "reference" and device.platform == "gpu"
    need = prefill_bytes(cfg, batch, prompt_len, chunk, max_len, jnp.dtype(params["embed"].dtype).itemsize,
                         tp=max(tp_size(), 1), flash_attention=flash, dense_moe=dense_moe, all_logits=all_logits)
    total = need["caches"] + need["activations"]
    if total > free:
        gib = 2 ** 30
        fixes = (["the prefill kernels (--backend fast)"] if dense_moe or not flash else []) + (
            ["a smaller prefill chunk (--prefill-chunk)"] if need["moe"] >= need["attention"] else
            ["a smaller max_len (the MLA keys and values span the whole cache)"]) + (
            ["only the last position's logits (all_logits=False)"] if all_logits else []) + (
            ["a larger XLA_PYTHON_CLIENT_MEM_FRACTION"])
        raise DeviceMemoryError(
            f"prefill of batch {batch} x {prompt_len} tokens with max_len={max_len} needs ~{total / gib:.1f} GiB per "
            f"device (caches {need['caches'] / gib:.1f} GiB, one {min(prompt_len, chunk)}-token chunk's activations "
            f"~{need['activations'] / gib:.1f} GiB: MoE {need['moe'] / gib:.1f}, attention "
            f"{need['attention'] / gib:.1f}) but {free / gib:.1f} GiB are free on {device.device_kind}: use "
            + ", or ".join(fixes))


def decode_forward(params: dict, state: ModelState, token: jax.Array, cfg: LingConfig, *, backend: str,
                   head: str = "logits"):
    """`decode` without its checks, jit or donation: the one-token forward the engine's loops call inside their own
    jitted blocks. head="greedy": the first output is the greedy next token [B] instead of the logits."""
    out, hidden, layers = forward(params, token[:, None], state.layers, state.length, cfg, mode="decode",
                                  backend=backend, head=head)
    return out[:, 0], ModelState(state.length + 1, layers), hidden[:, 0]


def decode(params: dict, state: ModelState, token: jax.Array, cfg: LingConfig, *, backend: str = "reference",
           checked: bool = False):
    """One token per sequence, token [B] -> (logits [B, V], ModelState, hidden [B, D]). `state` is donated.

    A step past the latent caches' capacity gives NaN logits (device-side, no host read); `checked=True` reads the
    length on the host first and raises instead.
    """
    params = as_params(params)
    _check_call(params, cfg, backend)
    if jnp.ndim(token) != 1:
        raise ValueError(f"token.shape={jnp.shape(token)} must be [batch]: one token per sequence")
    if checked:
        _check_capacity(state, 1)
    return _decode(params, state, token, cfg, backend=backend)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("state",))
def _decode(params, state, token, cfg, *, backend):
    return decode_forward(params, state, token, cfg, backend=backend)


def verify(params: dict, state: ModelState, tokens: jax.Array, cfg: LingConfig, *, backend: str = "reference",
           checked: bool = False):
    """tokens [B, T] from `state` -> (logits [B, T, V], StagedState, hidden [B, T, D]); commit with cache.commit.

    The MLA caches are donated and updated in place; the KDA entries are not (the staged state has other shapes, so
    their buffers could not be reused). Capacity as in `decode`.
    """
    params = as_params(params)
    _check_call(params, cfg, backend)
    _check_tokens(tokens, cfg, "tokens")
    if checked:
        _check_capacity(state, jnp.shape(tokens)[1])
    mla = tuple(e if isinstance(e, MLACache) else None for e in state.layers)
    kda = tuple(None if isinstance(e, MLACache) else e for e in state.layers)
    return _verify(params, state.length, kda, mla, tokens, cfg, backend=backend)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("mla",))
def _verify(params, length, kda, mla, tokens, cfg, *, backend):
    layers = tuple(m if m is not None else k for k, m in zip(kda, mla))
    logits, hidden, layers = forward(params, tokens, layers, length, cfg, mode="verify", backend=backend)
    return logits, StagedState(length, layers), hidden


def mtp_forward(params: dict, hidden: jax.Array, next_tokens: jax.Array, cache: MLACache, start: jax.Array,
                cfg: LingConfig, *, mode: str, backend: str = "reference"):
    """The NextN layer (docs/model.md §5) for tokens at positions start..start+T-1.

    hidden [B, T, D]: the main model's final-normed hidden state at each position i; next_tokens [B, T]: the token
    at i + 1. Returns (logits [B, T, V] f32 predicting the token at i + 2, the layer's final-normed output
    [B, T, D] (what a chained draft step feeds back as `hidden`, as the main model feeds its normed state), and
    the MLACache with these positions written).
    """
    params = as_params(params)
    if "mtp" not in params:
        raise ValueError("params have no 'mtp' entry: this config/checkpoint has no MTP layer "
                         "(num_nextn_predict_layers=0, or it was loaded with with_mtp=False)")
    p = params["mtp"]
    eps = cfg.rms_norm_eps
    e = embed_lookup(params["embed"], next_tokens)
    u = proj("btc,cd->btd", jnp.concatenate([rms_norm(e, p["enorm"], eps), rms_norm(hidden, p["hnorm"], eps)], -1),
             p["eh_proj"])
    u, cache = block(p["layer"], u, cache, start, cfg, cfg.num_layers, mixer=MLA, ffn=MOE, mode=mode,
                     backend=backend)
    out = rms_norm(u, p["final_norm"], eps)
    return proj("btd,dv->btv", out, params["lm_head"]).astype(jnp.float32), out, cache
