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
them; `import_reference_model` imports transformers' model with fla hidden (its Triton kernels fail on the CPU).

`stream` is the same comparison at any model size (`ling-jax crosscheck`, ling_jax/cli.py): it never
builds either whole model. Layer by layer it loads that layer's weights into each side (ling-jax: the layer's params
leaves, from the HF checkpoint or an orbax one; transformers: one `BailingHybridDecoderLayer` built from the config
and filled from the safetensors), pushes each side's own hidden state through, compares, and frees both before the
next layer, so the host holds about two layers' weights and the activations. Each side keeps its own decode caches.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

QUANTITIES = ("mixer", "ffn", "experts", "weights", "hidden")
F32_TOLERANCE = 1e-5  # float32 against a float64 reference: transformers' own float32 run is ~1e-6 off its float64
INSTALL_HINT = 'pip install "ling-jax[crosscheck]"'


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

    def moe_block(p, h, norm, cfg, layer, *, residual=None, **kw):
        y = run_moe(p, h, norm, cfg, layer, residual=residual, **kw)
        # The MoE adds the block's residual itself (on Pallas at one token inside its down kernel), so the model
        # runs as it does and the residual is taken back out: ~1e-6 relative rounding at a residual 40x the output.
        current["ffn"] = y if residual is None else y - residual
        return y

    def route(*args, **kw):
        out = run_route(*args, **kw)  # (weights, ids), and the normed x when the router norms its input
        current["weights"], current["ids"] = out[:2]
        return out

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


# ---- transformers, imported with fla hidden -------------------------------------------------------------------

_ABSENT = object()


def import_reference_model():
    """transformers' `modeling_bailing_hybrid`, bound to its own pure-torch KDA code.

    transformers picks its KDA implementation when that module is imported: with fla-core importable it binds fla's
    Triton kernels, which fail on the CPU and are not the reference's own code. The module is imported with `fla`
    hidden, then fla is un-hidden, so `fla.ops.kda.naive` (an independent KDA reference) still imports.

    Raises:
      ImportError: torch or transformers (>= 5.24: the first with BailingHybrid) is missing; the message says what
        to install.
    """
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise ImportError(f"the transformers reference needs torch and transformers>=5.24 ({e}): {INSTALL_HINT}") \
            from None
    saved = sys.modules.get("fla", _ABSENT)
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
    try:
        from transformers.models.bailing_hybrid import modeling_bailing_hybrid as mod
    except ImportError as e:
        raise ImportError(f"transformers {transformers.__version__} has no BailingHybrid model ({e}); it needs "
                          f"transformers>=5.24: {INSTALL_HINT}") from None
    finally:
        if saved is _ABSENT:
            sys.modules.pop("fla", None)
        else:
            sys.modules["fla"] = saved
    return mod


def reference_applies_swiglu_clamps(mod=None) -> bool:
    """Whether transformers' BailingHybrid clamps its SwiGLUs by the limit lists (5.25 on) or ignores them (5.24),
    asked of its shared-expert MLP built with a limit set (docs/model.md §6)."""
    mod = mod or import_reference_model()
    config = mod.BailingHybridConfig(num_hidden_layers=1, num_mtp_layers=0, hidden_size=8, intermediate_size=8,
                                     expert_swiglu_limit_list=[1.0], share_expert_swiglu_limit_list=[1.0])
    try:
        mlp = mod.BailingHybridMLP(config, intermediate_size=8, layer_idx=0)
    except TypeError:  # an MLP that takes no layer index has no per-layer limit
        return False
    return getattr(mlp, "limit", None) is not None


def hf_config_dict(raw: dict) -> dict:
    """config.json as transformers' BailingHybridConfig takes it: limit lists cut to the decoder layers (>= 5.25
    refuses an MTP layer's entry, and transformers never runs that layer)."""
    n = raw.get("num_hidden_layers")
    cut = {k: raw[k][:n] for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")
           if isinstance(raw.get(k), list) and isinstance(n, int)}
    return {**raw, **cut}


# ---- layer-streamed cross-check -----------------------------------------------------------------------------

STREAM_QUANTITIES = ("mixer", "ffn")  # the hidden state after the mixer's residual add, and after the FFN's
# bfloat16: ling-jax against transformers' float32 run may be this many times as far as transformers' own bf16 run
# is from it, per layer and quantity (README "Cross-check against transformers" gives the measured ratios).
BF16_SPREAD_MULTIPLE = 3.0


