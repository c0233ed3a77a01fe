"""Per-layer parity between ling-jax and transformers' BailingHybridForCausalLM on one prompt.

A bug in one layer's numerics moves the logits by little (each random small layer moves them little), so a
logits check can miss it; compared layer by layer, the same bug stands out at its own layer. Both sides capture,
per decoder layer:

    mixer    the KDA / MLA output, before the residual add
    ffn      the dense MLP / MoE output (routed + shared experts), before the residual add
    hidden   the block's output (h after both residual adds)
    experts  MoE layers: the set of routed experts chosen for each token
    weights  MoE layers: their routing weights, matched by expert id

ling-jax's values are the model's own: `capture_ling` runs `ling_jax.model.forward` eagerly with its block, mixers,
FFNs and the router tapped, so what is compared is what the model computes, not a re-implementation of it.
transformers' values come from forward hooks. torch and transformers are imported only by the functions that need
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import numpy as np

QUANTITIES = ("mixer", "ffn", "experts", "weights", "hidden")
F32_TOLERANCE = 1e-5  # float32 against a float64 reference: transformers' own float32 run is ~1e-6 off its float64


@dataclasses.dataclass(frozen=True)
class Capture:
    """One forward's per-layer values (numpy): layers[i] maps a quantity to its array.

    Each layer holds "kind" ("kda+moe", "mla+dense", ...), "mixer", "ffn", "hidden" [B, T, D] and, for MoE
    layers, "ids" and "weights" [B*T, top_k]; the reference's MoE layers also hold "margin", the smallest gap, over
    tokens, between a selected and an unselected choice score (group or expert): a near-tie shows up there.
    """

    layers: tuple[dict, ...]
    logits: np.ndarray  # [B, T, V]


@dataclasses.dataclass(frozen=True)
class LayerCheck:
    """One compared quantity of one layer. `error` is ||ours - ref|| / ||ref||; for "experts" it is the fraction of
    tokens whose expert sets differ (tolerance 0: selection must agree exactly)."""

    layer: int
    kind: str
    quantity: str
    error: float
    tolerance: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def describe(self) -> str:
        verdict = "ok" if self.ok else f"over {self.tolerance:.0e}"
        note = f"  ({self.note})" if self.note else ""
        return f"layer {self.layer:>2} {self.kind:<10} {self.quantity:<8} {self.error:.3e}  {verdict}{note}"


@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[LayerCheck, ...]  # layer order, QUANTITIES order within a layer
    logits_error: float

    @property
    def failures(self) -> tuple[LayerCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)

    @property
    def first_failure(self) -> LayerCheck | None:
        """Where the divergence starts: later layers inherit its error through their inputs."""
        return next(iter(self.failures), None)

    def format(self) -> str:
        lines = [c.describe() for c in self.checks]
        lines.append(f"logits            {self.logits_error:.3e}")
        first = self.first_failure
        lines.append("all layers within tolerance" if first is None else
                     f"first over tolerance: layer {first.layer} {first.quantity} ({first.error:.3e} > "
                     f"{first.tolerance:.0e})")
        return "\n".join(lines)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


# ---- ling-jax side -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tapped_model(layers: dict):
    """Wrap the names `ling_jax.model.forward` calls so each layer's values land in layers[i] as they are computed;
    everything is restored on exit. Whatever those names hold on entry (a patched mixer, say) is what runs."""
    from ling_jax import model
    from pallas_kernels import moe as moe_ops

    current: dict = {}

    def block(p, h, entry, start, cfg, layer, *, mixer, ffn, **kw):
        current.clear()
        current["kind"] = f"{mixer}+{ffn}"
        out, entry = run_block(p, h, entry, start, cfg, layer, mixer=mixer, ffn=ffn, **kw)
        layers[layer] = dict(current, hidden=out)
        return out, entry

    # The mixers and the dense MLP add the block's residual themselves (in the GEMV's epilogue on the kernel path);
    # the taps run them without it and add it back as the reference path does (after the rounding): bit for bit.
    def tap_mixer(fn):
        def tapped(*args, residual=None, **kw):
            out, entry = fn(*args, residual=None, **kw)
            current["mixer"] = out
            return (out if residual is None else residual + out), entry
        return tapped

    def dense_mlp(p, h, norm, cfg, *, residual=None, **kw):
        current["ffn"] = y = run_dense(p, h, norm, cfg, **kw)
        return y if residual is None else residual + y

    def moe_block(p, x, cfg, layer, *, residual=None, **kw):
        y = run_moe(p, x, cfg, layer, residual=residual, **kw)
        # The MoE adds the block's residual itself (fused into its experts kernel), so the model runs as it does
        # and the residual is taken back out: ~1e-6 relative rounding at a residual 40x the FFN output.
        current["ffn"] = y if residual is None else y - residual
        return y

    def route(*args, **kw):
        weights, ids = run_route(*args, **kw)
        current["weights"], current["ids"] = weights, ids
        return weights, ids

    run_block, run_dense, run_moe, run_route = model.block, model.dense_mlp, model.moe_block, moe_ops.route
    with contextlib.ExitStack() as stack:
        for owner, name, new in ((model, "block", block), (model, "kda_block", tap_mixer(model.kda_block)),
                                 (model, "mla_block", tap_mixer(model.mla_block)), (model, "dense_mlp", dense_mlp),
                                 (model, "moe_block", moe_block), (moe_ops, "route", route)):
            stack.enter_context(mock.patch.object(owner, name, new))
        yield


def capture_ling(params: dict, cfg, tokens, *, backend: str = "reference") -> Capture:
    """ling-jax's prefill of tokens [B, T], eagerly (no jit: the taps read concrete values), on one device."""
    import jax.numpy as jnp

    from ling_jax import model
    from ling_jax.backends import check_config, check_partitioning
    from ling_jax.cache import init_state
    from ling_jax.sharding import tp_size

    if tp_size() > 1:
        raise ValueError("capture_ling runs on one device (the router's per-shard taps would hold traced values): "
                         "load the params without a tp mesh")
    tokens = jnp.asarray(tokens)
    check_config(cfg, backend)
    check_partitioning(params, backend)
    model._check_tokens(tokens, cfg, "tokens")
    B, T = tokens.shape
    state = init_state(cfg, B, T, params["embed"].dtype)
    layers: dict = {}
    with _tapped_model(layers):
        logits, _, _ = model.forward(params, tokens, state.layers, state.length, cfg, mode="prefill",
                                     backend=backend, all_logits=True)
    if sorted(layers) != list(range(cfg.num_layers)):
        raise RuntimeError(f"captured layers {sorted(layers)} of {cfg.num_layers}: ling_jax.model.forward no longer "
                           "calls `block` once per layer; update crosscheck._tapped_model to its new structure")
    return Capture(tuple(_to_numpy(layers[i]) for i in range(cfg.num_layers)), np.asarray(logits))


