"""Pallas-Triton routed + shared SwiGLU experts for small T (decode, verify): each selected expert read once.

Layout (ling_jax/params.py): every expert matrix is stored as torch stores it, [out, in]: gate/up [E, I, D], down
[E, D, I]. Gate/up programs own BI intermediate rows and read those D-rows (5 KB at Flash size) end to end; down
programs own BD output features and read those I-rows (1.5 KB). On the H200 at T = 1, gate/up stored [E, D, I]
(a 64-256 byte stripe of every row per program) took 28 µs instead of 18.5, and down stored [E, I, D] 10.6 µs plus
a 0.9 µs combine fusion, where whole rows in one-row programs take 10.4-10.6 with the combine inside
(experiments/RESULTS.md, "MoE").

Slots: the T·K (token, k) pairs in row-major order, plus the shared expert. A routed slot *owns* its expert when
no earlier slot chose the same expert; only owners do work, and an owner computes its expert for every token (its
rows are masked by the routing weights later). Each distinct expert is read once with no argsort/bincount/
ragged_dot: ownership is one vector compare over the ids, repeated in every program.

Kernel 1 (`experts_fwd_kernel_gate_up`), grid (S, I / BI): owner slot s streams gate and up rows [BI, D] in
[BI, BK] tiles, accumulates in fp32, rounds to the compute dtype, applies SwiGLU (+ post-SiLU clamp) and writes
h[s, :, BI-block]. Non-owner programs exit at once; their h rows stay unwritten and unread.
Products: at T = 1 each tile's FMAs are reduced into [1, BI] (DECODE_TUNING's 2-row one-warp programs: the shape
that read a layer's 70.8 MB of gate/up fastest in a read-only kernel, 17.8 µs). At T > 1 (`verify_gate_up`) the
tokens are padded to TP = max(16, 2^⌈log2 T⌉) rows and every step is a tensor-core dot ("dot", orientation
`dot_gate_up`), or each weight tile, read once, is reduced against the T real tokens one by one ("fma_tokens").
Kernel 2 at T = 1 (`experts_fwd_kernel_down_t1`), grid (D / BD): a program owns BD output features and, for the
shared expert and then each routed slot, reduces their BD W_down rows against the slot's h by FMAs (the slots
written out, so the compiler overlaps one slot's loads with another's math), rounds each expert's output to the
compute dtype as the reference does, sums the routed ones weighted in fp32, rounds once and adds the shared output
(and the optional residual): the layer's output, no combine launch. Non-owner slots (a repeated id; the router never
repeats one within a token) are masked, their owner taking every weight of the id.
Kernel 2 at T > 1 (`experts_fwd_kernel_down`), grid (K + 1, D / BD): group g < K walks its T slots, takes
tensor-core dots h·W_down[BD rows]ᵀ over the TP token rows (fp32, rounded to the compute dtype as the reference
rounds each expert's output), scales by each token's routing weight in fp32 and writes a fp32 partial; program row
K writes the shared expert's output. XLA sums the K partials (fp32), rounds once and adds the shared output in the
compute dtype: one small fusion.
Tunings by T (`default_tuning`): `DECODE_TUNING` (T = 1), `FMA_TOKENS_TUNING` (2 <= T <= FMA_TOKENS_MAX) and
`VERIFY_TUNING` (larger T, the dot path's field defaults).
PDL: with `early_launch_down` (DECODE_TUNING) the down kernel's programs first admit its successor (at T = 1
whatever follows the MoE layer: in the model, the next block's norm fusion), which then waits at its entry
(pallas_kernels/common/pdl.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import interpret_mode
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2

MAX_TOKENS = 64  # beyond this, ownership checks over T·K ids in every program stop paying: use the reference

# T > 1 gate/up: "dot" (tensor-core dots over the tokens padded to TP rows, orientation `dot_gate_up`: "dot_x"
# x·Wᵀ with the weight tile as the transposed operand, "dot_w" W·xᵀ with it as the left operand) or "fma_tokens"
# (a program's [BI, BK] weight tile, read once, times each real token's slice: T FMA reductions per tile and none
# for the padded rows, which x and h keep; for small T, with the T = 1 path's tiny programs).
VERIFY_GATE_UP_MODES = ("dot", "fma_tokens")
EVICTION_POLICIES = (None, "evict_first")


def _load(ref, idx, eviction):
    """ref[idx] with an L2 eviction policy (None: the default load)."""
    return ref[idx] if eviction is None else pltriton.load(ref.at[idx], eviction_policy=eviction)


@dataclasses.dataclass(frozen=True)
class ExpertsTuning:
    # Field defaults = VERIFY_TUNING (T > FMA_TOKENS_MAX); DECODE_TUNING and FMA_TOKENS_TUNING below override some.
    block_i: int = 16  # BI: intermediate rows per gate/up program (>= 16 for the dots)
    block_k: int = 256  # BK: hidden-dim chunk per gate/up step
    block_d: int = 64  # BD: output features (W_down rows) per down program (>= 16 at T > 1: tensor-core dots)
    block_ki: int = 128  # BKI: intermediate columns per down step (capped at the largest power of two dividing I)
    dot_gate_up: str = "dot_x"  # T > 1 tensor-core gate/up products: "dot_x" | "dot_w"
    verify_gate_up: str = "dot"  # T > 1 gate/up: "dot" | "fma_tokens" (VERIFY_GATE_UP_MODES)
    warps_gate_up: int = 4
    stages_gate_up: int = 3
    warps_down: int = 4
    stages_down: int = 3  # T > 1 only: the T = 1 down kernel's FMA loads are written out, not pipelined
    # PDL (pallas_kernels/common/pdl.py, sm_90+): the down kernel's programs first let the next kernel be admitted
    # (the combine fusion at T > 1, whatever follows the layer at T = 1)
    early_launch_down: bool = False
    # L2 eviction policy of the routed experts' weight loads (None: the default policy). Each routed weight is read
    # once per layer, so "evict_first" keeps the stream from displacing lines that are read again: T = 1 gate/up
    # 18.9 -> 18.5-18.6 µs on the H200.
    routed_eviction: str | None = None

    def __post_init__(self):
        check_pow2_fields(self, ("block_i", "block_d"))
        check_pow2_fields(self, ("block_k", "block_ki"), 16)
        if self.dot_gate_up not in ("dot_x", "dot_w"):
            raise ValueError(f"ExpertsTuning.dot_gate_up={self.dot_gate_up!r} must be 'dot_x' or 'dot_w'")
        if self.verify_gate_up not in VERIFY_GATE_UP_MODES:
            raise ValueError(f"ExpertsTuning.verify_gate_up={self.verify_gate_up!r} must be one of "
                             f"{VERIFY_GATE_UP_MODES}")
        if self.routed_eviction not in EVICTION_POLICIES:
            raise ValueError(f"ExpertsTuning.routed_eviction={self.routed_eviction!r} must be one of "
                             f"{EVICTION_POLICIES}")


# T = 1: 2-row one-warp gate/up programs; down programs of one output feature and one warp (2560 at Flash size, all
# resident): 10.4-10.6 µs with the combine inside, against 11.4-11.5 for 2-row programs and 15.8-17.3 for 4 rows
# (the bytes a program keeps in flight are bounded by its registers, so more, smaller programs keep more in flight).
DECODE_TUNING = ExpertsTuning(block_i=2, block_k=512, warps_gate_up=1, block_d=1, block_ki=256, warps_down=1,
                              early_launch_down=True, routed_eviction="evict_first")
VERIFY_TUNING = ExpertsTuning()
# 2 <= T <= FMA_TOKENS_MAX: the T = 1 shape of gate/up programs with per-token FMA reductions instead of
# tensor-core dots over 16 padded token rows: MoE layer at T = 2 76.3 -> 66.6 µs, T = 3 102.9 -> 97.0 on the H200;
# at T = 4 the T FMA passes per tile cost more than the padding (119.4 -> 136.0).
FMA_TOKENS_MAX = 3
FMA_TOKENS_TUNING = dataclasses.replace(VERIFY_TUNING, verify_gate_up="fma_tokens", block_i=2, warps_gate_up=1,
                                        block_k=256, routed_eviction="evict_first")


def default_tuning(n_tokens: int) -> ExpertsTuning:
    if n_tokens == 1:
        return DECODE_TUNING
    return FMA_TOKENS_TUNING if n_tokens <= FMA_TOKENS_MAX else VERIFY_TUNING


def _dot_nt(a, b):
    """a [M, C] · b [N, C]ᵀ -> [M, N] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _gu_init(mode, bi, to):
    shape = {"fma_reduce": (1, bi), "dot_x": (to, bi), "dot_w": (bi, to)}[mode]
    return jnp.zeros(shape, jnp.float32)


