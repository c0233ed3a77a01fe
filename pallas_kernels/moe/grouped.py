"""Pallas-Triton routed SwiGLU experts for many tokens (prefill): a grouped GEMM over the (token, expert) pairs
sorted by expert, plus the shared expert and the combine in XLA.

Layout (ling_jax/params.py): every expert matrix is stored as torch stores it, [out, in]: gate/up [E, I, D], down
[E, D, I]. Each product takes a weight tile [BN, BK] as it lies and contracts its `in` axis in place (a
transposed-operand tensor-core dot), so no transposed or per-token copy of the stacked weights is ever made.

Tiles (`tile_table`, XLA on the device, no host read): the P = N·K pairs (pair n·K + k: token n's k-th choice) are
sorted by expert (a stable argsort of the ids, so an expert's pairs keep token order), each expert's group is padded
to a multiple of BM rows and the padded rows are cut into tiles of BM rows, each one expert's. `rows[q]` is the pair
at padded row q (P: padding), `tile_expert[t]` tile t's expert (-1: past the real tiles). The grid is static, the
bound on the tile count (P + min(E, P)·(BM - 1)) // BM; tiles past the real ones exit at once, and an expert without
tokens has no tile.

Kernel 1 (`grouped_fwd_kernel_gate_up`), grid (I / BN, tiles): program (j, t) gathers the x rows of tile t's tokens
(masked past the group's end: zero rows, no bytes read), walks D in BK steps with two tensor-core dots against the
expert's gate and up rows [BN, BK], accumulates in fp32 and rounds as the reference does: g and u rounded to the
compute dtype, SiLU in fp32 rounded, the optional clamp min(silu(g), L)·clip(u, -L, L), the product rounded. Output
h [tiles·BM, I] in tile order (padding rows: SwiGLU(0, 0) = 0).
Kernel 2 (`grouped_fwd_kernel_down`), grid (D / BD, tiles): h's tile rows · W_down[e] [BD, BKI]ᵀ over I in BKI steps,
fp32, rounded to the compute dtype as the reference rounds each expert's output, and scattered to the tile's pairs'
rows of out [P + 1, D] (pair order). Padding rows point at row P and are masked: never written on a GPU; in interpret
mode a masked scatter writes back what it read, so they must not share a row with a real pair.
Combine (XLA, as the reference): fp32 contributions out·weight, summed over k in k order ([N, K, D] in pair order),
rounded once; then the shared expert (reference.expert_mlp: one dense GEMM per matrix) and the optional residual,
added in the compute dtype.

Grid order: the feature blocks are the fastest axis (CUDA launches blockIdx.x first), so the programs of one tile run
together and all but the first can find its gathered x rows (kernel 1) or its h rows (kernel 2) in L2; an expert's
tiles are adjacent, so its tiles read its weight rows at about the same time, for one read from HBM. At Flash size
(D 2560, I 768, E 512, top-8) and 8192 tokens a layer's routed weights are 6.0 GB (1.4 ms at 4.3 TB/s) for 773 GFLOP
of real products: both bounds matter. Padding costs products, not bytes: about E·BM/2 rows, at BM 64 25% more
products at 8192 tokens and about twice the real ones at 2048.

FP8 (any expert matrix an OUT_IN `fp8.Fp8Weight`, each on its own): the weight is never rounded to the compute
dtype (experts.py's FP8 numerics). Each E4M3 tile is widened exactly to the activations' dtype (bf16 holds its 4
significant bits) for the same tensor-core dot, whose fp32 result over the tile's columns, all in one 128-wide
scale block, is multiplied by that block's scale: the reference's fp32-weight products up to fp32 rounding and
summation order. A chunk wider than 128 is taken as 128-wide sub-blocks with one scale each, and a tile's rows
(BN, BD <= 128) lie in one scale block. An FP8 shared expert runs on the same two kernels as a one-expert stack
(`shared_expert`): XLA would need fp32 GEMMs for these numerics; a plain one stays XLA's (reference.expert_mlp). At
Flash size the defaults with FP8 weights compile (venv Triton, sm_90) to gate/up 144 registers and 64 KiB of shared
memory, down 160 and 56 KiB, no spills, Hopper's warpgroup MMA: two programs still fit an SM, so DEFAULT_TUNING
serves both; the weights' bytes halve (3.0 GB per layer), the products do not.
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
from pallas_kernels.common.sizes import check_pow2_fields
from pallas_kernels.moe import reference
# The decode kernels' tile helpers: the fp32-accumulated transposed-operand dot, the reference's SwiGLU rounding, a
# weight tile's load (optional L2 eviction policy; FP8: the E4M3 tile and its block's scale), an E4M3 tile as a dot
# operand and its block's scaling, the chunk loop of FP8 sub-blocks and the combine's rounding.
from pallas_kernels.moe.tiles import (EVICTION_POLICIES, check_fp8_rows, chunk_loop, dot_nt, load_w, operand, round_to,
                                      scaled, split_fp8, sub_width, swiglu, with_optional)


@dataclasses.dataclass(frozen=True)
class GroupedTuning:
    # Defaults: one warpgroup per program over 64-row tiles (Hopper's warpgroup MMA is 64 rows), sized so that two
    # programs fit an SM: at Flash size the venv Triton's sm_90 compile (experiments/triton_resources.py's proxy)
    # gives gate/up 128 registers and 96 KiB of shared memory, down 145 and 72 KiB (gate/up with BN 128: 255
    # registers). experiments/bench_moe_prefill.py --sweep ranks the alternatives on the GPU.
    block_m: int = 64  # BM: pair rows per tile (both kernels: h is laid out in these tiles)
    block_i: int = 64  # BN: intermediate columns per gate/up program (capped at I's largest power-of-two divisor)
    block_k: int = 64  # BK: hidden-dim chunk per gate/up step (capped at D's)
    block_d: int = 128  # BD: output features per down program (capped at D's)
    block_ki: int = 64  # BKI: intermediate chunk per down step (capped at I's)
    warps_gate_up: int = 4
    stages_gate_up: int = 4
    warps_down: int = 4
    stages_down: int = 3
    # L2 eviction policy of the routed weights' loads (None: the default). An expert's weight rows are read by its
    # few adjacent tiles and then never again in the layer; x rows are read by every expert a token chose.
    weight_eviction: str | None = None

    def __post_init__(self):
        check_pow2_fields(self, ("block_m", "block_i", "block_k", "block_d", "block_ki"), 16)  # dot operand sides
        check_pow2_fields(self, ("warps_gate_up", "warps_down"))
        for name in ("stages_gate_up", "stages_down"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GroupedTuning.{name}={v} must be an int >= 1")
        if self.weight_eviction not in EVICTION_POLICIES:
            raise ValueError(f"GroupedTuning.weight_eviction={self.weight_eviction!r} must be one of "
                             f"{EVICTION_POLICIES}")


DEFAULT_TUNING = GroupedTuning()


def max_tiles(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Static bound on the tile count: sum over the non-empty experts (at most min(E, P)) of ceil(size / BM)."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


def tile_table(ids, n_experts: int, block_m: int):
    """ids [N, K] int32 in [0, E) -> (rows [T·BM] int32: the pair n·K + k at each padded row, P = N·K for padding;
    tile_expert [T] int32: each tile's expert, -1 past the real tiles), T = max_tiles(P, E, BM)."""
    p = ids.size
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted position -> pair
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    first_row = (tile_end - tiles) * block_m  # each expert's first padded row
    group_start = jnp.cumsum(sizes) - sizes  # each expert's first sorted position
    e_sorted = flat[order]
    pos = first_row[e_sorted] + jnp.arange(p, dtype=jnp.int32) - group_start[e_sorted]
    n_tiles = max_tiles(p, n_experts, block_m)
    rows = jnp.full((n_tiles * block_m,), p, jnp.int32).at[pos].set(order, unique_indices=True)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    # Tile t belongs to the expert whose tile range holds it (experts without tokens have empty ranges).
    expert = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    return rows, jnp.where(t < tile_end[-1], expert, -1)


def _product(a, tile):
    """a [BM, C] · the weight tile [BN, C]ᵀ (tile: (values, scale or None), `load_w`) -> [BM, BN] fp32 on the
    tensor cores in a's dtype: an E4M3 tile widened exactly, its fp32 dot times its block's scale."""
    w, scale = tile
    return scaled(dot_nt(a, operand(w, a.dtype)), scale)


def grouped_fwd_kernel_gate_up(te_ref, rows_ref, x_ref, wg_ref, wu_ref, wg_scale_ref, wu_scale_ref, h_ref, *, BK,
                               n_chunks, top_k, n_pairs, limit, eviction):
    # te_ref [T] int32; rows_ref [T·BM] int32; x_ref [N, D]; wg_ref/wu_ref [E, I, D]; wg_scale_ref/wu_scale_ref the
    # FP8 block scales [E, ceil(I/128), ceil(D/128)] or None (plain); h_ref [BM, BN]: tile t's rows, intermediate
    # block j, after SwiGLU, compute dtype
    j, t = pl.program_id(0), pl.program_id(1)
    bm, bn = h_ref.shape
    dt = h_ref.dtype
    e = te_ref[t]

    @pl.when(e >= 0)
    def _():
        pairs = rows_ref[pl.ds(pl.multiple_of(t * bm, bm), bm)]
        valid = (pairs < n_pairs)[:, None]
        tok = jnp.where(valid, lax.div(pairs[:, None], top_k), 0)  # [BM, 1]; pairs >= 0: truncation is floor
        feats = pl.ds(pl.multiple_of(j * bn, bn), bn)

        def step(ks, carry):
            # A gather: whole-array indices (the interpreter takes no mix of index arrays and slices).
            cols = ks.start + lax.broadcasted_iota(jnp.int32, (1, ks.size), 1)
            xs = pltriton.load(x_ref.at[tok, cols], mask=valid, other=0)
            return (carry[0] + _product(xs, load_w(wg_ref, wg_scale_ref, (e,), feats, ks, eviction)),
                    carry[1] + _product(xs, load_w(wu_ref, wu_scale_ref, (e,), feats, ks, eviction)))

        init = jnp.zeros((bm, bn), jnp.float32)
        acc_g, acc_u = chunk_loop(n_chunks, BK, sub_width(BK, wg_scale_ref, wu_scale_ref), step, (init, init))
        h_ref[...] = swiglu(acc_g.astype(dt), acc_u.astype(dt), limit)


def grouped_fwd_kernel_down(te_ref, rows_ref, h_ref, wd_ref, wd_scale_ref, o_ref, *, BKI, n_chunks, n_pairs,
                            block_m, block_d, eviction):
    # te_ref [T] int32; rows_ref [T·BM] int32; h_ref [T·BM, I] compute dtype; wd_ref [E, D, I]; wd_scale_ref the
    # FP8 block scales [E, ceil(D/128), ceil(I/128)] or None (plain); o_ref [P + 1, D]: program (j, t) writes
    # feature block j of tile t's pairs' rows
    j, t = pl.program_id(0), pl.program_id(1)
    e = te_ref[t]

    @pl.when(e >= 0)
    def _():
        tile = pl.ds(pl.multiple_of(t * block_m, block_m), block_m)
        feats = pl.ds(pl.multiple_of(j * block_d, block_d), block_d)

        def step(ks, acc):
            w = load_w(wd_ref, wd_scale_ref, (e,), feats, ks, eviction)
            return acc + _product(h_ref[tile, ks], w)

        acc = chunk_loop(n_chunks, BKI, sub_width(BKI, wd_scale_ref), step,
                         jnp.zeros((block_m, block_d), jnp.float32))
        pairs = rows_ref[tile][:, None]  # padding: row P, masked
        cols = pl.multiple_of(j * block_d, block_d) + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
        pltriton.store(o_ref.at[pairs, cols], acc.astype(o_ref.dtype), mask=pairs < n_pairs)


def _check_sizes(d, i, tuning):
    if min(d & -d, i & -i) < 16:
        raise ValueError(f"the grouped MoE kernel needs D={d} and I={i} divisible by 16 (tensor-core dot tiles)")
    return (min(tuning.block_i, i & -i), min(tuning.block_k, d & -d), min(tuning.block_d, d & -d),
            min(tuning.block_ki, i & -i))


def routed_pairs(x, ids, we_gate, we_up, we_down, *, limit, tuning: GroupedTuning):
    """Kernels 1 and 2: x [N, D], ids [N, K] -> out [P + 1, D] in x's dtype, row n·K + k the output of token n's k-th
    expert (rounded to the compute dtype; row P: scratch for the padding rows). Each expert matrix is a plain array
    or an OUT_IN Fp8Weight."""
    n, d = x.shape
    k = ids.shape[1]
    e, i, _ = we_gate.shape
    p = n * k
    bn, bk, bd, bki = _check_sizes(d, i, tuning)
    (wg, wg_s), (wu, wu_s), (wd, wd_s) = (split_fp8(w) for w in (we_gate, we_up, we_down))
    check_fp8_rows(tuning, "block_i", bn, wg_s, wu_s)
    check_fp8_rows(tuning, "block_d", bd, wd_s)
    bm = tuning.block_m
    rows, tile_expert = tile_table(ids, e, bm)
    n_tiles = tile_expert.shape[0]
    kernel, inputs = with_optional(
        functools.partial(grouped_fwd_kernel_gate_up, BK=bk, n_chunks=d // bk, top_k=k, n_pairs=p, limit=limit,
                          eviction=tuning.weight_eviction),
        [tile_expert, rows, x, wg, wu, wg_s, wu_s])
    h = pl.pallas_call(
        kernel,
        grid=(i // bn, n_tiles),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.BlockSpec((bm, bn), lambda j, t: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        interpret=interpret_mode(),
        name="grouped_fwd_kernel_gate_up",
    )(*inputs)
    kernel, inputs = with_optional(
        functools.partial(grouped_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_pairs=p, block_m=bm, block_d=bd,
                          eviction=tuning.weight_eviction),
        [tile_expert, rows, h, wd, wd_s])
    return pl.pallas_call(
        kernel,
        grid=(d // bd, n_tiles),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((p + 1, d), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret_mode(),
        name="grouped_fwd_kernel_down",
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "tuning"))
def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: GroupedTuning | None = None, residual=None):
    """Same contract as `reference.moe_experts` (+ `residual`, added last; any expert matrix plain or an OUT_IN
    Fp8Weight), any N; shapes already validated by the dispatcher. `tuning` None: DEFAULT_TUNING."""
    tuning = tuning or DEFAULT_TUNING
    n, d = x.shape
    k = ids.shape[1]
    out = routed_pairs(x, ids, we_gate, we_up, we_down, limit=limit, tuning=tuning)
    # The reference's combine: fp32 contributions summed over k in k order, rounded once. The rounding is a
    # reduce_precision: a bare cast feeding the shared expert's add is dropped where XLA allows excess precision
    # (its default), which moved bf16 outputs by 2.9e-3 against the reference's order of roundings.
    contrib = out[:n * k].reshape(n, k, d).astype(jnp.float32) * weights.astype(jnp.float32)[:, :, None]
    y = round_to(contrib.sum(1), x.dtype)
    if ws_gate is not None:
        y = y + shared_expert(x, ws_gate, ws_up, ws_down, limit=shared_limit, tuning=tuning)
    return y if residual is None else residual + y


def shared_expert(x, ws_gate, ws_up, ws_down, *, limit, tuning: GroupedTuning):
    """The shared expert of every token, [N, D] in x's dtype (reference.expert_mlp's values). All three matrices
    plain: XLA's dense GEMMs (reference.expert_mlp). Any of them FP8: the grouped kernels over a one-expert stack
    (each token one pair), whose FP8 products are bf16 tensor-core dots per 128-wide block scaled in fp32; XLA
    would need fp32 GEMMs for those numerics (precision HIGHEST, the reference's)."""
    if not any(isinstance(w, fp8.Fp8Weight) for w in (ws_gate, ws_up, ws_down)):
        return reference.expert_mlp(x, ws_gate, ws_up, ws_down, limit)

    def stack(w):  # [out, in] -> [1, out, in], a free reshape (an Fp8Weight's scales with it)
        return fp8.Fp8Weight(w.q[None], w.scale[None], w.layout) if isinstance(w, fp8.Fp8Weight) else w[None]

    n = x.shape[0]
    ids = jnp.zeros((n, 1), jnp.int32)
    return routed_pairs(x, ids, stack(ws_gate), stack(ws_up), stack(ws_down), limit=limit, tuning=tuning)[:n]