def _to_numpy(layer: dict) -> dict:
    return {k: v if isinstance(v, str) else np.asarray(v) for k, v in layer.items()}


# ---- transformers side ---------------------------------------------------------------------------------------

_HF_KINDS = {"linear_attention": "kda", "full_attention": "mla", "sparse": "moe", "dense": "dense"}


def capture_transformers(hf_model, tokens) -> Capture:
    """transformers' forward of tokens [B, T] through `hf_model` (a BailingHybridForCausalLM), its values taken by
    forward hooks on each decoder layer, its attention, its MLP and its router."""
    import torch

    config = hf_model.config
    decoder_layers = hf_model.model.layers[: config.num_hidden_layers]
    layers = [{"kind": f"{_HF_KINDS[config.layer_types[i]]}+{_HF_KINDS[config.mlp_layer_types[i]]}"}
              for i in range(len(decoder_layers))]

    def store(i, key, pick=lambda out: out):
        def hook(module, args, out):
            layers[i][key] = pick(out).detach().cpu().numpy()
        return hook

    def store_route(i):
        def hook(router, args, out):
            logits, weights, ids = (o.detach().cpu() for o in out)
            layers[i].update(ids=ids.numpy(), weights=weights.numpy(), margin=_selection_margin(router, logits))
        return hook

    handles = []
    for i, layer in enumerate(decoder_layers):
        handles.append(layer.register_forward_hook(store(i, "hidden")))
        # MLA returns (output, attention weights); KDA its output alone.
        handles.append(layer.self_attn.register_forward_hook(
            store(i, "mixer", lambda out: out[0] if isinstance(out, tuple) else out)))
        handles.append(layer.mlp.register_forward_hook(store(i, "ffn")))
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(store_route(i)))
    try:
        with torch.no_grad():
            logits = hf_model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits
    finally:
        for handle in handles:
            handle.remove()
    return Capture(tuple(layers), logits.detach().cpu().numpy())


