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
Kernel 2, the down product and its combine, is in down.py (`down_and_combine`): at T = 1 the layer's output in the
same launch ("fused", or the slot-parallel "slots_last"; "slots" with an XLA combine), at T > 1 per slot group plus
an XLA combine fusion.
Tunings by T (`default_tuning`): `DECODE_TUNING` (T = 1), `FMA_TOKENS_TUNING` (2 <= T <= FMA_TOKENS_MAX) and
`VERIFY_TUNING` (larger T, the dot path's field defaults); with FP8 routed experts `DECODE_TUNING_FP8` and
`VERIFY_TUNING_FP8`. `t1_gate_up="dot"` takes T = 1 through the T > 1 dot gate/up (16 padded token rows).
PDL: with `early_launch_down` (DECODE_TUNING) the down kernel's programs first admit its successor (at T = 1
whatever follows the MoE layer: in the model, the next block's norm fusion), which then waits at its entry
(pallas_kernels/common/pdl.py).

FP8 (any expert matrix an OUT_IN `fp8.Fp8Weight`: E4M3 q [.., out, in] and the checkpoint's float32 128x128 block
scales [.., ceil(out/128), ceil(in/128)]; each matrix plain or FP8 on its own): the weight is never rounded to the
compute dtype. Each product over one scale block is taken with the E4M3 values themselves, widened exactly (to
fp32 for the FMAs, to the activations' dtype for the dots, whose 4 significant bits bf16 holds), summed in fp32, and
that fp32 sum is multiplied by the block's scale: y[o] = sum_b scale[o_blk, b] · sum_{i in b} x[i]·q[o, i], the
reference's fp32-weight products (reference.py) up to fp32 rounding and summation order. A chunk wider than 128
columns is loaded as 128-wide sub-blocks, each with its block's one scale (a scalar load): chunk widths are powers
of two starting at multiples of themselves, so no load straddles two blocks, and a tile's rows (at most 128,
`check_fp8_rows`) lie in one; a ragged last block (I = 64 or 192) is indexed like any other.
At T = 1 ("accumulate", DECODE_TUNING_FP8) each lane sums the 16 adjacent weights of a row it holds (one 16-byte
load) as a chain of FFMAs and scales that sum once (`lane_sums`): per weight half an E4M3x2 -> f16x2 unpack, one
f16 -> fp32 widening and one FFMA, plus the activations' loads and widening, 3.6-3.7 SASS instructions against 6.5
(gate/up) and 10.0 (down) for the earlier dequantise-to-bf16 tiles. The activations are loaded in the weight tile's
shape (`rows_load`), so in its register layout: a [1, BW] slice would be moved between lanes through shared memory,
whose barriers keep the compiler from issuing later tiles' loads early; and h reaches the T = 1 down kernel as
float32 (`h_dtype`). The FP8 tunings (`DECODE_TUNING_FP8`, `VERIFY_TUNING_FP8`) are what `default_tuning` picks when
the routed experts are FP8.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import fp8, interpret_mode
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2
from pallas_kernels.moe.down import counter_shape, counters_needed, down_and_combine, h_dtype
from pallas_kernels.moe.tiles import (EVICTION_POLICIES, check_fp8_rows, chunk_loop, dot_nt, lane_group, lane_sums,
                                      load_w, operand, ownership, rows_load, scaled, split_fp8, sub_width, swiglu,
                                      widen_exact, with_optional)

MAX_TOKENS = 64  # beyond this, ownership checks over T·K ids in every program stop paying: use the reference

# T > 1 gate/up: "dot" (tensor-core dots over the tokens padded to TP rows, orientation `dot_gate_up`: "dot_x"
# x·Wᵀ with the weight tile as the transposed operand, "dot_w" W·xᵀ with it as the left operand) or "fma_tokens"
# (a program's [BI, BK] weight tile, read once, times each real token's slice: T FMA reductions per tile and none
# for the padded rows, which x and h keep; for small T, with the T = 1 path's tiny programs).
VERIFY_GATE_UP_MODES = ("dot", "fma_tokens")
# T = 1 FMA products (gate/up and down): "reduce" each tile's products across the warp into the [1, BI] / [BD]
# accumulator, or "accumulate" them elementwise into a [BI, BW] / [BD, BW] fp32 tile reduced once at the end (an FP8
# tile: each lane's sum of its adjacent weights of a row, scaled, into [BI, BW / G], `lane_sums`).
T1_PRODUCTS = ("reduce", "accumulate")
# T = 1 down: "fused" (programs of BD output features walk every slot and combine in the same launch, adding the
# shared expert and the residual), "slots" (a program per (slot, BD features) over all of I, its weighted fp32
# partial combined by one XLA fusion, as at T > 1) or "slots_last" (the same programs, the last of a feature block's
# to finish combining its partials: a counter per block, zeroed by the gate/up launch, no combine launch).
DOWN_T1_MODES = ("fused", "slots", "slots_last")
# T = 1 gate/up: "fma" (the products above) or "dot" (the token padded to 16 rows through the T > 1 tensor-core
# gate/up, `dot_gate_up`, whose weight loads Triton pipelines `stages_gate_up` deep through shared memory; h then
# has 16 rows, of which the slot-parallel down reads the first).
T1_GATE_UP_MODES = ("fma", "dot")


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
    t1_products: str = "reduce"  # T1_PRODUCTS
    down_t1: str = "fused"  # DOWN_T1_MODES
    t1_gate_up: str = "fma"  # T1_GATE_UP_MODES
    # T = 1 gate/up: the D chunks written out rather than a loop, so that later chunks' loads may be issued before
    # earlier chunks' math (the compiler pipelines loads only into dots; the T = 1 down kernel is written out too)
    unroll_gate_up: bool = False

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
        if self.t1_products not in T1_PRODUCTS:
            raise ValueError(f"ExpertsTuning.t1_products={self.t1_products!r} must be one of {T1_PRODUCTS}")
        if self.down_t1 not in DOWN_T1_MODES:
            raise ValueError(f"ExpertsTuning.down_t1={self.down_t1!r} must be one of {DOWN_T1_MODES}")
        if self.t1_gate_up not in T1_GATE_UP_MODES:
            raise ValueError(f"ExpertsTuning.t1_gate_up={self.t1_gate_up!r} must be one of {T1_GATE_UP_MODES}")
        if self.t1_gate_up == "dot" and self.down_t1 == "fused":
            raise ValueError("ExpertsTuning.t1_gate_up='dot' writes h with 16 token rows, which only the slot-parallel "
                             "T = 1 down reads: set down_t1='slots' or 'slots_last'")


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


# FP8 routed experts (1-byte weights), T = 1 gate/up: one row per lane (4 rows per one-warp program: a [4, 128]
# E4M3 sub-block is one 16-byte load per lane), products "accumulate"d as per-lane FFMA chains (module docstring):
# the venv Triton's sm_90 compile counts 3.7 SASS instructions per gate/up weight, no spills, no shared memory (the
# dequantise-to-bf16 tiles: 6.5; bf16 weights with DECODE_TUNING: 4.4 per bf16 weight, twice the bytes); 1728
# programs, all resident at once. T > 1: tensor-core dots with 32-row two-warp gate/up programs (3.6 per weight at
# T = 2..16 against 4.3 with four warps and 14 with VERIFY_TUNING's 16 rows, whose E4M3 -> bf16 conversion takes a
# costly layout); the down blocks stay (64 features: fewer programs would idle SMs). experiments/bench_moe.py --fp8
# sweeps the T = 1 alternatives on the GPU (EXPERTS_SWEEP_FP8).
# The T = 1 down as (slot, 64 features) programs over all of I on 4 warps, each feature block's last program
# combining ("slots_last"): every program's six [64, 128] E4M3 tiles (four rows a lane, 24 registers a thread at
# I = 768; an I several times wider would want the tiles in a loop) loaded before its first product, 360 programs.
# On an H100 in the model-like chain: layer 33.49 µs against 40.33 for the fused one-launch down of 2 features per
# program; 33.15 with the XLA combine ("slots"), a launch more per layer; 34.5-41.9 at 32 or 128 features or 8
# warps (experiments/RESULTS.md, "FP8 MoE layer").
DECODE_TUNING_FP8 = dataclasses.replace(DECODE_TUNING, block_i=4, block_d=64, warps_down=4, t1_products="accumulate",
                                        down_t1="slots_last")
VERIFY_TUNING_FP8 = dataclasses.replace(VERIFY_TUNING, block_i=32, warps_gate_up=2)


def default_tuning(n_tokens: int, fp8_weights: bool = False) -> ExpertsTuning:
    """The tuning by T, for bf16/fp32 or (fp8_weights) FP8 routed experts."""
    if fp8_weights:
        return DECODE_TUNING_FP8 if n_tokens == 1 else VERIFY_TUNING_FP8
    if n_tokens == 1:
        return DECODE_TUNING
    return FMA_TOKENS_TUNING if n_tokens <= FMA_TOKENS_MAX else VERIFY_TUNING


def _gu_init(mode, bi, to, bw, scale_ref, lanes):
    if mode == "fma_acc" and scale_ref is not None:  # FP8: per-lane sums (lane_sums)
        return jnp.zeros((bi, bw // lane_group(bi, bw, lanes)), jnp.float32)
    shape = {"fma_reduce": (1, bi), "fma_acc": (bi, bw), "dot_x": (to, bi), "dot_w": (bi, to)}[mode]
    return jnp.zeros(shape, jnp.float32)


def _gu_step(mode, acc, tile, xs, lanes):
    """acc + the products of a [BI, BW] weight tile (tile: (values, scale or None), `load_w`) with the [TO, BW]
    inputs, an FP8 tile's fp32 sums times its block's scale. T = 1 (one row): fma_reduce reduces them per tile
    into [1, BI]; fma_acc accumulates them elementwise into [BI, BW] (FP8: per-lane sums into [BI, BW / G],
    `lane_sums` over `lanes` lanes), reduced once by _gu_final."""
    w, scale = tile
    if mode.startswith("fma"):
        prod = w.astype(jnp.float32) * xs.astype(jnp.float32)
        if mode == "fma_reduce":
            return acc + scaled(jnp.sum(prod, axis=1), scale)[None, :]
        return acc + (prod if scale is None else lane_sums(prod, lanes) * scale)
    w = operand(w, xs.dtype)
    return acc + scaled(dot_nt(xs, w) if mode == "dot_x" else dot_nt(w, xs), scale)


def _gu_final(mode, acc):
    """The accumulator as [TO, BI] fp32."""
    if mode == "fma_acc":
        return jnp.sum(acc, axis=1)[None, :]
    return acc.T if mode == "dot_w" else acc


def _gate_up_rows(x_ref, load_g, load_u, *, BK, BW, n_chunks, bi, to, mode, limit, dt, scales, lanes, n_tok=1,
                  unroll=False):
    """SwiGLU(x·W_gateᵀ, x·W_upᵀ) for BI intermediate rows: x_ref [TO, D]; load_g/load_u(ks) -> ([BI, BW] weight
    tile of one expert, its scale or None) (BW = BK, or an FP8 weight's 128-wide sub-blocks of a BK chunk); scales:
    the two scale refs (None: plain); lanes: the program's; unroll: chunk_loop's; -> [TO, BI] in dt (each product
    rounded to dt before SwiGLU, as the reference).
    mode "fma_tokens": only the first n_tok rows of x are tokens (the rest padding, left zero)."""
    if mode == "fma_tokens":
        return _gate_up_rows_tokens(x_ref, load_g, load_u, BK=BK, BW=BW, n_chunks=n_chunks, bi=bi, to=to,
                                    limit=limit, dt=dt, n_tok=n_tok)

    # T = 1 with an FP8 tile: x's slice loaded in the tile's shape, so in its register layout (`rows_load`); a
    # [1, BW] slice is moved to that layout through shared memory, whose barrier would keep the compiler from
    # issuing later tiles' loads early.
    bcast = mode.startswith("fma") and any(sc is not None for sc in scales)

    def step(ks, carry):
        xs = rows_load(x_ref, (), bi, ks) if bcast else x_ref[:, ks]
        return _gu_step(mode, carry[0], load_g(ks), xs, lanes), _gu_step(mode, carry[1], load_u(ks), xs, lanes)

    init = tuple(_gu_init(mode, bi, to, BW, sc, lanes) for sc in scales)
    acc_g, acc_u = (_gu_final(mode, a) for a in chunk_loop(n_chunks, BK, BW, step, init, unroll))
    return swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)


def _gate_up_rows_tokens(x_ref, load_g, load_u, *, BK, BW, n_chunks, bi, to, limit, dt, n_tok):
    """_gate_up_rows for T > 1 by FMAs: each [BI, BW] weight tile is loaded once and reduced against each of the
    n_tok tokens' [1, BW] slices (loaded one by one: a [TO, BW] block would not fit one warp's registers)."""
    rows = lax.broadcasted_iota(jnp.int32, (to, bi), 0)

    def step(ks, carry):
        (wg, sg), (wu, su) = load_g(ks), load_u(ks)
        wg, wu = wg.astype(jnp.float32), wu.astype(jnp.float32)
        acc_g, acc_u = carry
        for t in range(n_tok):
            xt = x_ref[pl.ds(t, 1), ks].astype(jnp.float32)  # [1, BW]
            acc_g = acc_g + jnp.where(rows == t, scaled(jnp.sum(wg * xt, axis=1), sg)[None, :], 0.0)
            acc_u = acc_u + jnp.where(rows == t, scaled(jnp.sum(wu * xt, axis=1), su)[None, :], 0.0)
        return acc_g, acc_u

    init = jnp.zeros((to, bi), jnp.float32)
    acc_g, acc_u = chunk_loop(n_chunks, BK, BW, step, (init, init))
    return swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)  # padded rows: SwiGLU(0, 0) = 0


def experts_fwd_kernel_gate_up(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, wg_scale_ref, wu_scale_ref,
                               sg_scale_ref, su_scale_ref, h_ref, count_ref=None, *, BK, n_chunks, n_routed, limit,
                               shared_limit, has_shared, mode, eviction=None, n_tok=1, lanes=32, unroll=False):
    # x_ref [TO, D] (TO = 1 at T = 1, else TP); ids_ref [P] int32; wg_ref/wu_ref [E, I, D]; sg_ref/su_ref [I, D];
    # *_scale_ref: the FP8 weights' block scales [E, ceil(I/128), ceil(D/128)] / [ceil(I/128), ceil(D/128)], None
    # for a plain weight; h_ref [TO, BI]: slot s, intermediate rows block j, after SwiGLU: values of the compute
    # dtype (x's), stored in it or (T = 1 with an FP8 W_down, `h_dtype`) in float32; count_ref [C] int32 or None:
    # the "slots_last" down kernel's arrival counters, zeroed here
    s, j = pl.program_id(0), pl.program_id(1)
    if count_ref is not None:
        @pl.when((s == 0) & (j == 0))
        def _():
            count_ref[...] = jnp.zeros(count_ref.shape, jnp.int32)

    to, bi = h_ref.shape
    dt = x_ref.dtype
    e, owner = ownership(ids_ref[...], s, n_routed)
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)

    def compute(load_g, load_u, lim, scales):
        h = _gate_up_rows(x_ref, load_g, load_u, BK=BK, BW=sub_width(BK, *scales), n_chunks=n_chunks, bi=bi, to=to,
                          mode=mode, limit=lim, dt=dt, scales=scales, lanes=lanes, n_tok=n_tok, unroll=unroll)
        h_ref[...] = h if h_ref.dtype == dt else widen_exact(h)

    # One indexer per load (the Triton lowering takes no `ref.at[e][...]` chains).
    @pl.when(owner)
    def _():
        compute(lambda ks: load_w(wg_ref, wg_scale_ref, (e,), rows, ks, eviction),
                lambda ks: load_w(wu_ref, wu_scale_ref, (e,), rows, ks, eviction), limit,
                (wg_scale_ref, wu_scale_ref))

    if has_shared:
        @pl.when(s == n_routed)
        def _():
            compute(lambda ks: load_w(sg_ref, sg_scale_ref, (), rows, ks, None),
                    lambda ks: load_w(su_ref, su_scale_ref, (), rows, ks, None), shared_limit,
                    (sg_scale_ref, su_scale_ref))


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "tuning"))
def moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, *, limit, shared_limit,
                      tuning: ExpertsTuning | None = None, residual=None):
    n, d = x.shape
    tuning = tuning or default_tuning(n, any(isinstance(w, fp8.Fp8Weight) for w in (we_gate, we_up, we_down)))
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
    (wg, wg_s), (wu, wu_s) = split_fp8(we_gate), split_fp8(we_up)
    (sg, sg_s), (su, su_s) = split_fp8(ws_gate), split_fp8(ws_up)
    bi = min(tuning.block_i, i & -i)
    bk = min(tuning.block_k, d & -d)
    check_fp8_rows(tuning, "block_i", bi, wg_s, wu_s, sg_s, su_s)
    t1_dot = n == 1 and tuning.t1_gate_up == "dot"
    if n == 1 and not t1_dot:
        mode = "fma_acc" if tuning.t1_products == "accumulate" else "fma_reduce"
    else:
        mode = tuning.dot_gate_up if tuning.verify_gate_up == "dot" or t1_dot else tuning.verify_gate_up
    if mode.startswith("dot") and bi < 16:
        raise ValueError(f"ExpertsTuning.block_i={tuning.block_i} with gate/up mode {mode!r} at T={n}: tensor-core "
                         "dots need >= 16 rows; only the FMA products take fewer (T = 1 with t1_gate_up='fma', or "
                         "verify_gate_up='fma_tokens' at T > 1), or use VERIFY_TUNING")
    tp = max(16, next_pow2(n))
    to = 1 if n == 1 and not t1_dot else tp
    if to != n:
        x = jnp.pad(x, ((0, tp - n), (0, 0)))
        ids = jnp.pad(ids, ((0, tp - n), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, tp - n), (0, 0)))
    ids_flat = ids.reshape(-1)  # [TO·K]
    n_routed = n * k
    n_slots = n_routed + int(has_shared)
    if not has_shared:
        sg = su = jnp.zeros((1, 1), dt)  # never read: has_shared=False is static
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_gate_up, BK=bk, n_chunks=d // bk, n_routed=n_routed, limit=limit,
                          shared_limit=shared_limit, has_shared=has_shared, mode=mode,
                          eviction=tuning.routed_eviction, n_tok=n, lanes=32 * tuning.warps_gate_up,
                          unroll=n == 1 and tuning.unroll_gate_up),
        [x, ids_flat, wg, wu, sg, su, wg_s, wu_s, sg_s, su_s])
    out_specs = [pl.BlockSpec((None, to, bi), lambda s, j: (s, 0, j))]
    out_shape = [jax.ShapeDtypeStruct((n_slots, to, i), h_dtype(n, dt, we_down, ws_down))]
    if counters_needed(n, tuning):  # the down kernel's arrival counters, one per feature block
        out_specs.append(pl.no_block_spec)
        out_shape.append(jax.ShapeDtypeStruct(counter_shape(d, tuning), jnp.int32))
    h, *count = pl.pallas_call(
        kernel,
        grid=(n_slots, i // bi),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_gate_up",
    )(*inputs)
    return down_and_combine(h, ids, weights, we_down, ws_down, n=n, tuning=tuning, residual=residual, dtype=dt,
                            count=count[0] if count else None)[:n]


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: ExpertsTuning | None = None, residual=None):
    """Same contract as `reference.moe_experts` (+ `residual`, added last; any expert matrix plain or an OUT_IN
    Fp8Weight); shapes already validated by the dispatcher."""
    return moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                             shared_limit=shared_limit, tuning=tuning, residual=residual)