def _release_memory(*, collect: bool = False) -> None:
    """Return a freed layer's pages now: glibc keeps large freed blocks unless asked, and the next layer may then
    land beside them instead of in them. The layers are freed by reference counting; `collect` also runs the cycle
    collector (~0.3 s with torch and JAX loaded, so once, after the prefill)."""
    if collect:
        gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to return
        ctypes.CDLL(None).malloc_trim(0)


def _part_root(key) -> tuple:
    """A params part by key: "embed", "final_norm", "lm_head", or a layer index."""
    return ("layers", key) if isinstance(key, int) else (key,)


def _subtree(tree, root: tuple):
    for k in root:
        tree = tree[k]
    return tree


class LingFromHF:
    """ling-jax's params from an HF checkpoint, one part at a time: the part's entries of the loader's plan,
    streamed as `load_hf` streams them. The checkpoint is validated (headers only) on construction."""

    def __init__(self, hf_dir, dtype):
        from conversion.load import plan_hf

        self.plan = plan_hf(hf_dir, dtype=dtype, with_mtp=False, stacklevel=4)
        self.cfg = self.plan.cfg

    def part(self, key):
        from conversion import hf
        from ling_jax.params import is_leaf_spec, param_specs

        root = _part_root(key)
        placed = self._stream(lambda path: path[:len(root)] == root)
        import jax

        specs = _subtree(param_specs(self.cfg, with_mtp=False), root)
        if is_leaf_spec(specs):
            return placed[root]
        return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_leaf_spec),
                                  [placed[root + p] for p in hf.spec_paths(specs)])

    def leaves(self, paths) -> dict:
        """{params path: array} of the leaves at `paths` only."""
        placed = self._stream(lambda path: path in paths)
        return {p: placed[p] for p in paths}

    def _stream(self, wanted) -> dict:
        """The leaves of the plan's entries that produce a leaf `wanted(path)` accepts, by path."""
        from conversion.load import stream_hf

        entries = [e for e in self.plan.entries if any(wanted(p) for p in e.paths)]
        placed: dict = {}
        for _, leaves in stream_hf(dataclasses.replace(self.plan, entries=entries), progress=False):
            placed.update(leaves)
        return placed


class LingFromOrbax:
    """ling-jax's params from a `ling-jax convert` (orbax) checkpoint, one part at a time: every other leaf is a
    placeholder orbax skips, so only the part's arrays are read."""

    def __init__(self, path, dtype):
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        from conversion import orbax_io
        from conversion.load import router_dtype_of, without_mtp

        path = self.path = Path(path).absolute()
        cfg = orbax_io.read_config(path)
        self.tree_dir = orbax_io._tree_dir(path / orbax_io.PARAMS_DIR)
        with ocp.StandardCheckpointer() as ckptr:
            stored = orbax_io._stored_shapes(ckptr, self.tree_dir, path / orbax_io.PARAMS_DIR)
        stored_by_path = orbax_io._check_structure(cfg, stored, str(path / orbax_io.PARAMS_DIR))
        self.full_cfg = cfg.replace(router_weight_dtype=router_dtype_of(
            jnp.dtype(dt).name for p, (_, dt) in stored_by_path.items() if p[-1] == "router"))
        self.cfg = without_mtp(self.full_cfg)
        self.dtype = dtype

    def part(self, key):
        root = _part_root(key)
        return _subtree(self._restore(lambda path: path[:len(root)] == root), root)

    def leaves(self, paths) -> dict:
        """{params path: array} of the leaves at `paths` only."""
        restored = self._restore(lambda path: path in paths)
        return {p: _subtree(restored, p) for p in paths}

    def _restore(self, wanted):
        """The params tree with the leaves `wanted(path)` accepts read, every other one a placeholder."""
        import jax
        import orbax.checkpoint as ocp

        from conversion import hf
        from conversion.orbax_io import explain_read_errors
        from ling_jax.params import is_spec, param_specs

        specs = param_specs(self.full_cfg)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        targets = [jax.ShapeDtypeStruct(spec.shape, spec.dtype(self.dtype), sharding=device)
                   if wanted(path) else ocp.PLACEHOLDER for path, spec in hf.array_paths(specs).items()]
        target = jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), targets)
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                                   dtype=x.dtype)
                                    if isinstance(x, jax.ShapeDtypeStruct) else x, target)
        with ocp.PyTreeCheckpointer() as ckptr, explain_read_errors(self.tree_dir.parent):
            return ckptr.restore(self.tree_dir, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))