def _gu_step(mode, acc, w, xs):
    """acc + the products of a [BI, BK] weight tile with the [TO, BK] inputs (T = 1: fma_reduce, one row)."""
    if mode == "fma_reduce":
        return acc + jnp.sum(w.astype(jnp.float32) * xs.astype(jnp.float32), axis=1)[None, :]
    return acc + (_dot_nt(xs, w) if mode == "dot_x" else _dot_nt(w, xs))


def _swiglu(g, u, limit):
    # g, u in the compute dtype; SiLU in fp32 rounded, clamp and product in the compute dtype (reference.swiglu).
    dt = g.dtype
    sg = jax.nn.silu(g.astype(jnp.float32)).astype(dt)
    if limit:
        sg = jnp.minimum(sg, jnp.asarray(limit, dt))
        u = jnp.minimum(jnp.maximum(u, jnp.asarray(-limit, dt)), jnp.asarray(limit, dt))
    return sg * u


def _ownership(ids_flat, s, n_routed):
    """Expert of slot s and whether s is the first slot that chose it. ids_flat [P] int32, padding = -1."""
    i_p = lax.iota(jnp.int32, ids_flat.shape[0])
    e = jnp.sum(jnp.where(i_p == s, ids_flat, 0))
    earlier = jnp.sum(jnp.where((i_p < s) & (ids_flat == e), 1, 0))
    return e, (s < n_routed) & (e >= 0) & (earlier == 0)


