"""Per-layer agreement of two ways ling-jax computes the same positions (`ling-jax layercheck`).

Each comparison runs a side `a` against a baseline `b` from the same prefilled cache over the same T = k + 1 tokens
(the last committed token and k drafts, as a speculative step feeds them):

    verify-vs-decode  a: the verify forward over the T positions at once; b: T sequential one-token decode steps
    backends          a: one path (verify or decode) on a backend; b: the same path on the reference backend

After every layer each side's hidden state (the residual stream, every position) is taken and, for MoE layers, the
experts each position routes to and the router's input; then the final logits. Per layer the report gives
||a - b|| / ||b|| of the hidden state and whether each position's expert set agrees. Where one does not, it gives
the baseline's score gap at the selection boundary and the largest difference between the two sides' biased scores
at that position: a flip on a near-tie (a gap that difference can close) is told from a bug.

The values are the model's own: `model.forward` runs jitted with `model.block` and the MoE router wrapped, their
outputs handed out as extra outputs of the traced program and nothing else in it changed. The production decode and
verify programs are not touched. Each check traces afresh, so a patched block or router is what runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import numpy as np

from ling_jax.config import MOE
from ling_jax.crosscheck import rel_err

MODES = ("verify-vs-decode", "backends")
PATHS = ("verify", "decode")
# float32 activations: both sides compute the same math in another summation order (2e-7 to 9e-7 on the toy
# preset), far too little to flip a route, so each layer's hidden state is held to this and every expert set equal.
F32_BOUND = 1e-5
# The float64 scores recomputed here from each side's router input do not see the router's own fp32 rounding.
SCORE_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class Capture:
    """One side's values (numpy, batch 1): hidden[i] [T, D] after layer i; for MoE layers, ids[i] [T, top_k] and
    router_in[i] [T, D] (the router's normed input); logits [T, V]."""

    hidden: tuple[np.ndarray, ...]
    ids: dict
    router_in: dict
    logits: np.ndarray


# ---- capture ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tapped(taps: dict):
    """`model.block` and the MoE router wrapped so each layer's output, expert ids and router input land in
    taps[layer]; whatever those names hold on entry (a patched block, say) is what runs."""
    from ling_jax import model
    from pallas_kernels import moe as moe_ops

    run_block, run_route = model.block, moe_ops.route
    current: list = [None]

    def block(p, h, entry, start, cfg, layer, **kw):
        current[0] = taps[layer] = {}
        out, entry = run_block(p, h, entry, start, cfg, layer, **kw)
        taps[layer]["hidden"] = out
        return out, entry

    def route(*args, **kw):
        out = run_route(*args, **kw)  # (weights, ids, the normed x): the MoE always hands the router its norm
        current[0]["ids"], current[0]["router_in"] = out[1], out[2]
        return out

    with mock.patch.object(model, "block", block), mock.patch.object(moe_ops, "route", route):
        yield


def _traced(cfg, mode: str, backend: str):
    """`model.forward` with its layers tapped, freshly jitted: (params, tokens, layers, start) -> (logits, layers,
    taps)."""
    import jax

    from ling_jax import model

    def run(params, tokens, layers, start):
        taps: dict = {}
        with _tapped(taps):
            logits, _, layers = model.forward(params, tokens, layers, start, cfg, mode=mode, backend=backend)
        return logits, layers, taps

    return jax.jit(run)


def _host(x) -> np.ndarray:
    """float32 on the host, [B = 1, T, ...] or the router's [N = T, ...] as [T, ...]."""
    import jax.numpy as jnp

    x = np.asarray(x.astype(jnp.float32))
    return x[0] if x.ndim == 3 else x


def _capture(taps: dict, logits, cfg) -> Capture:
    if sorted(taps) != list(range(cfg.num_layers)):
        raise RuntimeError(f"captured layers {sorted(taps)} of {cfg.num_layers}: ling_jax.model.forward no longer "
                           "calls `block` once per layer; update layercheck._tapped to its new structure")
    # From the config, not from what the taps caught: a route the tap misses must not drop that layer's checks.
    moe = [i for i in range(cfg.num_layers) if cfg.ffn_kind(i) == MOE]
    untapped = [i for i in moe if "ids" not in taps[i]]
    if untapped:
        raise RuntimeError(f"MoE layers {untapped} routed without the tapped router: ling_jax.layers.moe no longer "
                           "calls pallas_kernels.moe.route; update layercheck._tapped to its new structure")
    return Capture(tuple(_host(taps[i]["hidden"]) for i in range(cfg.num_layers)),
                   {i: np.asarray(taps[i]["ids"]) for i in moe}, {i: _host(taps[i]["router_in"]) for i in moe},
                   _host(logits))


def capture_verify(params, cfg, state, tokens, backend: str) -> Capture:
    """The verify forward over tokens [1, T] from `state` (not donated)."""
    logits, _, taps = _traced(cfg, "verify", backend)(params, tokens, state.layers, state.length)
    return _capture(taps, logits, cfg)


def capture_decode(params, cfg, state, tokens, backend: str) -> Capture:
    """T one-token decode steps over tokens [1, T] from `state` (not donated), their values stacked by position."""
    run = _traced(cfg, "decode", backend)
    layers, steps = state.layers, []
    for t in range(tokens.shape[1]):
        logits, layers, taps = run(params, tokens[:, t:t + 1], layers, state.length + t)
        steps.append(_capture(taps, logits, cfg))
    cat = lambda xs: np.concatenate(xs, axis=0)  # noqa: E731
    first = steps[0]
    return Capture(tuple(cat([s.hidden[i] for s in steps]) for i in range(cfg.num_layers)),
                   {i: cat([s.ids[i] for s in steps]) for i in first.ids},
                   {i: cat([s.router_in[i] for s in steps]) for i in first.router_in}, cat([s.logits for s in steps]))


# ---- routing near-ties -------------------------------------------------------------------------------------------


def biased_scores(x: np.ndarray, router, bias) -> np.ndarray:
    """The router's selection scores sigmoid(x · routerᵀ) + bias [T, E], in float64 from its normed input x [T, D]."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    return 1.0 / (1.0 + np.exp(-logits)) + np.asarray(bias, np.float64)


def boundary_gap(choice: np.ndarray, cfg) -> np.ndarray:
    """Per position of biased scores [T, E], the smallest gap at the grouped top-k's selection boundary: between
    the kept and the first dropped group's score (the sum of its top-2), and between the top_k-th and the
    (top_k + 1)-th expert score within the kept groups; inf where neither stage drops anything."""
    n, e = choice.shape
    per = e // cfg.n_group
    groups = -np.sort(-choice.reshape(n, cfg.n_group, per), axis=-1)[..., :2].sum(-1)  # [T, G]
    gaps = []
    if cfg.topk_group < cfg.n_group:
        ranked = -np.sort(-groups, axis=-1)
        gaps.append(ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group])
    kept = np.zeros(groups.shape, bool)
    np.put_along_axis(kept, np.argsort(-groups, axis=-1, kind="stable")[:, :cfg.topk_group], True, axis=-1)
    if cfg.num_experts_per_tok < cfg.topk_group * per:
        masked = -np.sort(-np.where(np.repeat(kept, per, axis=1), choice, -np.inf), axis=-1)
        k = cfg.num_experts_per_tok
        gaps.append(masked[:, k - 1] - masked[:, k])
    return np.min(gaps, axis=0) if gaps else np.full(n, np.inf)


@dataclasses.dataclass(frozen=True)
class Flip:
    """A position whose expert set differs. `gap`: the baseline's boundary gap there; `score_difference`: the
    largest |a - b| of the two sides' biased scores there. A group score sums two expert scores, so either stage's
    gap closes only if it is at most 4x that difference: within it (plus the router's own rounding) the flip is a
    near-tie the router's input explains, and whether that input is right is the earlier layers' question; beyond
    it the same input routes differently, a bug in the routing itself."""

    position: int
    gap: float
    score_difference: float

    @property
    def explained(self) -> bool:
        return self.gap <= 4 * self.score_difference + SCORE_FLOOR

    def describe(self) -> str:
        why = "a near-tie that closes" if self.explained else "wider than that can close: the routing differs"
        return (f"position {self.position}: experts differ; baseline gap {self.gap:.2e}, scores apart by up to "
                f"{self.score_difference:.2e}: {why}")


# ---- report ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer: `error` ||a - b|| / ||b|| of the hidden state after it, held to `bound` (None: reported only);
    `experts_equal` per position (MoE layers), all required equal when `experts_required`."""

    layer: int
    kind: str
    error: float
    bound: float | None
    experts_equal: tuple[bool, ...] | None = None
    flips: tuple[Flip, ...] = ()
    experts_required: bool = False

    @property
    def failures(self) -> list[str]:
        bad = [] if self.bound is None or self.error <= self.bound else ["hidden"]
        if self.experts_required and self.flips:
            bad.append("experts")
        return bad

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return dict(layer=self.layer, kind=self.kind, hidden=self.error, bound=self.bound,
                    experts_equal=None if self.experts_equal is None else list(self.experts_equal),
                    flips=[dataclasses.asdict(f) | {"explained": f.explained} for f in self.flips], ok=self.ok)


@dataclasses.dataclass(frozen=True)
class Report:
    mode: str
    side: str  # what `a` ran
    baseline: str  # what `b` ran
    activations: str  # the compute dtype
    weights: str  # "fp8" (block-FP8) or the compute dtype
    positions: int
    bound: float | None
    rows: tuple[LayerRow, ...]
    logits_error: float
    argmax_equal: tuple[bool, ...]

    @property
    def first_failure(self) -> str | None:
        """The first layer over the bound, in the model's order: the layers after it inherit its error."""
        for row in self.rows:
            if row.failures:
                what = (f"hidden {row.error:.3e} > {row.bound:.1e}" if row.failures[0] == "hidden" else
                        f"expert sets differ at positions {[f.position for f in row.flips]}")
                return f"layer {row.layer} ({row.kind}) {what}"
        return None

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def as_dict(self) -> dict:
        return dict(mode=self.mode, side=self.side, baseline=self.baseline, activations=self.activations,
                    weights=self.weights, positions=self.positions, bound=self.bound,
                    rows=[r.as_dict() for r in self.rows],
                    logits=dict(error=self.logits_error, argmax_equal=list(self.argmax_equal)), ok=self.ok,
                    first_failure=self.first_failure)

    def format(self) -> str:
        bound = ("no bound (reported only): rounding at these activations flips routes on near-ties"
                 if self.bound is None else f"bound {self.bound:.0e} relative L2 per layer"
                 + (", expert sets equal" if any(r.experts_required for r in self.rows) else ""))
        lines = [f"{self.side} against {self.baseline} (the baseline)",
                 f"{self.activations} activations over {self.weights} weights; {bound}",
                 f"{'layer':>5} {'kind':<10} {'hidden':>10} {'experts':>8}  verdict"]
        for r in self.rows:
            experts = "" if r.experts_equal is None else f"{sum(r.experts_equal)}/{len(r.experts_equal)}"
            verdict = "-" if r.bound is None and not r.experts_required else (
                "ok" if not r.failures else "OVER: " + ", ".join(r.failures))
            lines.append(f"{r.layer:>5} {r.kind:<10} {r.error:>10.3e} {experts:>8}  {verdict}")
            lines.extend(f"{'':>17}{f.describe()}" for f in r.flips)
        lines.append(f"logits {self.logits_error:.3e}; argmax equal at {sum(self.argmax_equal)}/"
                     f"{len(self.argmax_equal)} positions")
        first = self.first_failure
        lines.append(("every layer within the bound" if self.bound is not None else "reported without a bound")
                     if first is None else f"first over the bound: {first}")
        return "\n".join(lines)


def compare(a: Capture, b: Capture, params, cfg, *, bound: float | None, experts_required: bool
            ) -> tuple[LayerRow, ...]:
    """Every layer of `a` against the baseline `b`."""
    rows = []
    for i in range(cfg.num_layers):
        mixer, ffn = cfg.layer_kinds[i]
        equal, flips = None, ()
        if i in b.ids:
            equal = tuple(bool(e) for e in (np.sort(a.ids[i], 1) == np.sort(b.ids[i], 1)).all(1))
            flips = _flips(i, a, b, params, cfg, equal)
        rows.append(LayerRow(i, f"{mixer}+{ffn}", rel_err(a.hidden[i], b.hidden[i]), bound, equal, flips,
                             experts_required))
    return tuple(rows)


def _flips(i: int, a: Capture, b: Capture, params, cfg, equal: tuple[bool, ...]) -> tuple[Flip, ...]:
    if all(equal):
        return ()
    ffn = params["layers"][i]["ffn"]
    ours, theirs = (biased_scores(c.router_in[i], ffn["router"], ffn["expert_bias"]) for c in (a, b))
    gaps = boundary_gap(theirs, cfg)
    diff = np.abs(ours - theirs).max(axis=1)
    return tuple(Flip(t, float(gaps[t]), float(diff[t])) for t, same in enumerate(equal) if not same)


# ---- the check ---------------------------------------------------------------------------------------------------


def check(params, cfg, prompt, tokens, *, mode: str = "verify-vs-decode", backend: str = "reference",
          path: str = "verify", bound: float | None = None) -> Report:
    """Compare, layer by layer, two runs over `tokens` (T ids: the last committed token, then the drafts) after
    `prompt` (ids) is prefilled; batch 1, one device.

    Args:
      mode: "verify-vs-decode": the verify forward against T decode steps (the baseline), both on `backend`, the
        prompt prefilled on it too. "backends": `path` on `backend` against `path` on the reference backend (the
        baseline), the prompt prefilled on the reference for both.
      bound: each layer's hidden-state bound; None: F32_BOUND for float32 activations, none (reported only)
        otherwise. Expert sets must be equal with float32 activations.
    """
    import jax.numpy as jnp

    from ling_jax import model
    from ling_jax.params import as_params

    params = as_params(params)
    _check_call(params, cfg, mode, path, backend)
    prompt, tokens = jnp.asarray([prompt], jnp.int32), jnp.asarray([tokens], jnp.int32)
    model._check_tokens(tokens, cfg, "tokens")
    activations = jnp.dtype(params["embed"].dtype).name
    if bound is None and activations == "float32":
        bound = F32_BOUND
    T = tokens.shape[1]
    _, state, _ = model.prefill(params, prompt, cfg, max_len=prompt.shape[1] + T,
                                backend=backend if mode == "verify-vs-decode" else "reference")
    if mode == "verify-vs-decode":
        a, b = capture_verify(params, cfg, state, tokens, backend), capture_decode(params, cfg, state, tokens, backend)
        side, baseline = f"verify over {T} positions (backend {backend})", f"{T} decode steps (backend {backend})"
    else:
        run = capture_verify if path == "verify" else capture_decode
        a, b = run(params, cfg, state, tokens, backend), run(params, cfg, state, tokens, "reference")
        what = f"verify over {T} positions" if path == "verify" else f"{T} decode steps"
        side, baseline = f"{what} on backend {backend}", f"{what} on backend reference"
    rows = compare(a, b, params, cfg, bound=bound, experts_required=activations == "float32")
    return Report(mode, side, baseline, activations, cfg.quantization or activations, T, bound, rows,
                  rel_err(a.logits, b.logits), tuple(bool(e) for e in a.logits.argmax(-1) == b.logits.argmax(-1)))


def _check_call(params, cfg, mode: str, path: str, backend: str) -> None:
    from ling_jax.backends import check_config, check_partitioning, prepare
    from ling_jax.sharding import tp_size

    if mode not in MODES or path not in PATHS:
        raise ValueError(f"mode={mode!r} must be one of {MODES} and path={path!r} one of {PATHS}")
    if tp_size() > 1:
        raise ValueError("layercheck runs on one device (the router's taps would hold per-shard values): load the "
                         "params without a tp mesh")
    for spec in {backend, "reference"}:
        check_config(cfg, spec)
        check_partitioning(params, spec)
    prepare(backend)