# Leaves that tell one model's weights from another's with the same config: the norm scales, trained (or drawn)
# per model and only a hidden size long, so comparing them costs nothing at any model size.
FINGERPRINT = (("final_norm",), ("layers", 0, "input_norm"), ("layers", 0, "post_norm"))
# Relative to the leaf's largest value: one side rounded to bf16 (2^-8) passes, another model's scales do not.
FINGERPRINT_TOLERANCE = 1e-2


def check_same_weights(ling: LingFromOrbax, hf_dir, dtype) -> None:
    """`ling` (an orbax checkpoint) must hold the HF checkpoint's weights, not another model's of the same config:
    the FINGERPRINT leaves of both compared; a CheckpointError names the first that differs."""
    from conversion import hf
    from conversion.load import CheckpointError

    ours, theirs = ling.leaves(FINGERPRINT), LingFromHF(hf_dir, dtype).leaves(FINGERPRINT)
    for path in FINGERPRINT:
        a, b = (np.asarray(x, np.float32) for x in (ours[path], theirs[path]))
        scale = max(float(np.abs(b).max()), 1e-30)
        if float(np.abs(a - b).max()) > FINGERPRINT_TOLERANCE * scale:
            raise CheckpointError(
                f"--checkpoint {ling.path} holds other weights than --hf-dir {hf_dir}: their configs agree but "
                f"{hf.path_str(path)} differs (max |difference| {float(np.abs(a - b).max()):.3g} against values up "
                f"to {scale:.3g}), so it was converted from another checkpoint: pass the orbax checkpoint "
                f"`ling-jax convert --hf-dir {hf_dir}` wrote, or omit --checkpoint to read --hf-dir on both sides")


# transformers' `_keep_in_fp32_modules_strict`: these stay float32 in a bf16 model.
_KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log")