def _gate_up_rows(x_ref, load_g, load_u, *, BK, n_chunks, bi, to, mode, limit, dt, n_tok=1):
    """SwiGLU(x·W_gateᵀ, x·W_upᵀ) for BI intermediate rows: x_ref [TO, D]; load_g/load_u(ks) -> [BI, BK] weight
    tiles of one expert; -> [TO, BI] in dt (each product rounded to dt before SwiGLU, as the reference).
    mode "fma_tokens": only the first n_tok rows of x are tokens (the rest padding, left zero)."""
    if mode == "fma_tokens":
        return _gate_up_rows_tokens(x_ref, load_g, load_u, BK=BK, n_chunks=n_chunks, bi=bi, to=to, limit=limit,
                                    dt=dt, n_tok=n_tok)

    def body(c, carry):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        xs = x_ref[:, ks]
        return _gu_step(mode, carry[0], load_g(ks), xs), _gu_step(mode, carry[1], load_u(ks), xs)

    init = _gu_init(mode, bi, to)
    acc_g, acc_u = lax.fori_loop(0, n_chunks, body, (init, init))
    if mode == "dot_w":  # [BI, TO]
        acc_g, acc_u = acc_g.T, acc_u.T
    return _swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)


def _gate_up_rows_tokens(x_ref, load_g, load_u, *, BK, n_chunks, bi, to, limit, dt, n_tok):
    """_gate_up_rows for T > 1 by FMAs: each [BI, BK] weight tile is loaded once and reduced against each of the
    n_tok tokens' [1, BK] slices (loaded one by one: a [TO, BK] block would not fit one warp's registers)."""
    rows = lax.broadcasted_iota(jnp.int32, (to, bi), 0)

    def body(c, carry):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        wg, wu = load_g(ks).astype(jnp.float32), load_u(ks).astype(jnp.float32)
        acc_g, acc_u = carry
        for t in range(n_tok):
            xt = x_ref[pl.ds(t, 1), ks].astype(jnp.float32)  # [1, BK]
            acc_g = acc_g + jnp.where(rows == t, jnp.sum(wg * xt, axis=1)[None, :], 0.0)
            acc_u = acc_u + jnp.where(rows == t, jnp.sum(wu * xt, axis=1)[None, :], 0.0)
        return acc_g, acc_u

    init = jnp.zeros((to, bi), jnp.float32)
    acc_g, acc_u = lax.fori_loop(0, n_chunks, body, (init, init))
    return _swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)  # padded rows: SwiGLU(0, 0) = 0