def _selection_margin(router, logits) -> float:
    """Smallest gap, over tokens, between the last kept and the first dropped choice score, at the group stage and
    the expert stage of transformers' grouped top-k: how close the reference's selection is to a tie."""
    import torch

    choice = logits.double().sigmoid() + router.e_score_correction_bias.detach().cpu().double()
    n, e = choice.shape
    groups = choice.view(n, router.num_group, e // router.num_group)
    group_scores = groups.topk(2, dim=-1)[0].sum(-1)
    margins = [_kth_gap(group_scores, router.topk_group)] if router.topk_group < router.num_group else []
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(router.topk_group)[1], True)
    masked = choice.masked_fill(~kept.repeat_interleave(e // router.num_group, dim=1), float("-inf"))
    if router.top_k < router.topk_group * (e // router.num_group):
        margins.append(_kth_gap(masked, router.top_k))
    return min(margins, default=float("inf"))


def _kth_gap(scores, k: int) -> float:
    top = scores.topk(k + 1, dim=-1)[0]
    return float((top[:, k - 1] - top[:, k]).min())


# ---- comparison ----------------------------------------------------------------------------------------------


def compare(ours: Capture, ref: Capture, *, tolerance: float = F32_TOLERANCE) -> Report:
    """Every layer's quantities of `ours` against `ref` (the reference), each relative L2 error held to
    `tolerance` and the expert sets to exact agreement."""
    if len(ours.layers) != len(ref.layers):
        raise ValueError(f"ling-jax has {len(ours.layers)} layers and the reference {len(ref.layers)}: compare "
                         "a checkpoint with the model built from it")
    checks = []
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers)):
        if a["kind"] != b["kind"]:
            checks.append(LayerCheck(i, a["kind"], "kind", float("inf"), 0.0, f"reference layer is {b['kind']}"))
            continue
        checks.extend(_layer_checks(i, a, b, tolerance))
    return Report(tuple(checks), rel_err(ours.logits, ref.logits))


def _layer_checks(i: int, a: dict, b: dict, tolerance: float) -> list[LayerCheck]:
    kind = a["kind"]
    checks = [LayerCheck(i, kind, q, rel_err(a[q], b[q]), tolerance) for q in ("mixer", "ffn")]
    if "ids" in b:
        checks.extend(_routing_checks(i, kind, a, b, tolerance))
    checks.append(LayerCheck(i, kind, "hidden", rel_err(a["hidden"], b["hidden"]), tolerance))
    return checks


def _routing_checks(i: int, kind: str, a: dict, b: dict, tolerance: float) -> list[LayerCheck]:
    """Expert sets per token, and the weights matched by id on the tokens whose sets agree."""
    order_a, order_b = np.argsort(a["ids"], axis=1), np.argsort(b["ids"], axis=1)
    ids_a, ids_b = np.take_along_axis(a["ids"], order_a, 1), np.take_along_axis(b["ids"], order_b, 1)
    same = (ids_a == ids_b).all(axis=1)
    note = f"reference margin {b['margin']:.1e}"
    experts = LayerCheck(i, kind, "experts", float(1.0 - same.mean()), 0.0,
                         note if same.all() else f"{int((~same).sum())}/{same.size} tokens differ; {note}")
    w_a, w_b = np.take_along_axis(a["weights"], order_a, 1), np.take_along_axis(b["weights"], order_b, 1)
    weights = LayerCheck(i, kind, "weights", rel_err(w_a[same], w_b[same]) if same.any() else float("inf"), tolerance)
    return [experts, weights]