class TorchFromHF:
    """transformers' modules, one at a time, filled from the safetensors: a `BailingHybridDecoderLayer` built on the
    meta device (no init, no whole model) and given the layer's tensors under transformers' own names, FP8 blocks
    dequantised to float (conversion/fp8_blocks.dequantize). `cfg` (ling-jax's, validated against the tensors)
    decides the layer schedule, so both sides build the same kinds."""

    def __init__(self, hf_dir, cfg, device: str):
        import torch

        from conversion.load import CheckpointError, plan_hf
        from ling_jax.config import HF_FFN_NAMES, HF_MIXER_NAMES, MOE

        self.mod = import_reference_model()
        self.hf_dir = Path(hf_dir)
        self.catalog = plan_hf(hf_dir, with_mtp=False, stacklevel=4).catalog
        config = self.mod.BailingHybridConfig.from_dict(
            hf_config_dict(json.loads((self.hf_dir / "config.json").read_text())))
        config.layer_types = [HF_MIXER_NAMES[cfg.mixer_kind(i)] for i in range(cfg.num_layers)]
        config.mlp_layer_types = [HF_FFN_NAMES[cfg.ffn_kind(i)] for i in range(cfg.num_layers)]
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        # transformers sizes the shared expert moe_intermediate_size x num_shared_experts and ignores
        # moe_shared_expert_intermediate_size; Ling's releases have the two equal.
        theirs = config.moe_intermediate_size * max(getattr(config, "num_shared_experts", 1) or 1, 1)
        if any(k == MOE for _, k in cfg.layer_kinds) and theirs != cfg.shared_expert_intermediate_size:
            raise CheckpointError(
                f"{hf_dir}: the shared expert is {cfg.shared_expert_intermediate_size} wide but transformers builds "
                f"it moe_intermediate_size x num_shared_experts = {theirs} wide (it ignores "
                "moe_shared_expert_intermediate_size), so transformers cannot run this checkpoint; cross-check a "
                "checkpoint whose shared expert is moe_intermediate_size wide")
        self.config, self.device = config, torch.device(device)
        self.rotary = self.mod.BailingHybridRotaryEmbedding(config).to(self.device)

    def array(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A checkpoint tensor (its rows `rows`) as stored, an F8_E4M3 one dequantised to float32."""
        import ml_dtypes

        from conversion import fp8_blocks

        dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                  "F8_E4M3": fp8_blocks.FP8_NP}
        info = self.catalog[name]
        x = fp8_blocks.read_raw(self.hf_dir / info.file, name, info.shape, np.dtype(dtypes[info.dtype]),
                                () if rows is None else (rows,))
        if info.dtype == "F8_E4M3":
            scale = fp8_blocks.scale_name(name)
            s = self.catalog[scale]
            x = fp8_blocks.dequantize(x, fp8_blocks.read_raw(self.hf_dir / s.file, scale, s.shape, np.dtype(np.float32)))
        return x

    def tensor(self, name: str, dtype, rows: slice | None = None):
        import ml_dtypes
        import torch

        x = self.array(name, rows)
        with warnings.catch_warnings():  # read-only buffers from the file: the tensor is only read (copied from)
            warnings.simplefilter("ignore", UserWarning)
            t = (torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
                 if x.dtype == ml_dtypes.bfloat16 else torch.from_numpy(np.ascontiguousarray(x)))
        return t.to(self.device, dtype)

    def layer(self, i: int, dtype):
        """Decoder layer i with its checkpoint weights in `dtype` (the fp32 modules transformers keeps, float32)."""
        import torch

        from conversion.fp8_blocks import SCALE_SUFFIX

        with torch.device("meta"):
            module = self.mod.BailingHybridDecoderLayer(self.config, i)
        state = {k: torch.empty(v.shape, dtype=torch.float32 if any(n in k for n in _KEEP_FP32) else dtype,
                                device=self.device) for k, v in module.state_dict().items()}
        filled = set()
        prefix = f"model.layers.{i}."
        for name in self.catalog:
            if not name.startswith(prefix) or name.endswith(SCALE_SUFFIX):
                continue
            key, index = _module_key(name[len(prefix):], state)
            dst = state[key][index]
            src = self.tensor(name, dst.dtype)
            if src.numel() != dst.numel():
                raise ValueError(f"{name}: the checkpoint holds {tuple(src.shape)} where transformers' layer {i} "
                                 f"takes {tuple(dst.shape)} ({key}); its config.json describes other sizes")
            dst.copy_(src.reshape(dst.shape))
            filled.add(key)
        if filled != set(state):
            raise ValueError(f"layer {i}: the checkpoint fills none of transformers' {sorted(set(state) - filled)}; "
                             "the checkpoint and its config.json describe different layers")
        module.load_state_dict(state, assign=True, strict=True)
        return module.eval()

    def cast(self, module, dtype):
        """`module` with its weights in `dtype`, keeping transformers' fp32 modules in float32."""
        state = {k: v if any(n in k for n in _KEEP_FP32) else v.to(dtype) for k, v in module.state_dict().items()}
        import torch

        with torch.device("meta"):
            low = type(module)(self.config, module.self_attn.layer_idx)
        low.load_state_dict(state, assign=True, strict=True)
        return low.eval()

    def embed(self, ids: np.ndarray, dtype):
        """The embedding rows of ids [B, T], read row by row (the table is never loaded whole)."""
        import torch

        name = "model.word_embeddings.weight"
        rows = [self.tensor(name, dtype, slice(int(t), int(t) + 1))[0] for t in ids.reshape(-1)]
        return torch.stack(rows).reshape(*ids.shape, -1)

    def logits(self, h):
        """Final norm and lm_head on h [B, T, D] -> float32 logits, in h's dtype as transformers computes them."""
        import torch

        with torch.device("meta"):
            norm = self.mod.BailingHybridRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict({"weight": self.tensor("model.norm.weight", h.dtype)}, assign=True)
        with torch.no_grad():
            return torch.nn.functional.linear(norm(h), self.tensor("lm_head.weight", h.dtype)).float()


def _module_key(rest: str, state: dict) -> tuple[str, tuple]:
    """The transformers state-dict key of a layer's official tensor name (after `model.layers.{l}.`), and the
    index of its part where transformers packs several (conversion_mapping's renames for bailing_hybrid)."""
    parts = rest.split(".")
    if parts[0] == "attention":
        name = ".".join(parts[1:])
        conv = {"q_conv1d.weight": 0, "k_conv1d.weight": 1, "v_conv1d.weight": 2}
        if name in conv:
            n = state["self_attn.conv1d.weight"].shape[0] // 3
            return "self_attn.conv1d.weight", (slice(conv[name] * n, (conv[name] + 1) * n),)
        if name in ("f_proj.weight", "dt_bias", "A_log"):
            return f"self_attn.forget_gate.{name}", ()
        if name == "dense.weight":
            return "self_attn.o_proj.weight", ()
        return f"self_attn.{name}", ()
    if rest == "mlp.gate.expert_bias":
        return "mlp.gate.e_score_correction_bias", ()
    if parts[:2] == ["mlp", "experts"]:
        e, which = int(parts[2]), parts[3]
        if which == "down_proj":
            return "mlp.experts.down_proj", (e,)
        n = state["mlp.experts.gate_up_proj"].shape[1] // 2
        return "mlp.experts.gate_up_proj", (e, slice(0, n) if which == "gate_proj" else slice(n, 2 * n))
    return rest, ()


@dataclasses.dataclass
class _TorchChain:
    """One transformers run streamed through the layers: its dtype, cache and the step's hidden state and inputs."""
    dtype: Any
    cache: Any
    h: Any = None
    pos: Any = None
    masks: dict | None = None
    pe: Any = None


def _torch_begin(side: TorchFromHF, chain: _TorchChain, ids: np.ndarray, start: int) -> None:
    """Embed ids [B, T] at positions start.. and build the step's masks and rotary tables, as the model does."""
    import torch
    from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask

    chain.h = side.embed(ids, chain.dtype)
    chain.pos = (torch.arange(ids.shape[1], device=side.device) + start)[None]
    kw = dict(config=side.config, inputs_embeds=chain.h, attention_mask=None, cache=chain.cache,
              position_ids=chain.pos)
    chain.masks = {"full_attention": create_causal_mask(**kw), "linear_attention": create_recurrent_attention_mask(**kw)}
    chain.pe = side.rotary(chain.h, chain.pos)


def _torch_layer(module, chain: _TorchChain, layer_type: str, *, capture: bool) -> dict:
    """Run one decoder layer on the chain's hidden state; with `capture`, its post-mixer state and expert ids."""
    import torch

    taken: dict = {}
    handles = []
    if capture:
        handles.append(module.post_attention_layernorm.register_forward_pre_hook(
            lambda m, args: taken.__setitem__("mixer", args[0].detach())))
        if hasattr(module.mlp, "gate"):
            handles.append(module.mlp.gate.register_forward_hook(
                lambda m, args, out: taken.__setitem__("ids", out[2].detach())))
    try:
        with torch.no_grad():
            chain.h = module(chain.h, attention_mask=chain.masks[layer_type], position_ids=chain.pos,
                             cache=chain.cache, use_cache=True, position_embeddings=chain.pe)
    finally:
        for handle in handles:
            handle.remove()
    if not capture:
        return {}
    taken["ffn"] = chain.h
    return {k: v.float().cpu().numpy() if k != "ids" else v.cpu().numpy() for k, v in taken.items()}


def _ling_layer(p, h, entry, start: int, cfg, i: int, *, mode: str, backend: str, capture: bool):
    """One ling-jax block, as `model.forward` runs it -> (h, entry, captured post-mixer state and expert ids)."""
    import jax.numpy as jnp

    from ling_jax import model

    mixer, ffn = cfg.layer_kinds[i]
    start = jnp.asarray(start, jnp.int32)
    if not capture:
        out, entry = model.block(p, h, entry, start, cfg, i, mixer=mixer, ffn=ffn, mode=mode, backend=backend)
        return out, entry, {}
    taps: dict = {}
    with _tapped_model(taps):
        out, entry = model.block(p, h, entry, start, cfg, i, mixer=mixer, ffn=ffn, mode=mode, backend=backend)
    taken = {"mixer": np.asarray((h + taps[i]["mixer"]).astype(jnp.float32)), "ffn": np.asarray(out.astype(jnp.float32))}
    if "ids" in taps[i]:
        taken["ids"] = np.asarray(taps[i]["ids"])
    return out, entry, taken


def _ling_logits(ling, h, cfg):
    import jax.numpy as jnp

    from ling_jax.layers.linear import proj
    from ling_jax.layers.norms import rms_norm

    hidden = rms_norm(h, ling.part("final_norm"), cfg.rms_norm_eps)
    return np.asarray(proj("btd,dv->btv", hidden, ling.part("lm_head")).astype(jnp.float32))


def expert_agreement(ids_a: np.ndarray, ids_b: np.ndarray) -> float:
    """The fraction of tokens (rows of [N, top_k]) whose expert sets are equal."""
    return float((np.sort(ids_a, axis=1) == np.sort(ids_b, axis=1)).all(axis=1).mean())


def unexplained_flips(ours: np.ndarray, ref: np.ndarray, tolerance: float) -> list[int]:
    """Rows of [N, V] logits whose argmax differs and where the reference's gap between its choice and ours is
    wider than an error within `tolerance` could close: ||ours - ref|| <= tolerance ||ref|| bounds every entry's
    error by tolerance ||ref||, so a flip needs gap <= 2 tolerance ||ref||."""
    a, b = ours.argmax(-1), ref.argmax(-1)
    rows = np.arange(len(ref))
    gap = ref[rows, b] - ref[rows, a]
    bound = 2 * tolerance * np.linalg.norm(ref.astype(np.float64), axis=-1)
    return [int(r) for r in np.nonzero((a != b) & (gap > bound))[0]]


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of a streamed cross-check. `errors` / `tolerances`: relative L2 error of ling-jax's hidden state
    after the mixer and after the FFN against the reference's; `experts`: the fraction of tokens whose routed
    expert set agrees (MoE layers), held to at least `experts_min`; `spread`: transformers' own bf16 run against its
    float32 one (bfloat16 checks), which sets the tolerances."""

    layer: int
    kind: str
    errors: dict
    tolerances: dict
    experts: float | None = None
    experts_min: float | None = None
    spread: dict | None = None

    @property
    def failures(self) -> list[str]:
        bad = [q for q in STREAM_QUANTITIES if not self.errors[q] <= self.tolerances[q]]
        if self.experts is not None and self.experts < self.experts_min:
            bad.append("experts")
        return bad

    def as_dict(self) -> dict:
        return dict(layer=self.layer, kind=self.kind, **{q: self.errors[q] for q in STREAM_QUANTITIES},
                    **{f"{q}_tolerance": self.tolerances[q] for q in STREAM_QUANTITIES}, experts=self.experts,
                    experts_min=self.experts_min, spread=self.spread, ok=not self.failures)


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One decode step, both sides fed the reference's greedy token so far: the logits' relative error and the two
    argmaxes; a differing argmax passes only where the reference's gap is within what the tolerance allows."""

    step: int
    error: float
    tolerance: float
    token: int  # ling-jax's argmax
    ref_token: int
    near_tie: bool

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance and (self.token == self.ref_token or self.near_tie)


@dataclasses.dataclass(frozen=True)
class StreamReport:
    dtype: str
    layers: tuple[int, int]  # the checked window [a, b)
    rows: tuple[LayerRow, ...]
    logits_error: float
    logits_tolerance: float
    top1: float  # fraction of prompt positions whose argmax agrees
    top5: float  # ... whose top-5 sets agree
    top1_unexplained: tuple[int, ...]  # positions whose argmax differs beyond a near-tie
    decode: tuple[DecodeStep, ...]
    notes: tuple[str, ...] = ()

    @property
    def greedy_agreement(self) -> float | None:
        return float(np.mean([s.token == s.ref_token for s in self.decode])) if self.decode else None

    @property
    def first_failure(self) -> str | None:
        """The first check over its tolerance, in the order the model computes them: later ones inherit it."""
        for row in self.rows:
            if row.failures:
                q = row.failures[0]
                what = (f"experts agreement {row.experts:.3f} < {row.experts_min:.3f}" if q == "experts" else
                        f"{q} {row.errors[q]:.3e} > {row.tolerances[q]:.1e}")
                return f"layer {row.layer} ({row.kind}) {what}"
        if not self.logits_error <= self.logits_tolerance:
            return f"logits {self.logits_error:.3e} > {self.logits_tolerance:.1e}"
        if self.top1_unexplained:
            return f"top-1 differs beyond a near-tie at prompt positions {list(self.top1_unexplained[:8])}"
        bad = next((s for s in self.decode if not s.ok), None)
        if bad is not None:
            return (f"decode step {bad.step}: logits {bad.error:.3e} > {bad.tolerance:.1e}" if bad.error > bad.tolerance
                    else f"decode step {bad.step}: token {bad.token} where the reference has {bad.ref_token}")
        return None

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def as_dict(self) -> dict:
        return dict(dtype=self.dtype, layers=list(self.layers), rows=[r.as_dict() for r in self.rows],
                    logits=dict(error=self.logits_error, tolerance=self.logits_tolerance, top1=self.top1,
                                top5=self.top5, top1_unexplained=list(self.top1_unexplained)),
                    decode=dict(steps=len(self.decode), greedy_agreement=self.greedy_agreement,
                                max_error=max((s.error for s in self.decode), default=None),
                                rows=[dataclasses.asdict(s) | {"ok": s.ok} for s in self.decode]),
                    notes=list(self.notes), ok=self.ok, first_failure=self.first_failure)

    def format(self) -> str:
        head = f"{'layer':>5} {'kind':<10} {'mixer':>10} {'ffn':>10} {'tolerance':>9} {'experts':>8}  verdict"
        lines = list(self.notes) + [head]
        for r in self.rows:
            tol = max(r.tolerances.values())
            experts = "" if r.experts is None else f"{r.experts:.3f}"
            verdict = "ok" if not r.failures else "OVER: " + ", ".join(r.failures)
            lines.append(f"{r.layer:>5} {r.kind:<10} {r.errors['mixer']:>10.3e} {r.errors['ffn']:>10.3e} "
                         f"{tol:>9.1e} {experts:>8}  {verdict}")
        lines.append(f"logits {self.logits_error:.3e} (tolerance {self.logits_tolerance:.1e}); top-1 agreement "
                     f"{self.top1:.3f}, top-5 {self.top5:.3f}; top-1 beyond a near-tie: {len(self.top1_unexplained)}")
        if self.decode:
            agree = sum(s.token == s.ref_token for s in self.decode)
            lines.append(f"decode: greedy agreement {agree}/{len(self.decode)} steps, max logits error "
                         f"{max(s.error for s in self.decode):.3e} (tolerance {self.decode[0].tolerance:.1e})")
        first = self.first_failure
        lines.append("every check within tolerance" if first is None else f"first over tolerance: {first}")
        return "\n".join(lines)


def stream(ling, torch_side: TorchFromHF, prompt: list[int], cfg, *, dtype: str = "float32",
           layers: tuple[int, int] | None = None, decode_steps: int = 32, backend: str = "reference",
           log=lambda message: None) -> StreamReport:
    """Cross-check ling-jax (`ling`: LingFromHF or LingFromOrbax) against transformers layer by layer.

    Args:
      cfg: ling-jax's config of `ling`, its apply_swiglu_clamps what transformers does
        (`reference_applies_swiglu_clamps`).
      dtype: "float32": both sides compute in float32 and every layer's error must be within F32_TOLERANCE, expert
        sets equal. "bfloat16": ling-jax in bf16 against transformers in float32, each error within
        BF16_SPREAD_MULTIPLE times transformers' own bf16 run's error at the same place.
      layers: the window (a, b) checked; layers before a run on both sides (each side's own hidden state enters
        layer a), layers from b on are not run, and the logits are the final norm and lm_head on layer b-1's output.
      decode_steps: greedy decode steps after the prefill, both sides fed the reference's greedy tokens through their
        own caches; every step streams every layer again.
      log: called with one line per layer as it finishes.
    """
    import jax.numpy as jnp
    import torch
    from transformers import DynamicCache

    from ling_jax import cache as caches
    from ling_jax.config import KDA
    from ling_jax.model import embed_lookup

    a, b = layers or (0, cfg.num_layers)
    low = dtype == "bfloat16"
    jdt = jnp.bfloat16 if low else jnp.float32
    ref = _TorchChain(torch.float32, DynamicCache(config=torch_side.config))
    ref_low = _TorchChain(torch.bfloat16, DynamicCache(config=torch_side.config)) if low else None
    ids = np.asarray([prompt])
    T, max_len = len(prompt), len(prompt) + decode_steps
    kinds = [torch_side.config.layer_types[i] for i in range(cfg.num_layers)]

    h = embed_lookup(ling.part("embed"), jnp.asarray(ids))
    _release_memory()
    for chain in (ref, ref_low):
        if chain is not None:
            _torch_begin(torch_side, chain, ids, 0)
    entries, rows = [], []
    for i in range(b):
        capture = i >= a
        entry = (caches.kda_cache(cfg, 1, jdt) if cfg.mixer_kind(i) == KDA else caches.mla_cache(cfg, 1, max_len, jdt))
        h, entry, ours = _ling_layer(ling.part(i), h, entry, 0, cfg, i, mode="prefill", backend=backend,
                                     capture=capture)
        entries.append(entry)
        module = torch_side.layer(i, torch.float32)
        theirs = _torch_layer(module, ref, kinds[i], capture=capture)
        spread = None
        if low:
            module = torch_side.cast(module, torch.bfloat16)
            theirs_low = _torch_layer(module, ref_low, kinds[i], capture=capture)
        del module
        _release_memory()
        if capture:
            rows.append(_layer_row(i, cfg, ours, theirs, theirs_low if low else None, T))
            log(_row_line(rows[-1]))

    _release_memory(collect=True)
    logits = _ling_logits(ling, h, cfg)[0]
    ref_logits = torch_side.logits(ref.h).cpu().numpy()[0]
    tolerance = F32_TOLERANCE
    if low:
        tolerance = BF16_SPREAD_MULTIPLE * rel_err(torch_side.logits(ref_low.h).cpu().numpy()[0], ref_logits)
        ref_low = None  # the bf16 reference sets the tolerances; the decode steps need only the float32 one
    _release_memory()
    top5 = np.sort(np.argsort(-logits, -1)[:, :5], -1) == np.sort(np.argsort(-ref_logits, -1)[:, :5], -1)
    report = dict(logits_error=rel_err(logits, ref_logits), logits_tolerance=tolerance,
                  top1=float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()), top5=float(top5.all(-1).mean()),
                  top1_unexplained=tuple(unexplained_flips(logits, ref_logits, tolerance)))

    steps = []
    token = int(ref_logits[-1].argmax())
    for step in range(decode_steps):
        start = T + step
        h = embed_lookup(ling.part("embed"), jnp.asarray([[token]]))
        _torch_begin(torch_side, ref, np.asarray([[token]]), start)
        for i in range(b):
            h, entries[i], _ = _ling_layer(ling.part(i), h, entries[i], start, cfg, i, mode="decode",
                                           backend=backend, capture=False)
            module = torch_side.layer(i, torch.float32)
            _torch_layer(module, ref, kinds[i], capture=False)
            del module
            _release_memory()
        ours, theirs = _ling_logits(ling, h, cfg)[0, -1], torch_side.logits(ref.h).cpu().numpy()[0, -1]
        steps.append(DecodeStep(step, rel_err(ours, theirs), tolerance, int(ours.argmax()), int(theirs.argmax()),
                                not unexplained_flips(ours[None], theirs[None], tolerance)))
        log(f"decode step {step}: logits {steps[-1].error:.3e}, token {steps[-1].token} "
            f"(reference {steps[-1].ref_token})")
        token = steps[-1].ref_token
    notes = tuple(_notes(cfg, dtype))
    return StreamReport(dtype, (a, b), tuple(rows), decode=tuple(steps), notes=notes, **report)


