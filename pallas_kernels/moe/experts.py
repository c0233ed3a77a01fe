"""Pallas-Triton routed + shared SwiGLU experts for small T (decode, verify): each selected expert read once.

Slots: the T·K (token, k) pairs in row-major order, plus the shared expert. A routed slot *owns* its expert when
no earlier slot chose the same expert; only owners do work, and an owner computes its expert for every token (its
rows are masked by the routing weights later). Each distinct expert is read once with no argsort/bincount/
ragged_dot: ownership is one vector compare over the ids, repeated in every program.

Kernel 1 (`experts_fwd_kernel_gate_up`), grid (S, I / BI): owner slot s streams gate and up [D, BI] in [BK, BI]
tiles into `dot`s (fp32 accumulate) over TP token rows, rounds to the compute dtype, applies SwiGLU (+ post-SiLU
clamp) and writes h[s, :, BI-block]. Non-owner programs exit at once; their h rows stay unwritten and unread.
Kernel 2 (`experts_fwd_kernel_down`), grid (NG + 1, D / BD): group g < NG walks its T slots (NG = K groups), takes
h·W_down for BD output columns (fp32, rounded to the compute dtype as the reference rounds each expert's output),
scales by each token's routing weight in fp32 and writes a fp32 partial; program row NG writes the shared expert's
output. XLA sums the NG partials (fp32), rounds once and adds the shared output in the compute dtype: one small
fusion that can join the caller's residual add. Splitting the down projection over slot groups gives
(K + 1)·D/BD programs, enough loads in flight to stream at HBM rate (one program per D block was latency-bound).

Tunings (ExpertsTuning; the defaults keep the path above; measured no faster on the H200): `k_splits` KS > 1 splits gate/up over D too
(grid (S, I / BI, KS), fp32 partial gate and up written per split; the down kernel sums them, rounds and applies
SwiGLU on load), so wide BI blocks (long contiguous row segments) still give enough programs; only for T <=
`split_max_tokens`. `down_splits` KSD > 1 (T = 1 only) splits the down projection over I: grid (K + 1, D / BD,
KSD), slot g is expert ids[g] (one token's top-k ids), unweighted fp32 partials; XLA sums them, rounds each
expert's output, weights in fp32 and adds the shared expert (one small fusion).

Rows: tokens are padded to TP = max(16, 2^⌈log2 T⌉) rows so that every product is a tensor-core `dot` whose weight
loads Triton pipelines (num_stages); at T = 1 the single row is broadcast in-kernel (no XLA pad).
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
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2

MAX_TOKENS = 64  # beyond this, ownership checks over T·K ids in every program stop paying: use the reference


@dataclasses.dataclass(frozen=True)
class ExpertsTuning:
    block_i: int = 32  # BI: intermediate columns per gate/up program
    block_k: int = 128  # BK: hidden-dim chunk per gate/up step
    # Defaults: best of the H200 sweep in experiments/RESULTS.md (block_d 64: 48.1 µs vs 55.0 µs at block_d 32).
    block_d: int = 64  # BD: output columns per down program
    block_ki: int = 128  # BKI: intermediate chunk per down step (capped at the largest power of two dividing I)
    # KS > 1: gate/up split over D into KS programs per (slot, I block) writing fp32 partials; the down kernel
    # sums them, rounds and applies SwiGLU on load (more, shorter programs: a fuller machine at T = 1).
    # k_splits and down_splits are upper bounds: each is halved until D / KS (I / KSD) is a multiple of 16.
    k_splits: int = 1
    split_max_tokens: int = 4  # T above this: no split (the fp32 partials grow with T·KS)
    # T = 1 only: down projection split over I into KSD programs per (slot, D block), unweighted fp32 partials;
    # XLA sums them, rounds each expert's output and applies the routing weights (one small fusion).
    down_splits: int = 1
    warps_gate_up: int = 4
    stages_gate_up: int = 3
    warps_down: int = 4
    stages_down: int = 3

    def __post_init__(self):
        check_pow2_fields(self, ("block_i", "block_k", "block_d", "block_ki"), 16)
        check_pow2_fields(self, ("k_splits", "down_splits"))
        if self.split_max_tokens < 1:
            raise ValueError(f"ExpertsTuning.split_max_tokens={self.split_max_tokens} must be >= 1")


def _dot(a, b):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


def _swiglu(g, u, limit):
    # g, u [TP, BI] compute dtype; SiLU in fp32 rounded, clamp and product in the compute dtype (reference.swiglu).
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


def _row0(v):
    """[TP, N] -> [1, N]: row 0 (T = 1 broadcasts its single token to TP rows)."""
    rows = lax.iota(jnp.int32, v.shape[0])
    return jnp.sum(jnp.where((rows == 0)[:, None], v, jnp.zeros_like(v)), axis=0)[None, :]


def experts_fwd_kernel_gate_up(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, *, BK, BI, n_chunks, n_routed,
                               limit, shared_limit, has_shared, split):
    # x_ref [T or TP, D]; ids_ref [P] int32; wg_ref/wu_ref [E, D, I]; sg_ref/su_ref [D, I];
    # split = False: h_ref [TP, BI] (slot s, compute dtype, after SwiGLU);
    # split = True: h_ref [2, TO, BI] fp32 partial gate and up of slot s over D split pl.program_id(2).
    s, i_i = pl.program_id(0), pl.program_id(1)
    tp = h_ref.shape[0] if not split else max(16, x_ref.shape[0])
    e, owner = _ownership(ids_ref[...], s, n_routed)
    cols = pl.ds(pl.multiple_of(i_i * BI, BI), BI)
    o_split = pl.program_id(2) * (n_chunks * BK) if split else 0

    def compute(load_g, load_u, lim):
        def body(c, carry):
            acc_g, acc_u = carry
            ks = pl.ds(pl.multiple_of(o_split + c * BK, BK), BK)
            b_x = jnp.broadcast_to(x_ref[:, ks], (tp, BK))  # [TP, BK]; T = 1: the one row, repeated
            return acc_g + _dot(b_x, load_g(ks)), acc_u + _dot(b_x, load_u(ks))

        zeros = jnp.zeros((tp, BI), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, n_chunks, body, (zeros, zeros))
        if split:
            to = h_ref.shape[1]
            h_ref[0, :, :] = acc_g if to == tp else _row0(acc_g)
            h_ref[1, :, :] = acc_u if to == tp else _row0(acc_u)
            return
        dt = h_ref.dtype
        h_ref[...] = _swiglu(acc_g.astype(dt), acc_u.astype(dt), lim)

    # One indexer per load (the Triton lowering takes no `ref.at[e][...]` chains).
    @pl.when(owner)
    def _():
        compute(lambda ks: wg_ref[e, ks, cols], lambda ks: wu_ref[e, ks, cols], limit)

    if has_shared:
        @pl.when(s == n_routed)
        def _():
            compute(lambda ks: sg_ref[ks, cols], lambda ks: su_ref[ks, cols], shared_limit)


def experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed,
                            group, n_groups, tp, limit, shared_limit):
    # h_ref [S, TP, I] (after SwiGLU) or [KS, S, 2, TO, I] fp32 gate/up partials (SwiGLU applied here on load);
    # ids_ref [P]; ids2_ref [T or TP, K]; w_ref [T or TP, K] fp32; wd_ref [E, I, D]; sd_ref [I, D];
    # o_ref [TO, BD] fp32 (TO = 1 when T = 1, else TP): partial of group g (g = NG: shared)
    g, i_d = pl.program_id(0), pl.program_id(1)
    to, bd = o_ref.shape
    split = len(h_ref.shape) == 5
    dt = wd_ref.dtype
    cols = pl.ds(pl.multiple_of(i_d * bd, bd), bd)
    rows = lax.iota(jnp.int32, tp)

    def load_h(s, ks, lim):
        if not split:
            return h_ref[s, :, ks]
        acc_g, acc_u = h_ref[0, s, 0, :, ks], h_ref[0, s, 1, :, ks]  # [TO, BKI] fp32
        for k in range(1, h_ref.shape[0]):
            acc_g, acc_u = acc_g + h_ref[k, s, 0, :, ks], acc_u + h_ref[k, s, 1, :, ks]
        return jnp.broadcast_to(_swiglu(acc_g.astype(dt), acc_u.astype(dt), lim), (tp, BKI))

    def expert_out(s, load_d, lim):
        def body(c, acc):
            ks = pl.ds(pl.multiple_of(c * BKI, BKI), BKI)
            return acc + _dot(load_h(s, ks, lim), load_d(ks))

        acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((tp, bd), jnp.float32))
        return acc.astype(dt).astype(jnp.float32)  # [TP, BD], rounded as the reference rounds each expert's output

    def store(v):  # v [TP, BD] fp32
        o_ref[...] = _row0(v) if to == 1 else v

    @pl.when(g < n_groups)
    def _():
        ids_flat = ids_ref[...]
        ids2 = jnp.broadcast_to(ids2_ref[...], (tp, ids2_ref.shape[1]))
        wts = jnp.broadcast_to(w_ref[...], (tp, w_ref.shape[1]))
        # T = 1 broadcasts the single token to TP rows: only row 0 is real.
        real = rows < (1 if ids2_ref.shape[0] == 1 else tp)

        def slot(s, acc):
            e, owner = _ownership(ids_flat, s, n_routed)

            def add(acc):
                hit = ids2 == e  # [TP, K]
                w_tok = jnp.sum(jnp.where(hit, wts, 0.0), axis=1)  # [TP] routing weight of e per token
                used = (jnp.sum(jnp.where(hit, 1, 0), axis=1) > 0) & real
                out = expert_out(s, lambda ks: wd_ref[e, ks, cols], limit)
                return acc + jnp.where(used[:, None], w_tok[:, None] * out, 0.0)

            return lax.cond(owner, add, lambda a: a, acc)

        lo = g * group
        hi = jnp.minimum(lo + group, n_routed)
        store(lax.fori_loop(lo, hi, slot, jnp.zeros((tp, bd), jnp.float32)))

    if sd_ref is not None:
        @pl.when(g == n_groups)
        def _():
            store(expert_out(n_routed, lambda ks: sd_ref[ks, cols], shared_limit))


def experts_fwd_kernel_down_t1(h_ref, ids_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed, tp, limit,
                               shared_limit):
    # T = 1: slot g < K is expert ids[g], slot K the shared expert. gate/up wrote h only for the first slot of
    # each expert (its owner), so a slot whose expert repeats an earlier slot's reads the owner's h.
    # h_ref as in experts_fwd_kernel_down; ids_ref [K]; wd_ref [E, I, D]; sd_ref [I, D];
    # o_ref [1, BD] fp32: unweighted partial h_g[I split k] · W_down[I split k, D block j]
    g, i_d, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bd = o_ref.shape[1]
    split = len(h_ref.shape) == 5
    dt = wd_ref.dtype
    cols = pl.ds(pl.multiple_of(i_d * bd, bd), bd)
    o_i = k * (n_chunks * BKI)

    def load_h(src, ks, lim):
        if not split:
            return h_ref[src, :, ks]
        acc_g, acc_u = h_ref[0, src, 0, :, ks], h_ref[0, src, 1, :, ks]
        for j in range(1, h_ref.shape[0]):
            acc_g, acc_u = acc_g + h_ref[j, src, 0, :, ks], acc_u + h_ref[j, src, 1, :, ks]
        return jnp.broadcast_to(_swiglu(acc_g.astype(dt), acc_u.astype(dt), lim), (tp, BKI))

    def run(src, load_d, lim):
        def body(c, acc):
            ks = pl.ds(pl.multiple_of(o_i + c * BKI, BKI), BKI)
            return acc + _dot(load_h(src, ks, lim), load_d(ks))

        o_ref[...] = _row0(lax.fori_loop(0, n_chunks, body, jnp.zeros((tp, bd), jnp.float32)))

    @pl.when(g < n_routed)
    def _():
        i_p = lax.iota(jnp.int32, ids_ref.shape[0])
        ids = ids_ref[...]
        e = jnp.sum(jnp.where(i_p == g, ids, 0))
        owner = jnp.min(jnp.where(ids == e, i_p, ids_ref.shape[0]))
        run(owner, lambda ks: wd_ref[e, ks, cols], limit)

    if sd_ref is not None:
        @pl.when(g == n_routed)
        def _():
            run(g, lambda ks: sd_ref[ks, cols], shared_limit)


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "tuning"))
def moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, *, limit, shared_limit,
                      tuning: ExpertsTuning = ExpertsTuning()):
    n, d = x.shape
    e, _, i = we_gate.shape
    k = ids.shape[1]
    dt = x.dtype
    if k & (k - 1):
        raise ValueError(f"the Pallas experts kernel needs a power-of-two top_k, got K={k}")
    if n > MAX_TOKENS:
        raise ValueError(f"the Pallas experts kernel takes T <= {MAX_TOKENS} tokens (decode/verify), got T={n}; "
                         "use backend='reference' for prefill")
    has_shared = ws_gate is not None
    if has_shared and ws_gate.shape[1] != i:
        raise ValueError(f"the Pallas experts kernel needs Is = I; got Is={ws_gate.shape[1]}, I={i}")
    bi = min(tuning.block_i, i & -i)
    bk = min(tuning.block_k, d & -d)
    bd = min(tuning.block_d, d & -d)
    bki = min(tuning.block_ki, i & -i)
    if min(bi, bk, bd, bki) < 16:
        raise ValueError(f"the Pallas experts kernel needs D={d} and I={i} divisible by 16")
    tp = max(16, next_pow2(n))
    if n > 1 and tp != n:
        x = jnp.pad(x, ((0, tp - n), (0, 0)))
        ids = jnp.pad(ids, ((0, tp - n), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, tp - n), (0, 0)))
    ids_flat = ids.reshape(-1)  # [T·K] (T = 1) or [TP·K]
    n_routed = n * k
    n_slots = n_routed + int(has_shared)
    n_groups = k  # slot groups of T slots each for the down projection
    to = 1 if n == 1 else tp
    if not has_shared:
        ws_gate = ws_up = jnp.zeros((1, 1), dt)  # never read: has_shared=False is static
    interpret = interpret_mode()
    whole = pl.no_block_spec
    ks = tuning.k_splits if n <= tuning.split_max_tokens else 1
    while ks > 1 and (d % ks or (d // ks) % 16):
        ks //= 2
    bk = min(bk, (d // ks) & -(d // ks))
    split = ks > 1
    if split:
        h_spec = pl.BlockSpec((None, None, 2, to, bi), lambda s, j, k: (k, s, 0, 0, j))
        h_shape = jax.ShapeDtypeStruct((ks, n_slots, 2, to, i), jnp.float32)
        grid_gu = (n_slots, i // bi, ks)
    else:
        h_spec = pl.BlockSpec((None, tp, bi), lambda s, j: (s, 0, j))
        h_shape = jax.ShapeDtypeStruct((n_slots, tp, i), dt)
        grid_gu = (n_slots, i // bi)
    h = pl.pallas_call(
        functools.partial(experts_fwd_kernel_gate_up, BK=bk, BI=bi, n_chunks=d // ks // bk, n_routed=n_routed,
                          limit=limit, shared_limit=shared_limit, has_shared=has_shared, split=split),
        grid=grid_gu,
        in_specs=[whole] * 6,
        out_specs=h_spec,
        out_shape=h_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        interpret=interpret,
        name="experts_fwd_kernel_gate_up",
    )(x, ids_flat, we_gate, we_up, ws_gate, ws_up)
    ksd = tuning.down_splits if n == 1 else 1
    while ksd > 1 and (i % ksd or (i // ksd) % 16):
        ksd //= 2
    if ksd > 1:
        bki = min(bki, (i // ksd) & -(i // ksd))
        kernel = functools.partial(experts_fwd_kernel_down_t1, BKI=bki, n_chunks=i // ksd // bki, n_routed=n_routed,
                                   tp=tp, limit=limit, shared_limit=shared_limit)
        down_inputs = [h, ids_flat, we_down] + ([ws_down] if has_shared else [])
        if not has_shared:
            kernel = functools.partial(lambda *refs, kern: kern(*refs[:3], None, refs[3]), kern=kernel)
        parts = pl.pallas_call(
            kernel,
            grid=(n_slots, d // bd, ksd),
            in_specs=[whole] * len(down_inputs),
            out_specs=pl.BlockSpec((None, None, 1, bd), lambda g, j, kk: (kk, g, 0, j)),
            out_shape=jax.ShapeDtypeStruct((ksd, n_slots, 1, d), jnp.float32),
            compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
            interpret=interpret,
            name="experts_fwd_kernel_down",
        )(*down_inputs)
        # Each expert's output rounded to the compute dtype (as the reference), weighted in fp32, rounded once.
        out = jnp.sum(parts, axis=0)[:, 0, :].astype(dt).astype(jnp.float32)  # [S, D]
        y = jnp.sum(weights[0][:, None] * out[:n_routed], axis=0, keepdims=True).astype(dt)
        if has_shared:
            y = y + out[n_routed:].astype(dt)
        return y
    kernel = functools.partial(experts_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_routed=n_routed, group=n,
                               n_groups=n_groups, tp=tp, limit=limit, shared_limit=shared_limit)
    down_inputs = [h, ids_flat, ids, weights, we_down]
    if has_shared:
        down_inputs.append(ws_down)
    else:
        kernel = functools.partial(lambda *refs, kern: kern(*refs[:5], None, refs[5]), kern=kernel)
    partials = pl.pallas_call(
        kernel,
        grid=(n_groups + int(has_shared), d // bd),
        in_specs=[whole] * len(down_inputs),
        out_specs=pl.BlockSpec((None, to, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_groups + int(has_shared), to, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret,
        name="experts_fwd_kernel_down",
    )(*down_inputs)
    y = jnp.sum(partials[:n_groups], axis=0).astype(dt)  # fp32 combine of the routed experts, rounded once
    if has_shared:
        y = y + partials[n_groups].astype(dt)  # compute-dtype add of the shared expert
    return y[:n]


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: ExpertsTuning = ExpertsTuning()):
    """Same contract as `reference.moe_experts`; shapes already validated by the dispatcher."""
    return moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                             shared_limit=shared_limit, tuning=tuning)
