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
repeats one within a token) are masked, their owner taking every weight of the id. This is `down_t1="fused"`
(DECODE_TUNING). The slot-parallel forms (DECODE_TUNING_FP8) give every (slot, BD features) pair a program over all
of I instead, which loads all its weight tiles before its first product (a CTA barrier keeps ptxas from sinking the
loads to their products) and writes its weighted fp32 partial: "slots" (`experts_fwd_kernel_down_slots`) leaves the
sum to the T > 1 combine fusion below; "slots_last" (`experts_fwd_kernel_down_slots_last`) counts arrivals per
feature block with an acq_rel atomic (counters zeroed by kernel 1), and the last program to arrive sums the routed
partials in slot order, rounds once and adds the shared expert's and the residual, as the fused kernel does.
Kernel 2 at T > 1 (`experts_fwd_kernel_down`), grid (K + 1, D / BD): group g < K walks its T slots, takes
tensor-core dots h·W_down[BD rows]ᵀ over the TP token rows (fp32, rounded to the compute dtype as the reference
rounds each expert's output), scales by each token's routing weight in fp32 and writes a fp32 partial; program row
K writes the shared expert's output. XLA sums the K partials (fp32), rounds once and adds the shared output in the
compute dtype: one small fusion.
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
load) as a chain of FFMAs and scales that sum once (`_lane_sums`): per weight half an E4M3x2 -> f16x2 unpack, one
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
from pallas_kernels.common.pdl import launch_dependents
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2

MAX_TOKENS = 64  # beyond this, ownership checks over T·K ids in every program stop paying: use the reference

# T > 1 gate/up: "dot" (tensor-core dots over the tokens padded to TP rows, orientation `dot_gate_up`: "dot_x"
# x·Wᵀ with the weight tile as the transposed operand, "dot_w" W·xᵀ with it as the left operand) or "fma_tokens"
# (a program's [BI, BK] weight tile, read once, times each real token's slice: T FMA reductions per tile and none
# for the padded rows, which x and h keep; for small T, with the T = 1 path's tiny programs).
VERIFY_GATE_UP_MODES = ("dot", "fma_tokens")
# T = 1 FMA products (gate/up and down): "reduce" each tile's products across the warp into the [1, BI] / [BD]
# accumulator, or "accumulate" them elementwise into a [BI, BW] / [BD, BW] fp32 tile reduced once at the end (an FP8
# tile: each lane's sum of its adjacent weights of a row, scaled, into [BI, BW / G], `_lane_sums`).
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
EVICTION_POLICIES = (None, "evict_first")


def _load(ref, idx, eviction):
    """ref[idx] with an L2 eviction policy (None: the default load)."""
    return ref[idx] if eviction is None else pltriton.load(ref.at[idx], eviction_policy=eviction)


def split_fp8(w):
    """(values, scales) of an expert matrix: an Fp8Weight's E4M3 q and its 128x128 block scales, or a plain array
    (or None, for an absent one) and None."""
    if isinstance(w, fp8.Fp8Weight):
        return w.q, w.scale
    return w, None


def _block_of(start):
    """The 128-wide scale block holding index `start` (an int or a traced non-negative int32)."""
    return start // fp8.BLOCK if isinstance(start, int) else lax.div(start, fp8.BLOCK)


def _load_w(w_ref, scale_ref, lead, rows, cols, eviction):
    """Weight tile w[*lead, rows, cols] (rows, cols: pl.ds) and its scale: plain (scale_ref None) the tile as stored
    and None; FP8 the E4M3 tile as stored and the one float32 scale of the 128x128 block holding it (rows <= 128
    and cols <= 128, each a power of two starting at a multiple of itself: `sub_width`, `check_fp8_rows`), a scalar
    load. The products take the E4M3 values widened exactly and apply the scale to their fp32 sums (`scaled`)."""
    w = _load(w_ref, (*lead, rows, cols), eviction)
    if scale_ref is None:
        return w, None
    return w, scale_ref[(*lead, _block_of(rows.start), _block_of(cols.start))]