def _down_dot(load_h, load_d, *, BKI, n_chunks, bd, to, dt):
    """T > 1: h·W_downᵀ for BD output features: load_h(ks) -> [TO, BKI] activations (TO >= 16 padded token rows),
    load_d(ks) -> [BD, BKI] weight tiles (W_down rows); -> [TO, BD] fp32 holding values rounded to dt (the reference
    rounds each expert's output)."""
    def body(c, acc):
        ks = pl.ds(pl.multiple_of(c * BKI, BKI), BKI)
        return acc + _dot_nt(load_h(ks), load_d(ks))

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((to, bd), jnp.float32))
    return acc.astype(dt).astype(jnp.float32)


def _down_fma(load_h, load_d, *, BKI, n_chunks, dt):
    """T = 1: h·W_downᵀ for BD output features by FMAs, the chunks written out (their loads issued together):
    load_h(ks) -> [1, BKI], load_d(ks) -> [BD, BKI]; -> [BD] fp32 holding values rounded to dt."""
    acc = None
    for c in range(n_chunks):
        ks = pl.ds(c * BKI, BKI)
        part = jnp.sum(load_d(ks).astype(jnp.float32) * load_h(ks).astype(jnp.float32), axis=1)
        acc = part if acc is None else acc + part
    return acc.astype(dt).astype(jnp.float32)


def experts_fwd_kernel_gate_up(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, *, BK, n_chunks, n_routed,
                               limit, shared_limit, has_shared, mode, eviction=None, n_tok=1):
    # x_ref [TO, D] (TO = 1 at T = 1, else TP); ids_ref [P] int32; wg_ref/wu_ref [E, I, D]; sg_ref/su_ref [I, D];
    # h_ref [TO, BI]: slot s, intermediate rows block j, after SwiGLU, compute dtype
    s, j = pl.program_id(0), pl.program_id(1)
    to, bi = h_ref.shape
    e, owner = _ownership(ids_ref[...], s, n_routed)
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)

    def compute(load_g, load_u, lim):
        h_ref[...] = _gate_up_rows(x_ref, load_g, load_u, BK=BK, n_chunks=n_chunks, bi=bi, to=to, mode=mode,
                                   limit=lim, dt=h_ref.dtype, n_tok=n_tok)

    # One indexer per load (the Triton lowering takes no `ref.at[e][...]` chains).
    @pl.when(owner)
    def _():
        compute(lambda ks: _load(wg_ref, (e, rows, ks), eviction), lambda ks: _load(wu_ref, (e, rows, ks), eviction),
                limit)

    if has_shared:
        @pl.when(s == n_routed)
        def _():
            compute(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], shared_limit)


def experts_fwd_kernel_down_t1(h_ref, ids_ref, w_ref, wd_ref, sd_ref, r_ref, y_ref, *, BKI, n_chunks, n_routed,
                               early_launch=False, eviction=None):
    # T = 1. h_ref [S, 1, I] (after SwiGLU); ids_ref [K] int32; w_ref [K] fp32; wd_ref [E, D, I]; sd_ref [D, I] or
    # None; r_ref [1, D] compute dtype (the residual stream, added last) or None; y_ref [1, BD] compute dtype: the
    # layer's output for BD features
    if early_launch:
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    feats = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
    ids, wts = ids_ref[...], w_ref[...]

    def expert_out(s, load_d):
        return _down_fma(lambda ks: h_ref[s, :, ks], load_d, BKI=BKI, n_chunks=n_chunks, dt=dt)

    # The shared expert first: the router prefetched its rows into L2 (0.0-0.3 µs faster than last).
    shared = None if sd_ref is None else expert_out(n_routed, lambda ks: sd_ref[feats, ks])
    routed = jnp.zeros((bd,), jnp.float32)
    for s in range(n_routed):  # written out: one slot's loads overlap another's math (a loop would serialise them)
        e, owner = _ownership(ids, s, n_routed)
        w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))  # a repeated id: its owner takes every weight
        out = expert_out(s, lambda ks: _load(wd_ref, (e, feats, ks), eviction))
        # A non-owner's h rows were never written: masked, not multiplied by 0 (inf · 0 = NaN).
        routed = routed + jnp.where(owner, w_e * out, 0.0)
    y = routed.astype(dt)
    if shared is not None:
        y = y + shared.astype(dt)
    y = y[None, :]
    if r_ref is not None:  # the caller's h + MoE(x), as the model adds it (in dt): no separate add launch
        y = r_ref[:, feats] + y
    y_ref[...] = y


def experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed,
                            group, n_groups, early_launch=False, eviction=None):
    # T > 1. h_ref [S, TO, I] (after SwiGLU); ids_ref [P]; ids2_ref [TO, K]; w_ref [TO, K] fp32; wd_ref [E, D, I];
    # sd_ref [D, I]; o_ref [TO, BD] fp32: partial of group g (g = NG: the shared expert)
    if early_launch:
        launch_dependents()
    g, i_d = pl.program_id(0), pl.program_id(1)
    to, bd = o_ref.shape
    feats = pl.ds(pl.multiple_of(i_d * bd, bd), bd)

    def expert_out(s, load_d):
        return _down_dot(lambda ks: h_ref[s, :, ks], load_d, BKI=BKI, n_chunks=n_chunks, bd=bd, to=to,
                         dt=wd_ref.dtype)

    @pl.when(g < n_groups)
    def _():
        ids_flat, ids2, wts = ids_ref[...], ids2_ref[...], w_ref[...]

        def slot(s, acc):
            e, owner = _ownership(ids_flat, s, n_routed)

            def add(acc):
                hit = ids2 == e  # [TO, K]; a token that lists e twice gets both weights
                w_tok = jnp.sum(jnp.where(hit, wts, 0.0), axis=1)  # [TO]
                used = jnp.sum(jnp.where(hit, 1, 0), axis=1) > 0
                out = expert_out(s, lambda ks: _load(wd_ref, (e, feats, ks), eviction))
                # Rows of tokens that did not choose e are masked, not multiplied by 0 (inf · 0 = NaN).
                return acc + jnp.where(used[:, None], w_tok[:, None] * out, 0.0)

            return lax.cond(owner, add, lambda a: a, acc)

        lo = g * group
        hi = jnp.minimum(lo + group, n_routed)
        o_ref[...] = lax.fori_loop(lo, hi, slot, jnp.zeros((to, bd), jnp.float32))

    if sd_ref is not None:
        @pl.when(g == n_groups)
        def _():
            o_ref[...] = expert_out(n_routed, lambda ks: sd_ref[feats, ks])


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "tuning"))
def moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, *, limit, shared_limit,
                      tuning: ExpertsTuning | None = None, residual=None):
    n, d = x.shape
    tuning = tuning or default_tuning(n)
    e, i, _ = we_gate.shape
    k = ids.shape[1]
    dt = x.dtype
    if k & (k - 1):
        raise ValueError(f"the Pallas experts kernel needs a power-of-two top_k, got K={k}")
    if n > MAX_TOKENS:
        raise ValueError(f"the Pallas experts kernel takes T <= {MAX_TOKENS} tokens (decode/verify), got T={n}; "
                         "larger T goes to pallas_kernels.moe.grouped (dispatch.moe_experts picks it)")
    has_shared = ws_gate is not None
    if has_shared and ws_gate.shape[0] != i:  # one h buffer holds every slot's I values
        raise ValueError(f"the Pallas experts kernel needs Is = I; got Is={ws_gate.shape[0]}, I={i}")
    if min(d & -d, i & -i) < 16:
        raise ValueError(f"the Pallas experts kernel needs D={d} and I={i} divisible by 16")
    bi = min(tuning.block_i, i & -i)
    bk = min(tuning.block_k, d & -d)
    if n == 1:
        mode = "fma_reduce"
    else:
        mode = tuning.dot_gate_up if tuning.verify_gate_up == "dot" else tuning.verify_gate_up
    if mode.startswith("dot") and bi < 16:
        raise ValueError(f"ExpertsTuning.block_i={tuning.block_i} with gate/up mode {mode!r} at T={n}: tensor-core "
                         "dots need >= 16 rows; only the FMA products take fewer (T = 1, or "
                         "verify_gate_up='fma_tokens' at T > 1), or use VERIFY_TUNING")
    tp = max(16, next_pow2(n))
    to = 1 if n == 1 else tp
    if to != n:
        x = jnp.pad(x, ((0, tp - n), (0, 0)))
        ids = jnp.pad(ids, ((0, tp - n), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, tp - n), (0, 0)))
    ids_flat = ids.reshape(-1)  # [TO·K]
    n_routed = n * k
    n_slots = n_routed + int(has_shared)
    if not has_shared:
        ws_gate = ws_up = jnp.zeros((1, 1), dt)  # never read: has_shared=False is static
    interpret = interpret_mode()
    whole = pl.no_block_spec
    h = pl.pallas_call(
        functools.partial(experts_fwd_kernel_gate_up, BK=bk, n_chunks=d // bk, n_routed=n_routed, limit=limit,
                          shared_limit=shared_limit, has_shared=has_shared, mode=mode,
                          eviction=tuning.routed_eviction, n_tok=n),
        grid=(n_slots, i // bi),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((None, to, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_slots, to, i), dt),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        interpret=interpret,
        name="experts_fwd_kernel_gate_up",
    )(x, ids_flat, we_gate, we_up, ws_gate, ws_up)
    return down_and_combine(h, ids, weights, we_down, ws_down, n=n, tuning=tuning, residual=residual)[:n]


def down_and_combine(h, ids, weights, we_down, ws_down, *, n, tuning: ExpertsTuning, residual=None):
    """Kernel 2 and the combine: h [S, TO, I] after SwiGLU (slots as in kernel 1), ids/weights [TO, K] (padded rows
    -1 / 0), we_down [E, D, I], ws_down [D, I] or None, residual [n, D] or None -> y [TO, D] in h's dtype (plus the
    residual: at T = 1 inside the down kernel, at T > 1 in the combine fusion)."""
    to, k = ids.shape
    _, d, i = we_down.shape
    has_shared = ws_down is not None
    if h.shape[0] != n * k + int(has_shared):
        raise ValueError(f"h has {h.shape[0]} slots; T·K = {n * k} routed slots" +
                         (" + 1 shared (ws_down given)" if has_shared else " (no ws_down: no shared slot)"))
    bd = min(tuning.block_d, d & -d)
    bki = min(tuning.block_ki, i & -i)
    if n == 1:
        return _down_t1(h, ids, weights, we_down, ws_down, residual, bd=bd, bki=bki, tuning=tuning)
    if bd < 16:
        raise ValueError(f"ExpertsTuning.block_d={tuning.block_d} at T={n}: the T > 1 down kernel's tensor-core dots "
                         "need >= 16 output features per program (block_d >= 16; VERIFY_TUNING has 64)")
    n_routed = n * k
    n_groups = k  # slot groups of T slots each
    kernel = functools.partial(experts_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_routed=n_routed, group=n,
                               n_groups=n_groups, early_launch=tuning.early_launch_down,
                               eviction=tuning.routed_eviction)
    down_inputs = [h, ids.reshape(-1), ids, weights, we_down]
    if has_shared:
        down_inputs.append(ws_down)
    else:
        kernel = functools.partial(lambda *refs, kern: kern(*refs[:5], None, refs[5]), kern=kernel)
    partials = pl.pallas_call(
        kernel,
        grid=(n_groups + int(has_shared), d // bd),
        in_specs=[pl.no_block_spec] * len(down_inputs),
        out_specs=pl.BlockSpec((None, to, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_groups + int(has_shared), to, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down",
    )(*down_inputs)
    y = jnp.sum(partials[:n_groups], axis=0).astype(h.dtype)  # fp32 combine of the routed experts, rounded once
    if has_shared:
        y = y + partials[n_groups].astype(h.dtype)  # compute-dtype add of the shared expert
    if residual is not None:
        y = jnp.pad(residual, ((0, to - n), (0, 0))) + y
    return y


def _down_t1(h, ids, weights, we_down, ws_down, residual, *, bd, bki, tuning):
    """T = 1: down, weighted combine, the shared expert and the residual add in one launch -> y [1, D] in h's
    dtype."""
    k = ids.shape[1]
    _, d, i = we_down.shape
    kernel = functools.partial(experts_fwd_kernel_down_t1, BKI=bki, n_chunks=i // bki, n_routed=k,
                               early_launch=tuning.early_launch_down, eviction=tuning.routed_eviction)
    optional = [ws_down, residual]  # absent ones reach the kernel as None (static)
    present = [a is not None for a in optional]
    inputs = [h, ids.reshape(-1), weights.reshape(-1), we_down] + [a for a in optional if a is not None]

    def with_absent(*refs):
        it = iter(refs[4:-1])
        kernel(*refs[:4], *(next(it) if p else None for p in present), refs[-1])

    return pl.pallas_call(
        with_absent,
        grid=(d // bd,),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, d), h.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_t1",
    )(*inputs)


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: ExpertsTuning | None = None, residual=None):
    """Same contract as `reference.moe_experts` (+ `residual`, added last); shapes already validated by the
    dispatcher."""
    return moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                             shared_limit=shared_limit, tuning=tuning, residual=residual)
