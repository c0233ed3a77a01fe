"""The official Ling-3 safetensors layout (docs/model.md §4, §5) and how each tensor becomes a ling-jax param.

One table, `TABLE`, maps every official name to a params path and a transform. Names are templates: `{e}` is
the expert index, and layer-level names sit under `model.layers.{l}.`. Each rule has a scope saying which layers
it applies to (KDA or MLA mixer, dense or MoE ffn, the MTP layer), and it applies only where its params path is
declared by `ling_jax.params.param_specs` (so `q_proj` + `g_proj` -> w_qg vs `q_a_proj`/`q_b_proj` and `g_proj` ->
w_gate follows `q_lora_rank`). A rule names one official tensor, or several that one fused params leaf packs (KDA's
w_in and conv_qkv, MLA's w_qg; ling_jax/params.py). Each tensor may have aliases (canonical name first):
`mlp.gate.e_score_correction_bias`, and KDA `attention.dense.weight`, which transformers' `save_pretrained` writes
instead of the official `attention.o_proj.weight`. The templates also compile to regexes that explain an unexpected
name (`explain_unexpected`).

`plan(cfg)` expands the table into one `Entry` per official tensor group, in params order, and checks that the
entries cover every leaf of `param_specs(cfg)` exactly once with the shapes declared there, and that no official
name feeds two leaves. Loading (`conversion.load`) and synthetic writing (`conversion.synthetic`) both walk that
plan, one source tensor at a time, in opposite directions: `Entry.source_to_params` (official array -> params
arrays, or the slice of the stacked or fused leaf it fills) and `Entry.source_to_hf` (the inverse).

Transforms (official torch layout is [out, in]; ling-jax stores float projections [in, out] with heads split out,
block-FP8 ones [out, in] with heads split out (`fp8.ROWS`), and the MoE router and every expert matrix [out, in]):
    IDENTITY  norms, A_log, embed [V, D], router [E, D], expert_bias, routed and shared expert gate/up/down (already
              [out, in])
    LINEAR    [prod(out), prod(in)] -> [*in, *out]: the first `n_in` param axes are inputs
              (w_q_b [Rq, H, Dqk] <- [H*Dqk, Rq]; w_o [H, Dv, D] <- [D, H*Dv]; lm_head [D, V] <- [V, D])
    CONV      [H*K, 1, W] -> [W, H, K]
    SPLIT_HEADS  dt_bias [H*K] -> [H, K]
    KV_B      kv_b_proj [H*(Dn+Dv), R] (rows head-major, [k_nope | v] per head) -> w_k_b [R, H, Dn], w_v_b [R, H, Dv]
    Fused     several tensors -> one leaf, each through its part's transform, packed per head:
              KDA_IN   q k v f g [H*K, D], b [H, D] (LINEAR each) -> w_in [D, H, 5K+1], concatenated on the last axis
              MLA_QG   q [H*Dqk, D], gate g [H, D] (LINEAR each) -> w_qg [D, H, Dqk+1], concatenated on the last axis
              CONV_QKV q k v [H*K, 1, W] (CONV each) -> conv_qkv [W, 3, H, K], stacked on axis 1
A block-FP8 projection's entry takes each rule's ROWS form (`rows_form`): LINEAR becomes ROWS_LINEAR, a reshape
[prod(out), prod(in)] -> [*out, *in] (w_o [D, H, Dv]); KV_B gives w_k_b [H, Dn, R], w_v_b [H, Dv, R]; the fused
leaves pack their parts on the last output axis (w_in [H, 5K+1, D], w_qg [H, Dqk+1, D]). Its scale
[ceil(out/128), ceil(in/128)] is repeated over each block's 128 output rows and then moved as the weight is.
Experts: `mlp.experts.{e}.*` for e = 0..E-1 are transformed one by one and stacked on a leading [E] axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ling_jax.config import DENSE, KDA, MLA, MOE, LingConfig
from ling_jax.params import ParamSpec, is_fp8, is_leaf_spec, kda_in_parts, mla_qg_parts, param_specs, weight_spec
from pallas_kernels.common.fp8 import BLOCK, OUT_IN, ROWS, scale_shape

Path = tuple[Any, ...]  # a params path, e.g. ("layers", 3, "mixer", "w_in")
Shape = tuple[int, ...]


class Transform:
    """Official arrays <-> params arrays for one rule. Shapes are the params shapes (one expert's for stacks, one
    piece's for a part of a `Fused` leaf)."""

    def hf_shape(self, shapes: Sequence[Shape]) -> Shape:
        raise NotImplementedError

    def to_params(self, x: np.ndarray, shapes: Sequence[Shape]) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def to_hf(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Identity(Transform):
    def hf_shape(self, shapes):
        return tuple(shapes[0])

    def to_params(self, x, shapes):
        return (x.reshape(shapes[0]),)

    def to_hf(self, xs):
        return xs[0]


@dataclasses.dataclass(frozen=True)
class Linear(Transform):
    """torch nn.Linear weight [out, in] -> [*in, *out]; the first `n_in` params axes are the input."""
    n_in: int = 1

    def hf_shape(self, shapes):
        s = shapes[0]
        return (math.prod(s[self.n_in:]), math.prod(s[:self.n_in]))

    def to_params(self, x, shapes):
        return (x.T.reshape(shapes[0]),)

    def to_hf(self, xs):
        s = xs[0].shape
        return xs[0].reshape(math.prod(s[:self.n_in]), math.prod(s[self.n_in:])).T


@dataclasses.dataclass(frozen=True)
class RowsLinear(Transform):
    """torch nn.Linear weight [out, in] -> [*out, *in] (a block-FP8 projection, `fp8.ROWS`); the last `n_in`
    params axes are the input. A reshape: each output row stays contiguous."""
    n_in: int = 1

    def hf_shape(self, shapes):
        s = shapes[0]
        return (math.prod(s[:len(s) - self.n_in]), math.prod(s[len(s) - self.n_in:]))

    def to_params(self, x, shapes):
        return (x.reshape(shapes[0]),)

    def to_hf(self, xs):
        return xs[0].reshape(self.hf_shape([xs[0].shape]))


@dataclasses.dataclass(frozen=True)
class Conv(Transform):
    """Depthwise conv1d weight [H*K, 1, W] -> [W, H, K] (tap W-1 multiplies the current token)."""

    def hf_shape(self, shapes):
        w, h, k = shapes[0]
        return (h * k, 1, w)

    def to_params(self, x, shapes):
        return (x[:, 0, :].T.reshape(shapes[0]),)

    def to_hf(self, xs):
        w = xs[0].shape[0]
        return xs[0].reshape(w, -1).T[:, None, :]


@dataclasses.dataclass(frozen=True)
class SplitHeads(Transform):
    """[H*K] -> [H, K]."""

    def hf_shape(self, shapes):
        return (math.prod(shapes[0]),)

    def to_params(self, x, shapes):
        return (x.reshape(shapes[0]),)

    def to_hf(self, xs):
        return xs[0].reshape(-1)


@dataclasses.dataclass(frozen=True)
class KvB(Transform):
    """kv_b_proj [H*(Dn+Dv), R], rows head-major with [k_nope | v] per head -> w_k_b [R, H, Dn], w_v_b [R, H, Dv]."""

    def hf_shape(self, shapes):
        (r, h, dn), (_, _, dv) = shapes
        return (h * (dn + dv), r)

    def to_params(self, x, shapes):
        (r, h, dn), _ = shapes
        z = x.reshape(h, -1, r)  # [H, Dn+Dv, R]
        return z[:, :dn].transpose(2, 0, 1), z[:, dn:].transpose(2, 0, 1)

    def to_hf(self, xs):
        k, v = xs  # [R, H, Dn], [R, H, Dv]
        z = np.concatenate([k.transpose(1, 2, 0), v.transpose(1, 2, 0)], axis=1)  # [H, Dn+Dv, R]
        return z.reshape(-1, z.shape[-1])


@dataclasses.dataclass(frozen=True)
class KvBRows(Transform):
    """kv_b_proj [H*(Dn+Dv), R] -> w_k_b [H, Dn, R], w_v_b [H, Dv, R] (block-FP8, `fp8.ROWS`): KV_B without the
    transpose."""

    def hf_shape(self, shapes):
        (h, dn, r), (_, dv, _) = shapes
        return (h * (dn + dv), r)

    def to_params(self, x, shapes):
        (h, dn, r), _ = shapes
        z = x.reshape(h, -1, r)  # [H, Dn+Dv, R]
        return z[:, :dn], z[:, dn:]

    def to_hf(self, xs):
        z = np.concatenate(xs, axis=1)  # [H, Dn+Dv, R]
        return z.reshape(-1, z.shape[-1])


IDENTITY, LINEAR, LINEAR_2IN, CONV, SPLIT_HEADS, KV_B = Identity(), Linear(1), Linear(2), Conv(), SplitHeads(), KvB()
KV_B_ROWS = KvBRows()


@dataclasses.dataclass(frozen=True)
class Fused:
    """Several official tensors -> one params leaf: tensor i becomes piece i through `parts[i]`, and the pieces are
    concatenated on axis `pack_axis` (negative: the last for [in, out], the one before the input axis for ROWS),
    `widths(cfg)` wide each (the per-head blocks of ling_jax.params), or, with `widths` None, stacked on
    `stack_axis`. Shapes are the pieces' params shapes (`Entry.pieces`)."""
    parts: tuple[Transform, ...]
    widths: Callable[[LingConfig], dict[str, int]] | None = None
    stack_axis: int = 1
    pack_axis: int = -1

    def piece_specs(self, spec: ParamSpec, cfg: LingConfig) -> tuple[ParamSpec, ...]:
        """The spec of each piece of the leaf `spec`: its dtype and init, the packed axis cut to the piece's."""
        if self.widths is None:
            a = self.stack_axis
            assert spec.shape[a] == len(self.parts), (spec, self)
            cut = lambda t: t[:a] + t[a + 1:]  # noqa: E731
            return (dataclasses.replace(spec, shape=cut(spec.shape), axes=cut(spec.axes)),) * len(self.parts)
        widths = tuple(self.widths(cfg).values())
        a = len(spec.shape) + self.pack_axis
        assert len(widths) == len(self.parts) and sum(widths) == spec.shape[a], (spec, widths)
        return tuple(dataclasses.replace(spec, shape=spec.shape[:a] + (w,) + spec.shape[a + 1:]) for w in widths)

    def slot(self, i: int, shapes: Sequence[Shape]) -> tuple:
        """The index of piece i in the leaf."""
        if self.widths is None:
            return (slice(None),) * self.stack_axis + (i,)
        start = sum(s[self.pack_axis] for s in shapes[:i])
        return (Ellipsis, slice(start, start + shapes[i][self.pack_axis])) + (slice(None),) * (-1 - self.pack_axis)

    def to_params(self, xs: Sequence[np.ndarray], shapes: Sequence[Shape]) -> np.ndarray:
        pieces = [t.to_params(x, [s])[0] for t, x, s in zip(self.parts, xs, shapes)]
        return np.stack(pieces, self.stack_axis) if self.widths is None else np.concatenate(pieces, self.pack_axis)

    def to_hf(self, x: np.ndarray, shapes: Sequence[Shape]) -> tuple[np.ndarray, ...]:
        return tuple(t.to_hf([x[self.slot(i, shapes)]]) for i, t in enumerate(self.parts))


KDA_IN = Fused((LINEAR,) * 6, kda_in_parts)  # w_in: q k v f g b
MLA_QG = Fused((LINEAR,) * 2, mla_qg_parts)  # w_qg: q, the head-wise gate
CONV_QKV = Fused((CONV,) * 3)  # conv_qkv: q k v taps


def rows_form(transform: Transform | Fused) -> Transform | Fused:
    """The transform of a rule whose leaf is a block-FP8 projection (`fp8.ROWS`, [*out, *in])."""
    if isinstance(transform, Linear):
        return RowsLinear(transform.n_in)
    if transform is KV_B:
        return KV_B_ROWS
    if isinstance(transform, Fused) and transform.widths is not None:
        assert all(part == LINEAR for part in transform.parts), transform  # one input axis, so -2 is the last out
        return dataclasses.replace(transform, parts=tuple(map(rows_form, transform.parts)), pack_axis=-2)
    raise ValueError(f"{transform} has no form for a {ROWS} leaf")

# Scopes: which names a layer carries. GLOBAL names are whole; the others sit under `model.layers.{l}.`.
GLOBAL, LAYER, MTP = "global", "layer", "mtp"  # LAYER: every decoder layer, the MTP layer included


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[tuple[str, ...], ...]  # per source tensor its accepted names, canonical first; `{e}` = expert index
    params: tuple[str, ...]  # dotted paths relative to the scope's params root
    transform: Transform | Fused
    scope: str  # GLOBAL | LAYER | MTP | KDA | MLA | DENSE | MOE

    def __post_init__(self):
        fused = isinstance(self.transform, Fused)
        assert len(self.hf) == (len(self.transform.parts) if fused else 1), self
        assert not fused or len(self.params) == 1, self


def _rule(hf: str | tuple[str, ...], params: str | tuple[str, ...], transform: Transform, scope: str) -> Rule:
    return Rule((_names(hf),), (params,) if isinstance(params, str) else params, transform, scope)


def _fused(hf: tuple[str | tuple[str, ...], ...], params: str, transform: Fused, scope: str) -> Rule:
    return Rule(tuple(_names(part) for part in hf), (params,), transform, scope)


def _names(hf: str | tuple[str, ...]) -> tuple[str, ...]:
    return (hf,) if isinstance(hf, str) else hf


TABLE: tuple[Rule, ...] = (
    _rule("model.word_embeddings.weight", "embed", IDENTITY, GLOBAL),  # [V, D] kept as is
    _rule("model.norm.weight", "final_norm", IDENTITY, GLOBAL),
    _rule("lm_head.weight", "lm_head", LINEAR, GLOBAL),  # [V, D] -> [D, V]

    _rule("input_layernorm.weight", "input_norm", IDENTITY, LAYER),
    _rule("post_attention_layernorm.weight", "post_norm", IDENTITY, LAYER),

    _fused(("attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight",
            "attention.f_proj.weight", "attention.g_proj.weight", "attention.b_proj.weight"),  # g: the output gate
           "mixer.w_in", KDA_IN, KDA),
    _fused(("attention.q_conv1d.weight", "attention.k_conv1d.weight", "attention.v_conv1d.weight"), "mixer.conv_qkv",
           CONV_QKV, KDA),
    _rule("attention.A_log", "mixer.A_log", IDENTITY, KDA),
    _rule("attention.dt_bias", "mixer.dt_bias", SPLIT_HEADS, KDA),
    _rule("attention.o_norm.weight", "mixer.o_norm", IDENTITY, KDA),
    # The official KDA name is o_proj; transformers' save_pretrained writes `dense` (its MLA name) for every layer.
    _rule(("attention.o_proj.weight", "attention.dense.weight"), "mixer.w_o", LINEAR_2IN, KDA),

    _fused(("attention.q_proj.weight", "attention.g_proj.weight"), "mixer.w_qg", MLA_QG, MLA),  # q_lora_rank null
    _rule("attention.q_a_proj.weight", "mixer.w_q_a", LINEAR, MLA),  # q_lora_rank set (Tiny)
    _rule("attention.q_a_layernorm.weight", "mixer.q_a_norm", IDENTITY, MLA),
    _rule("attention.q_b_proj.weight", "mixer.w_q_b", LINEAR, MLA),
    _rule("attention.kv_a_proj_with_mqa.weight", "mixer.w_kv_a", LINEAR, MLA),
    _rule("attention.kv_a_layernorm.weight", "mixer.kv_a_norm", IDENTITY, MLA),
    _rule("attention.kv_b_proj.weight", ("mixer.w_k_b", "mixer.w_v_b"), KV_B, MLA),
    _rule("attention.g_proj.weight", "mixer.w_gate", LINEAR, MLA),  # q_lora_rank set: head-wise gate [D, H]
    _rule("attention.dense.weight", "mixer.w_o", LINEAR_2IN, MLA),

    _rule("mlp.gate_proj.weight", "ffn.w_gate", LINEAR, DENSE),
    _rule("mlp.up_proj.weight", "ffn.w_up", LINEAR, DENSE),
    _rule("mlp.down_proj.weight", "ffn.w_down", LINEAR, DENSE),

    _rule("mlp.gate.weight", "ffn.router", IDENTITY, MOE),  # [E, D] kept as is (router GEMV streams row segments)
    _rule(("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"), "ffn.expert_bias", IDENTITY, MOE),
    # Expert matrices not LINEAR: ling-jax keeps them in torch's [out, in] (a batch-1 gate/up or down program streams
    # whole rows; ling_jax/params.py); each expert's tensor is taken as is, stacked on [E].
    _rule("mlp.experts.{e}.gate_proj.weight", "ffn.we_gate", IDENTITY, MOE),  # [Ie, D]
    _rule("mlp.experts.{e}.up_proj.weight", "ffn.we_up", IDENTITY, MOE),
    _rule("mlp.experts.{e}.down_proj.weight", "ffn.we_down", IDENTITY, MOE),  # [D, Ie]
    _rule("mlp.shared_experts.gate_proj.weight", "ffn.ws_gate", IDENTITY, MOE),  # [Is, D]
    _rule("mlp.shared_experts.up_proj.weight", "ffn.ws_up", IDENTITY, MOE),
    _rule("mlp.shared_experts.down_proj.weight", "ffn.ws_down", IDENTITY, MOE),  # [D, Is]

    _rule("enorm.weight", "enorm", IDENTITY, MTP),
    _rule("hnorm.weight", "hnorm", IDENTITY, MTP),
    _rule("eh_proj.weight", "eh_proj", LINEAR, MTP),  # [D, 2D] -> [2D, D]; input = [enorm(e) | hnorm(h)]
    _rule("final_layernorm.weight", "final_norm", IDENTITY, MTP),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One group of official tensors and the params leaves they become.

    `sources[i]` holds the accepted names of source tensor i (canonical first). A stacked entry (experts) has E
    sources, one per expert, and one params leaf whose leading axis is E. A fused entry has one source per part of
    its `Fused` transform and one params leaf that packs them; `pieces[i]` is the spec of source i's piece. In both,
    source i fills the leaf's slice `slot(i)`, so a loader reads and places one source tensor at a time.
    """
    sources: tuple[tuple[str, ...], ...]
    paths: tuple[Path, ...]
    specs: tuple[ParamSpec, ...]
    transform: Transform | Fused
    stacked: bool
    pieces: tuple[ParamSpec, ...] = ()
    # Block-FP8 leaves (cfg.quantization "fp8"): the leaf's layout and input axes, `specs` then being the values'
    # and `transform` the rule's form for that layout.
    fp8: tuple[str, int] | None = None

    @property
    def fused(self) -> bool:
        return isinstance(self.transform, Fused)

    def scale_specs(self, i: int) -> list[Shape]:
        """The params-layout scale shapes of source i's arrays (`source_specs(i)`)."""
        layout, n_in = self.fp8
        return [scale_shape(s.shape, layout, n_in) for s in self.source_specs(i)]

    def scale_to_params(self, i: int, scale_inv: np.ndarray) -> tuple[np.ndarray, ...]:
        """Source i's checkpoint scale [ceil(out/128), ceil(in/128)] -> its params-layout scales
        (pallas_kernels/common/fp8.py): a projection's (ROWS, or IN_OUT) repeats each block row over its 128 output
        rows, then moves the rows as the weight's transform moves them; OUT_IN keeps the blocks."""
        if self.fp8[0] != OUT_IN:
            scale_inv = np.repeat(scale_inv, BLOCK, axis=0)[:self.source_shape(i)[0]]
        return self._source_transform(i).to_params(scale_inv, self.scale_specs(i))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s[0] for s in self.sources)

    def source_specs(self, i: int) -> tuple[ParamSpec, ...]:
        """Specs of the params arrays source tensor i becomes: the leaves, one expert's slice when stacked, or its
        piece when fused."""
        if self.fused:
            return (self.pieces[i],)
        if self.stacked:
            return tuple(dataclasses.replace(s, shape=s.shape[1:], axes=s.axes[1:]) for s in self.specs)
        return self.specs

    def source_shape(self, i: int) -> Shape:
        """The official shape of source tensor i."""
        return self._source_transform(i).hf_shape(self._source_shapes(i))

    def slot(self, i: int) -> tuple:
        """The index of source i's slice in the one leaf of a stacked or fused entry."""
        if self.fused:
            return self.transform.slot(i, [p.shape for p in self.pieces])
        assert self.stacked, f"{self.names[0]} fills whole leaves"
        return (i,)

    def source_to_params(self, i: int, x: np.ndarray) -> tuple[np.ndarray, ...]:
        """Official tensor i -> its params arrays (`source_specs(i)`)."""
        return self._source_transform(i).to_params(x, self._source_shapes(i))

    def source_to_hf(self, i: int, xs: Sequence[np.ndarray]) -> np.ndarray:
        """The inverse of `source_to_params`."""
        return self._source_transform(i).to_hf(xs)

    def hf_tensor(self, leaves: Sequence[np.ndarray], i: int) -> np.ndarray:
        """Official tensor i from the entry's whole params leaves."""
        if self.stacked or self.fused:
            return self.source_to_hf(i, [leaves[0][self.slot(i)]])
        return self.source_to_hf(i, leaves)

    def _source_transform(self, i: int) -> Transform:
        return self.transform.parts[i] if self.fused else self.transform

    def _source_shapes(self, i: int) -> list[Shape]:
        return [s.shape for s in self.source_specs(i)]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def path_str(path: Path) -> str:
    return ".".join(str(p) for p in path)


def _lookup(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _applies(scope: str, mixer: str, ffn: str, is_mtp: bool) -> bool:
    return scope == LAYER or scope in (mixer, ffn) or (scope == MTP and is_mtp)


def plan(cfg: LingConfig, *, with_mtp: bool = True) -> list[Entry]:
    """Every official tensor of `cfg`'s checkpoint, grouped by the params leaves it feeds, in params order."""
    specs = param_specs(cfg, with_mtp=with_mtp)
    by_path: dict[Path, Entry] = {}

    def add(rule: Rule, prefix: str, root: Path, scope_specs: Any):
        declared = [_lookup(scope_specs, p) for p in rule.params]
        if any(s is None for s in declared):
            assert all(s is None for s in declared), rule  # a multi-output rule is all or nothing
            return
        leaf_specs = [weight_spec(s) for s in declared]
        assert len({is_fp8(s) for s in declared}) == 1, rule
        fp8 = (declared[0].layout, declared[0].n_in) if is_fp8(declared[0]) else None
        transform = rows_form(rule.transform) if fp8 and fp8[0] == ROWS else rule.transform
        stacked = "{e}" in rule.hf[0][0]
        if stacked:
            sources = tuple(tuple(prefix + n.format(e=e) for n in rule.hf[0]) for e in range(leaf_specs[0].shape[0]))
        else:
            sources = tuple(tuple(prefix + n for n in names) for names in rule.hf)
        pieces = transform.piece_specs(leaf_specs[0], cfg) if isinstance(transform, Fused) else ()
        paths = tuple(root + tuple(p.split(".")) for p in rule.params)
        entry = Entry(sources, paths, tuple(leaf_specs), transform, stacked, pieces, fp8)
        for p in paths:
            assert p not in by_path, f"two rules feed {path_str(p)}"
            by_path[p] = entry

    def add_layer(layer: int, root: Path, layer_specs: Any, mtp_specs: Any = None):
        is_mtp = layer >= cfg.num_layers
        mixer, ffn = (MLA, MOE) if is_mtp else (cfg.mixer_kind(layer), cfg.ffn_kind(layer))
        for rule in TABLE:
            if rule.scope == MTP and is_mtp:
                add(rule, layer_prefix(layer), ("mtp",), mtp_specs)
            elif rule.scope not in (GLOBAL, MTP) and _applies(rule.scope, mixer, ffn, is_mtp):
                add(rule, layer_prefix(layer), root, layer_specs)

    for rule in TABLE:
        if rule.scope == GLOBAL:
            add(rule, "", (), specs)
    for i, layer_specs in enumerate(specs["layers"]):
        add_layer(i, ("layers", i), layer_specs)
    if "mtp" in specs:
        add_layer(cfg.num_layers, ("mtp", "layer"), specs["mtp"]["layer"], specs["mtp"])

    # The table must cover param_specs exactly: every leaf once, with the declared shape.
    leaves = spec_paths(specs)
    missing = [path_str(p) for p in leaves if p not in by_path]
    assert not missing, f"no official name maps to params {missing}"
    for path, spec in leaves.items():
        entry = by_path[path]
        assert entry.specs[entry.paths.index(path)] == weight_spec(spec), path
    order = {p: i for i, p in enumerate(leaves)}
    entries = sorted({id(e): e for e in by_path.values()}.values(), key=lambda e: order[e.paths[0]])
    names = [n for e in entries for source in e.sources for n in source]
    assert len(names) == len(set(names)), "an official name feeds two params leaves"
    return entries


def spec_paths(specs: Any) -> dict[Path, Any]:
    """{params path: ParamSpec, or the Fp8Weight of a block-FP8 weight} in the canonical (jax.tree) leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_leaf_spec)
    return {tuple(_key(k) for k in kp): spec for kp, spec in flat}


def array_paths(specs: Any) -> dict[Path, ParamSpec]:
    """{path: ParamSpec} of every array leaf: an FP8 weight's values at path + ("q",), its scale at + ("scale",)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return {tuple(_key(k) for k in kp): spec for kp, spec in flat}


def _key(k: Any) -> Any:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    raise TypeError(f"unexpected params tree key {k!r}")


_TEMPLATE_RES = [(rule, re.compile(re.escape(name).replace(re.escape("{e}"), r"(\d+)") + "$"))
                 for rule in TABLE for names in rule.hf for name in names]


def explain_unexpected(name: str, cfg: LingConfig) -> str:
    """A short reason for a name the plan does not expect ('' when none is known)."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return ""
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.total_layers:
        return f"layer {layer} >= num_hidden_layers + num_nextn_predict_layers = {cfg.total_layers}"
    if layer >= cfg.num_layers:
        kinds = (MLA, MOE)
    else:
        kinds = (cfg.mixer_kind(layer), cfg.ffn_kind(layer))
    scopes = sorted({rule.scope for rule, rx in _TEMPLATE_RES if rule.scope != GLOBAL and rx.match(rest)})
    if scopes and not any(s in (LAYER, *kinds) or (s == MTP and layer >= cfg.num_layers) for s in scopes):
        return f"a {'/'.join(scopes)} name, but layer {layer} is {kinds[0]} + {kinds[1]}"
    if m2 := re.match(r"mlp\.experts\.(\d+)\.", rest):
        if int(m2.group(1)) >= cfg.num_experts:
            return f"expert {m2.group(1)} >= num_experts = {cfg.num_experts}"
    return ""


_MIXER_KINDS, _FFN_KINDS = frozenset((KDA, MLA)), frozenset((DENSE, MOE))


def held_kinds(names: Sequence[str], num_layers: int) -> dict[int, tuple[str | None, str | None]]:
    """{main layer: (mixer, ffn)} that the tensor names describe; None where they name no kind or both.

    Only names that one kind alone carries count (`attention.f_proj` is KDA, `attention.kv_b_proj` MLA,
    `mlp.gate` MoE, `mlp.gate_proj` dense); the names KDA and MLA share (`q_proj`, `g_proj`, `dense`) say nothing.
    """
    seen: dict[int, set[str]] = {}
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if not m or int(m.group(1)) >= num_layers:
            continue
        scopes = _scopes(re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.0.", m.group(2)))
        for kinds in (_MIXER_KINDS, _FFN_KINDS):
            if len(scopes & kinds) == 1:
                seen.setdefault(int(m.group(1)), set()).update(scopes & kinds)
    return {layer: (_single(kinds & _MIXER_KINDS), _single(kinds & _FFN_KINDS)) for layer, kinds in seen.items()}


@functools.lru_cache(maxsize=None)
def _scopes(rest: str) -> frozenset[str]:
    """The scopes of the rules naming `rest` (a name under `model.layers.{l}.`); cached, since a checkpoint repeats
    each expert name for every expert of every layer."""
    return frozenset(rule.scope for rule, rx in _TEMPLATE_RES if rx.match(rest))


def _single(kinds: set[str]) -> str | None:
    return next(iter(kinds)) if len(kinds) == 1 else None