def rows_load(ref, lead, n_rows, cols):
    """ref[*lead, 0, cols] repeated over n_rows rows, loaded as one [n_rows, cols.size] tensor (each row's pointers
    the same). Loaded in a weight tile's shape, activations take the tile's register layout (Triton vectorises
    same-shaped loads of one computation alike): each lane loads the values its own weights meet."""
    shape = (n_rows, 1)
    idx = tuple(jnp.full(shape, l, jnp.int32) for l in lead)
    c = cols.start + lax.broadcasted_iota(jnp.int32, (1, cols.size), 1)
    return pltriton.load(ref.at[(*idx, jnp.zeros(shape, jnp.int32), c)])


def scaled(part, scale):
    """An fp32 partial over one scale block's columns times the block's scale (None: a plain weight's, as it is)."""
    return part if scale is None else part * scale


def operand(w, dtype):
    """A weight tile as a dot operand in the activations' dtype: an E4M3 tile widened exactly (its 4 significant
    bits fit bf16 and fp32; through fp32, the fast conversions: E4M3 -> bf16 goes through an f16 -> bf16 convert
    per value on a slower pipe), a plain one as it is (already that dtype)."""
    if jnp.dtype(w.dtype) == jnp.dtype(dtype):
        return w
    return w.astype(jnp.float32).astype(dtype)


# FP8 "accumulate" products (T = 1): a tile's fp32 products summed over the adjacent columns one lane holds (Triton
# gives each lane up to 16 adjacent bytes of an E4M3 tile: one 16-byte load), one chain of FFMAs per lane and row
# with no shuffle, then times the block's scale: one scaling per 16 weights (`_lane_sums`).
LANE_GROUP = 16