def _layer_row(i: int, cfg, ours: dict, theirs: dict, theirs_low: dict | None, n_tokens: int) -> LayerRow:
    mixer, ffn = cfg.layer_kinds[i]
    errors = {q: rel_err(ours[q], theirs[q]) for q in STREAM_QUANTITIES}
    experts = expert_agreement(ours["ids"], theirs["ids"]) if "ids" in theirs and "ids" in ours else None
    if theirs_low is None:
        return LayerRow(i, f"{mixer}+{ffn}", errors, {q: F32_TOLERANCE for q in STREAM_QUANTITIES}, experts,
                        None if experts is None else 1.0)
    spread = {q: rel_err(theirs_low[q], theirs[q]) for q in STREAM_QUANTITIES}
    experts_min = None
    if experts is not None:
        spread["experts"] = expert_agreement(theirs_low["ids"], theirs["ids"])
        # At least one token may flip: a selection on a near-tie flips under any rounding.
        experts_min = max(0.0, 1.0 - max(BF16_SPREAD_MULTIPLE * (1.0 - spread["experts"]), 1.0 / n_tokens))
    return LayerRow(i, f"{mixer}+{ffn}", errors, {q: BF16_SPREAD_MULTIPLE * spread[q] for q in STREAM_QUANTITIES},
                    experts, experts_min, spread)


def _row_line(row: LayerRow) -> str:
    experts = "" if row.experts is None else f", experts {row.experts:.3f}"
    return (f"layer {row.layer} {row.kind}: mixer {row.errors['mixer']:.3e}, ffn {row.errors['ffn']:.3e}{experts}"
            + ("" if not row.failures else "  OVER: " + ", ".join(row.failures)))


def _notes(cfg, dtype: str) -> list[str]:
    notes = []
    if dtype == "bfloat16":
        notes.append(f"bfloat16: ling-jax bf16 against transformers float32; each tolerance is "
                     f"{BF16_SPREAD_MULTIPLE:g}x transformers' own bf16 error there")
    if any(cfg.expert_swiglu_limits) or any(cfg.shared_swiglu_limits):
        notes.append("the config's SwiGLU clamps are on on both sides" if cfg.apply_swiglu_clamps else
                     "the config's SwiGLU clamps are off on both sides (this transformers ignores them)")
    return notes