def lane_group(rows, cols, lanes):
    """The columns of a [rows, cols] tile that one of `lanes` lanes holds side by side (at most LANE_GROUP)."""
    return max(1, min(LANE_GROUP, cols, rows * cols // lanes))


def _lane_sums(prod, lanes):
    """[R, C] fp32 products -> [R, C / G] sums over G = lane_group adjacent columns, added one after another (a
    reduction would sum them as a tree, half again as many instructions as a chain of FFMAs)."""
    r, c = prod.shape
    g = lane_group(r, c, lanes)
    if g == 1:
        return prod
    parts = jnp.split(prod.reshape(r, c // g, g), g, axis=2)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.reshape(r, c // g)


def sub_width(width, *scales):
    """Columns per weight load of a `width`-column chunk: the chunk, or with an FP8 weight (a scale given) at most
    one 128-wide scale block, a wider chunk then loaded block by block, each load with its own scale."""
    return width if all(s is None for s in scales) else min(width, fp8.BLOCK)


def check_fp8_rows(tuning, field, rows, *scales):
    """A tile of `rows` weight rows must lie in one 128-row scale block when the weight is FP8."""
    if rows > fp8.BLOCK and any(s is not None for s in scales):
        raise ValueError(f"{type(tuning).__name__}.{field}={getattr(tuning, field)} gives tiles of {rows} weight "
                         f"rows; with FP8 weights a tile's rows must lie in one {fp8.BLOCK}-row scale block: use "
                         f"{field} <= {fp8.BLOCK}")


def chunk_loop(n_chunks, width, sub, step, init, unroll=False):
    """fori_loop over n_chunks chunks of `width` columns, each taken as width // sub loads of `sub` columns (one
    step: their loads issued together): step(ks, carry) -> carry, ks a pl.ds of `sub` columns. `unroll`: the
    chunks written out instead, so that the compiler may issue later chunks' loads before earlier chunks' math."""
    def body(c, carry):
        for j in range(width // sub):
            start = c * width + j * sub
            carry = step(pl.ds(start if unroll else pl.multiple_of(start, sub), sub), carry)
        return carry

    if unroll:
        for c in range(n_chunks):
            init = body(c, init)
        return init
    return lax.fori_loop(0, n_chunks, body, init)


def with_optional(kernel, inputs):
    """A pallas_call body and its inputs for `kernel`, whose optional inputs (None in `inputs`) reach it as None
    (static): only the given arrays are passed, the output refs follow the inputs."""
    present = [a is not None for a in inputs]
    n_in = sum(present)

    def body(*refs):
        it = iter(refs[:n_in])
        kernel(*(next(it) if p else None for p in present), *refs[n_in:])

    return body, [a for a in inputs if a is not None]


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


def _dot_nt(a, b):
    """a [M, C] · b [N, C]ᵀ -> [M, N] fp32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _gu_init(mode, bi, to, bw, scale_ref, lanes):
    if mode == "fma_acc" and scale_ref is not None:  # FP8: per-lane sums (_lane_sums)
        return jnp.zeros((bi, bw // lane_group(bi, bw, lanes)), jnp.float32)
    shape = {"fma_reduce": (1, bi), "fma_acc": (bi, bw), "dot_x": (to, bi), "dot_w": (bi, to)}[mode]
    return jnp.zeros(shape, jnp.float32)


def _gu_step(mode, acc, tile, xs, lanes):
    """acc + the products of a [BI, BW] weight tile (tile: (values, scale or None), `_load_w`) with the [TO, BW]
    inputs, an FP8 tile's fp32 sums times its block's scale. T = 1 (one row): fma_reduce reduces them per tile
    into [1, BI]; fma_acc accumulates them elementwise into [BI, BW] (FP8: per-lane sums into [BI, BW / G],
    `_lane_sums` over `lanes` lanes), reduced once by _gu_final."""
    w, scale = tile
    if mode.startswith("fma"):
        prod = w.astype(jnp.float32) * xs.astype(jnp.float32)
        if mode == "fma_reduce":
            return acc + scaled(jnp.sum(prod, axis=1), scale)[None, :]
        return acc + (prod if scale is None else _lane_sums(prod, lanes) * scale)
    w = operand(w, xs.dtype)
    return acc + scaled(_dot_nt(xs, w) if mode == "dot_x" else _dot_nt(w, xs), scale)


def _gu_final(mode, acc):
    """The accumulator as [TO, BI] fp32."""
    if mode == "fma_acc":
        return jnp.sum(acc, axis=1)[None, :]
    return acc.T if mode == "dot_w" else acc


def round_to(a, dtype):
    """fp32 a rounded to dtype, a rounding XLA keeps even where it may drop cast pairs."""
    info = jnp.finfo(dtype)
    return lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(dtype)


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
    return _swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)


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
    return _swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)  # padded rows: SwiGLU(0, 0) = 0


def _down_dot(load_h, load_d, *, BKI, BW, n_chunks, bd, to, dt):
    """T > 1: h·W_downᵀ for BD output features: load_h(ks) -> [TO, BW] activations (TO >= 16 padded token rows),
    load_d(ks) -> ([BD, BW] weight tile, its scale or None) (W_down rows; BW = BKI, or an FP8 weight's 128-wide
    sub-blocks of a BKI chunk); -> [TO, BD] fp32 holding values rounded to dt (the reference rounds each expert's
    output)."""
    def step(ks, acc):
        hs = load_h(ks)
        w, scale = load_d(ks)
        return acc + scaled(_dot_nt(hs, operand(w, hs.dtype)), scale)

    acc = chunk_loop(n_chunks, BKI, BW, step, jnp.zeros((to, bd), jnp.float32))
    return acc.astype(dt).astype(jnp.float32)


def _down_fma(load_h, load_d, *, BKI, n_chunks, dt, lanes, accumulate=False):
    """T = 1: h·W_downᵀ for BD output features by FMAs, the chunks written out (their loads issued together):
    load_h(ks) -> [1, BKI], load_d(ks) -> ([BD, BKI] weight tile, its scale or None); -> [BD] fp32 holding values
    rounded to dt. Each chunk's products are reduced to [BD], or with `accumulate` summed elementwise over the
    chunks (FP8: per-lane sums over the program's `lanes`, `_lane_sums`) and reduced once; an FP8 chunk's fp32
    sums take its scale."""
    acc = None
    for c in range(n_chunks):
        ks = pl.ds(c * BKI, BKI)
        hs = load_h(ks)
        w, scale = load_d(ks)
        prod = w.astype(jnp.float32) * hs.astype(jnp.float32)
        if accumulate:
            part = prod if scale is None else _lane_sums(prod, lanes) * scale
        else:
            part = scaled(jnp.sum(prod, axis=1), scale)
        acc = part if acc is None else acc + part
    if accumulate:
        acc = jnp.sum(acc, axis=1)
    return acc.astype(dt).astype(jnp.float32)


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
    e, owner = _ownership(ids_ref[...], s, n_routed)
    rows = pl.ds(pl.multiple_of(j * bi, bi), bi)

    def compute(load_g, load_u, lim, scales):
        h = _gate_up_rows(x_ref, load_g, load_u, BK=BK, BW=sub_width(BK, *scales), n_chunks=n_chunks, bi=bi, to=to,
                          mode=mode, limit=lim, dt=dt, scales=scales, lanes=lanes, n_tok=n_tok, unroll=unroll)
        h_ref[...] = h if h_ref.dtype == dt else widen_exact(h)

    # One indexer per load (the Triton lowering takes no `ref.at[e][...]` chains).
    @pl.when(owner)
    def _():
        compute(lambda ks: _load_w(wg_ref, wg_scale_ref, (e,), rows, ks, eviction),
                lambda ks: _load_w(wu_ref, wu_scale_ref, (e,), rows, ks, eviction), limit,
                (wg_scale_ref, wu_scale_ref))

    if has_shared:
        @pl.when(s == n_routed)
        def _():
            compute(lambda ks: _load_w(sg_ref, sg_scale_ref, (), rows, ks, None),
                    lambda ks: _load_w(su_ref, su_scale_ref, (), rows, ks, None), shared_limit,
                    (sg_scale_ref, su_scale_ref))


def experts_fwd_kernel_down_t1(h_ref, ids_ref, w_ref, wd_ref, sd_ref, r_ref, wd_scale_ref, sd_scale_ref, y_ref, *,
                               BKI, n_routed, early_launch=False, eviction=None, accumulate=False, lanes=32):
    # T = 1. h_ref [S, 1, I] (after SwiGLU; float32 with an FP8 W_down, `h_dtype`); ids_ref [K] int32; w_ref [K]
    # fp32; wd_ref [E, D, I]; sd_ref [D, I] or None; r_ref [1, D] compute dtype (the residual stream, added last)
    # or None; wd_scale_ref / sd_scale_ref the FP8 weights' block scales [E, ceil(D/128), ceil(I/128)] /
    # [ceil(D/128), ceil(I/128)] or None (plain); y_ref [1, BD] compute dtype: the layer's output for BD features
    if early_launch:
        launch_dependents()
    bd = y_ref.shape[1]
    dt = y_ref.dtype
    i = h_ref.shape[-1]
    feats = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
    ids, wts = ids_ref[...], w_ref[...]

    def expert_out(s, load_d, scale_ref):
        bw = sub_width(BKI, scale_ref)  # FP8: more, 128-wide chunks, still written out
        load_h = ((lambda ks: h_ref[s, :, ks]) if scale_ref is None else
                  (lambda ks: rows_load(h_ref, (s,), bd, ks)))
        return _down_fma(load_h, load_d, BKI=bw, n_chunks=i // bw, dt=dt, lanes=lanes, accumulate=accumulate)

    # The shared expert first: the router prefetched its rows into L2 (0.0-0.3 µs faster than last).
    shared = None if sd_ref is None else expert_out(
        n_routed, lambda ks: _load_w(sd_ref, sd_scale_ref, (), feats, ks, None), sd_scale_ref)
    routed = jnp.zeros((bd,), jnp.float32)
    for s in range(n_routed):  # written out: one slot's loads overlap another's math (a loop would serialise them)
        e, owner = _ownership(ids, s, n_routed)
        w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))  # a repeated id: its owner takes every weight
        out = expert_out(s, lambda ks: _load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction), wd_scale_ref)
        # A non-owner's h rows were never written: masked, not multiplied by 0 (inf · 0 = NaN).
        routed = routed + jnp.where(owner, w_e * out, 0.0)
    y = routed.astype(dt)
    if shared is not None:
        y = y + shared.astype(dt)
    y = y[None, :]
    if r_ref is not None:  # the caller's h + MoE(x), as the model adds it (in dt): no separate add launch
        y = r_ref[:, feats] + y
    y_ref[...] = y


def _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, *, bd, BKI, n_routed,
                  dtype, eviction, accumulate, lanes):
    """The "slots" T = 1 down: program (s, j)'s [1, BD] fp32 partial, passed to store(): slot s's expert output for
    the BD features of block j, rounded to `dtype` and weighted (s = K: the shared expert's, unweighted; 0 for a
    non-owner slot). h_ref [S, TO, I] (TO = 16 after the "dot" gate/up, row 0 the token; `h_dtype`: float32 holding
    `dtype` values with an FP8 W_down); ids_ref / w_ref [K·TO] (the padded rows' ids -1)."""
    s = pl.program_id(0)
    feats = pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)
    i = h_ref.shape[-1]

    def expert_out(slot, load_d, scale_ref):
        bw = sub_width(BKI, scale_ref)
        load_h = ((lambda ks: h_ref[slot, pl.ds(0, 1), ks]) if scale_ref is None else  # the token's row
                  (lambda ks: rows_load(h_ref, (slot,), bd, ks)))
        # Every weight tile of the program is loaded before the first product, and a CTA barrier keeps ptxas from
        # sinking the loads to their products (it would issue one tile, wait, compute, issue the next).
        tiles = [load_d(pl.ds(c * bw, bw)) for c in range(i // bw)]
        if not interpret_mode():
            pltriton.debug_barrier()
        return _down_fma(load_h, lambda ks: tiles[ks.start // bw], BKI=bw, n_chunks=i // bw, dt=dtype, lanes=lanes,
                         accumulate=accumulate)

    @pl.when(s < n_routed)
    def _():
        ids, wts = ids_ref[...], w_ref[...]
        e, owner = _ownership(ids, s, n_routed)
        w_e = jnp.sum(jnp.where(ids == e, wts, 0.0))  # a repeated id: its owner takes every weight

        @pl.when(owner)
        def _():
            out = expert_out(s, lambda ks: _load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction), wd_scale_ref)
            store((w_e * out)[None, :])

        @pl.when(jnp.logical_not(owner))
        def _():
            store(jnp.zeros((1, bd), jnp.float32))

    if sd_ref is not None:
        @pl.when(s == n_routed)
        def _():
            out = expert_out(n_routed, lambda ks: _load_w(sd_ref, sd_scale_ref, (), feats, ks, None), sd_scale_ref)
            store(out[None, :])


def experts_fwd_kernel_down_slots(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, o_ref, *,
                                  early_launch=False, **kw):
    # T = 1, down_t1="slots": o_ref [1, BD] fp32, program (s, j)'s partial (`_slot_partial`), summed by `combine`
    if early_launch:
        launch_dependents()

    def store(v):
        o_ref[...] = v

    _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, bd=o_ref.shape[1], **kw)


def experts_fwd_kernel_down_slots_last(h_ref, ids_ref, w_ref, wd_ref, sd_ref, r_ref, wd_scale_ref, sd_scale_ref,
                                       count_in_ref, p_ref, y_ref, count_ref, *, bd, n_slots, early_launch=False,
                                       **kw):
    # T = 1, down_t1="slots_last": p_ref [S, 1, D] fp32 (whole; program (s, j) writes its partial, `_slot_partial`);
    # count_ref [C] int32, zeroed by the gate/up launch (count_in_ref, the same buffer); y_ref [1, BD] compute dtype:
    # the layer's output for block j, written by the block's last program to finish, which sums the partials in slot
    # order, as the "fused" kernel does, and adds the shared expert's and the residual (r_ref [1, D] or None)
    del count_in_ref
    if early_launch:
        launch_dependents()
    s, j = pl.program_id(0), pl.program_id(1)
    feats = pl.ds(pl.multiple_of(j * bd, bd), bd)
    n_routed = kw["n_routed"]

    def store(v):
        p_ref[s, :, feats] = v

    _slot_partial(h_ref, ids_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, store, bd=bd, **kw)
    # Every thread's partial is stored before one thread's release (the atomic, acq_rel at GPU scope) publishes it.
    if not interpret_mode():
        pltriton.debug_barrier()
    arrived = pltriton.atomic_add(count_ref, (j,), jnp.int32(1))

    @pl.when(arrived == n_slots - 1)
    def _():
        # Volatile: from L2, where the other programs' partials are (the atomic's acquire orders these loads after
        # it; its result reaches every thread through a barrier).
        part = lambda slot: pltriton.load(p_ref.at[jnp.int32(slot), :, feats], volatile=True)  # noqa: E731
        routed = part(0)
        for slot in range(1, n_routed):
            routed = routed + part(slot)
        y = routed.astype(y_ref.dtype)
        if sd_ref is not None:
            y = y + part(n_routed).astype(y_ref.dtype)
        if r_ref is not None:
            y = r_ref[:, feats] + y
        y_ref[...] = y


def experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, wd_scale_ref, sd_scale_ref, o_ref, *,
                            BKI, n_chunks, n_routed, group, n_groups, early_launch=False, eviction=None):
    # T > 1. h_ref [S, TO, I] (after SwiGLU); ids_ref [P]; ids2_ref [TO, K]; w_ref [TO, K] fp32; wd_ref [E, D, I];
    # sd_ref [D, I] or None; wd_scale_ref / sd_scale_ref the FP8 block scales or None (plain); o_ref [TO, BD]
    # fp32: partial of group g (g = NG: the shared expert)
    if early_launch:
        launch_dependents()
    g, i_d = pl.program_id(0), pl.program_id(1)
    to, bd = o_ref.shape
    dt = h_ref.dtype
    feats = pl.ds(pl.multiple_of(i_d * bd, bd), bd)

    def expert_out(s, load_d, scale_ref):
        return _down_dot(lambda ks: h_ref[s, :, ks], load_d, BKI=BKI, BW=sub_width(BKI, scale_ref),
                         n_chunks=n_chunks, bd=bd, to=to, dt=dt)

    @pl.when(g < n_groups)
    def _():
        ids_flat, ids2, wts = ids_ref[...], ids2_ref[...], w_ref[...]

        def slot(s, acc):
            e, owner = _ownership(ids_flat, s, n_routed)

            def add(acc):
                hit = ids2 == e  # [TO, K]; a token that lists e twice gets both weights
                w_tok = jnp.sum(jnp.where(hit, wts, 0.0), axis=1)  # [TO]
                used = jnp.sum(jnp.where(hit, 1, 0), axis=1) > 0
                out = expert_out(s, lambda ks: _load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction),
                                 wd_scale_ref)
                # Rows of tokens that did not choose e are masked, not multiplied by 0 (inf · 0 = NaN).
                return acc + jnp.where(used[:, None], w_tok[:, None] * out, 0.0)

            return lax.cond(owner, add, lambda a: a, acc)

        lo = g * group
        hi = jnp.minimum(lo + group, n_routed)
        o_ref[...] = lax.fori_loop(lo, hi, slot, jnp.zeros((to, bd), jnp.float32))

    if sd_ref is not None:
        @pl.when(g == n_groups)
        def _():
            o_ref[...] = expert_out(n_routed, lambda ks: _load_w(sd_ref, sd_scale_ref, (), feats, ks, None),
                                    sd_scale_ref)


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
    if n == 1 and tuning.down_t1 == "slots_last":  # the down kernel's counters, one per feature block
        out_specs.append(pl.no_block_spec)
        out_shape.append(jax.ShapeDtypeStruct((next_pow2(d // min(tuning.block_d, d & -d)),), jnp.int32))
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


def widen_exact(a):
    """A bf16 array as float32 through its bit pattern (the same values). A bare convert would do on the GPU, but
    the interpreter runs the kernel through XLA, which may fuse it with the rounding before it (excess precision)
    and store the unrounded value."""
    bits = lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


def h_dtype(n, dt, *downs):
    """The dtype of kernel 1's output h: the compute dtype dt, or at T = 1 with an FP8 down matrix float32 holding
    the same dt values, so that the T = 1 down kernel's FMAs take them as loaded: each lane's E4M3 row segment meets
    its own h values, and a bf16 h widened in registers took 5.0 SASS instructions per down weight against 3.6."""
    fp8_down = any(isinstance(w, fp8.Fp8Weight) for w in downs)
    return jnp.float32 if n == 1 and fp8_down and jnp.dtype(dt) == jnp.bfloat16 else dt


def down_and_combine(h, ids, weights, we_down, ws_down, *, n, tuning: ExpertsTuning, residual=None, dtype=None,
                     count=None):
    """Kernel 2 and the combine: h [S, TO, I] after SwiGLU (slots as in kernel 1; `h_dtype`), ids/weights [TO, K]
    (padded rows -1 / 0), we_down [E, D, I], ws_down [D, I] or None (each a plain array or an Fp8Weight), residual
    [n, D] or None -> y [TO, D] in `dtype` (the compute dtype; None: h's) plus the residual (at T = 1 inside the
    down kernel, at T > 1 in the combine fusion)."""
    dtype = h.dtype if dtype is None else dtype
    to, k = ids.shape
    _, d, i = we_down.shape
    has_shared = ws_down is not None
    if h.shape[0] != n * k + int(has_shared):
        raise ValueError(f"h has {h.shape[0]} slots; T·K = {n * k} routed slots" +
                         (" + 1 shared (ws_down given)" if has_shared else " (no ws_down: no shared slot)"))
    (wd, wd_s), (sd, sd_s) = split_fp8(we_down), split_fp8(ws_down)
    bd = min(tuning.block_d, d & -d)
    bki = min(tuning.block_ki, i & -i)
    check_fp8_rows(tuning, "block_d", bd, wd_s, sd_s)
    if n == 1 and tuning.down_t1 == "fused":
        return _down_t1(h, ids, weights, (wd, wd_s), (sd, sd_s), residual, bd=bd, bki=bki, tuning=tuning,
                        dtype=dtype)
    if n == 1 and tuning.down_t1 == "slots_last":
        if count is None or count.shape != (next_pow2(d // bd),):
            raise ValueError(f"down_t1='slots_last' needs the zeroed int32 counters [{next_pow2(d // bd)}] the gate/up "
                             "launch writes (count)")
        return _down_slots_last(h, ids, weights, (wd, wd_s), (sd, sd_s), residual, count, bd=bd, bki=bki,
                                tuning=tuning, dtype=dtype)
    if n == 1:
        partials = _down_slots(h, ids, weights, (wd, wd_s), (sd, sd_s), bd=bd, bki=bki, tuning=tuning, dtype=dtype)
        return combine(partials, k, has_shared, dtype, residual)
    if bd < 16:
        raise ValueError(f"ExpertsTuning.block_d={tuning.block_d} at T={n}: the T > 1 down kernel's tensor-core dots "
                         "need >= 16 output features per program (block_d >= 16; VERIFY_TUNING has 64)")
    n_routed = n * k
    n_groups = k  # slot groups of T slots each
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_routed=n_routed, group=n,
                          n_groups=n_groups, early_launch=tuning.early_launch_down, eviction=tuning.routed_eviction),
        [h, ids.reshape(-1), ids, weights, wd, sd, wd_s, sd_s])
    partials = pl.pallas_call(
        kernel,
        grid=(n_groups + int(has_shared), d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((None, to, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_groups + int(has_shared), to, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down",
    )(*inputs)
    if residual is not None:
        residual = jnp.pad(residual, ((0, to - n), (0, 0)))
    return combine(partials, n_groups, has_shared, dtype, residual)


def combine(partials, n_groups, has_shared, dtype, residual=None):
    """One XLA fusion: the fp32 sum of the routed experts' weighted partials [n_groups, TO, D] rounded once, plus the
    shared expert's output (partials[n_groups]) and the residual [TO, D] in the compute dtype."""
    # A reduce_precision, which XLA keeps where it may drop a bare cast feeding the next add (excess precision, its
    # default), moving bf16 outputs by 2.6e-3 at D 256, I 192.
    y = round_to(jnp.sum(partials[:n_groups], axis=0), dtype)
    if has_shared:
        y = y + partials[n_groups].astype(dtype)  # compute-dtype add of the shared expert
    if residual is not None:
        y = residual + y
    return y


def _down_t1(h, ids, weights, routed, shared, residual, *, bd, bki, tuning, dtype):
    """T = 1: down, weighted combine, the shared expert and the residual add in one launch -> y [1, D] in `dtype`.
    routed / shared: (values, scales or None) of W_down, shared (None, None) without the shared expert."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    kernel, inputs = with_optional(  # absent optional inputs reach the kernel as None (static)
        functools.partial(experts_fwd_kernel_down_t1, BKI=bki, n_routed=k, early_launch=tuning.early_launch_down,
                          eviction=tuning.routed_eviction, accumulate=tuning.t1_products == "accumulate",
                          lanes=32 * tuning.warps_down),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, residual, wd_s, sd_s])
    return pl.pallas_call(
        kernel,
        grid=(d // bd,),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, d), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_t1",
    )(*inputs)


def _down_slots(h, ids, weights, routed, shared, *, bd, bki, tuning, dtype):
    """T = 1, down_t1="slots": one program per (slot, BD features), each over all of I -> fp32 partials
    [K (+ 1 shared), 1, D] for `combine`."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    n_slots = k + int(sd is not None)
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down_slots, **_slots_kw(k, bki, tuning, dtype)),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, wd_s, sd_s])
    return pl.pallas_call(
        kernel,
        grid=(n_slots, d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((None, 1, bd), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_slots, 1, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_slots",
    )(*inputs)


def _slots_kw(k, bki, tuning, dtype):
    return dict(BKI=bki, n_routed=k, dtype=jnp.dtype(dtype), early_launch=tuning.early_launch_down,
                eviction=tuning.routed_eviction, accumulate=tuning.t1_products == "accumulate",
                lanes=32 * tuning.warps_down)


def _down_slots_last(h, ids, weights, routed, shared, residual, count, *, bd, bki, tuning, dtype):
    """T = 1, down_t1="slots_last": the "slots" programs, each feature block's last one combining -> y [1, D]."""
    k = ids.shape[1]
    (wd, wd_s), (sd, sd_s) = routed, shared
    d = wd.shape[1]
    n_slots = k + int(sd is not None)
    kernel, inputs = with_optional(
        functools.partial(experts_fwd_kernel_down_slots_last, bd=bd, n_slots=n_slots,
                          **_slots_kw(k, bki, tuning, dtype)),
        [h, ids.reshape(-1), weights.reshape(-1), wd, sd, residual, wd_s, sd_s, count])
    _, y, _ = pl.pallas_call(
        kernel,
        grid=(n_slots, d // bd),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=[pl.no_block_spec, pl.BlockSpec((1, bd), lambda s, j: (0, j)), pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((n_slots, 1, d), jnp.float32), jax.ShapeDtypeStruct((1, d), dtype),
                   jax.ShapeDtypeStruct(count.shape, jnp.int32)],
        input_output_aliases={len(inputs) - 1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=1),
        interpret=interpret_mode(),
        name="experts_fwd_kernel_down_slots_last",
    )(*inputs)
    return y


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: ExpertsTuning | None = None, residual=None):
    """Same contract as `reference.moe_experts` (+ `residual`, added last; any expert matrix plain or an OUT_IN
    Fp8Weight); shapes already validated by the dispatcher."""
    return moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                             shared_limit=shared_limit, tuning=tuning, residual=residual)
