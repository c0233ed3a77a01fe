"""Pallas-Triton routed + shared SwiGLU experts for T <= 16-ish tokens: two launches, each expert's weights read once.

Slots: the T·K (token, k) pairs in row-major order, plus one slot for the shared expert (the last). A routed slot
*owns* its expert when no earlier slot chose the same expert; only owners do work, and an owner computes its
expert for every token that chose it. That reads each distinct expert once with no argsort/bincount/ragged_dot:
ownership is one vector compare over the ids, done in every program.

Kernel 1 (`experts_fwd_kernel_gate_up`), grid (S, I / BI): owner slot s streams gate and up [D, BI] in [BK, BI]
tiles, accumulates x·W in fp32 for all TP tokens, rounds to the compute dtype, applies SwiGLU (+ the post-SiLU
clamp) and writes h[s, :, BI-block]. Non-owner programs exit at once and leave their h rows unwritten.
Kernel 2 (`experts_fwd_kernel_down`), grid (D / BD,): each program walks the owner slots, computes h·W_down for its
BD output columns (fp32, rounded to the compute dtype as the reference rounds each expert's output), weights it
per token in fp32 and accumulates; the shared slot is added last in the compute dtype. No atomics, one writer.

T = 1 is a GEMV (broadcast multiply + sum); T > 1 pads the tokens to TP = max(16, 2^⌈log2 T⌉) rows for `dot`.
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


@dataclasses.dataclass(frozen=True)
class ExpertsTuning:
    block_i: int = 32  # BI: intermediate columns per gate/up program
    block_k: int = 256  # BK: hidden-dim chunk per gate/up step
    block_d: int = 32  # BD: output columns per down program
    block_ki: int = 256  # BKI: intermediate chunk per down step (capped at the largest power of two dividing I)
    warps_gate_up: int = 4
    stages_gate_up: int = 3
    warps_down: int = 4
    stages_down: int = 3

    def __post_init__(self):
        for name in ("block_i", "block_k", "block_d", "block_ki"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"ExpertsTuning.{name}={v} must be a power of two")


def _pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _matmul(b_x, b_w):
    """[TP, BK] · [BK, BN] -> [TP, BN] fp32: a GEMV for one token, a tensor-core dot otherwise."""
    if b_x.shape[0] == 1:
        return jnp.sum(b_x[0].astype(jnp.float32)[:, None] * b_w.astype(jnp.float32), axis=0)[None, :]
    prec = lax.Precision.HIGHEST if b_x.dtype == jnp.float32 else None
    return jnp.dot(b_x, b_w, precision=prec, preferred_element_type=jnp.float32)


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


def experts_fwd_kernel_gate_up(x_ref, ids_ref, wg_ref, wu_ref, sg_ref, su_ref, h_ref, *, BK, BI, n_chunks, n_routed,
                               limit, shared_limit, has_shared):
    # x_ref [TP, D]; ids_ref [P] int32; wg_ref/wu_ref [E, D, I]; sg_ref/su_ref [D, I]; h_ref [TP, BI] (slot s)
    s, i_i = pl.program_id(0), pl.program_id(1)
    e, owner = _ownership(ids_ref[...], s, n_routed)
    o_i = pl.multiple_of(i_i * BI, BI)

    def compute(load_g, load_u, lim):
        def body(c, carry):
            acc_g, acc_u = carry
            o_k = pl.multiple_of(c * BK, BK)
            b_x = x_ref[:, pl.ds(o_k, BK)]  # [TP, BK]
            acc_g = acc_g + _matmul(b_x, load_g(pl.ds(o_k, BK)))
            acc_u = acc_u + _matmul(b_x, load_u(pl.ds(o_k, BK)))
            return acc_g, acc_u

        zeros = jnp.zeros(h_ref.shape, jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, n_chunks, body, (zeros, zeros))
        dt = h_ref.dtype
        h_ref[...] = _swiglu(acc_g.astype(dt), acc_u.astype(dt), lim)

    # One indexer per load (the Triton lowering takes no `ref.at[e][...]` chains).
    cols = pl.ds(o_i, BI)

    @pl.when(owner)
    def _():
        compute(lambda ks: wg_ref[e, ks, cols], lambda ks: wu_ref[e, ks, cols], limit)

    if has_shared:
        @pl.when(s == n_routed)
        def _():
            compute(lambda ks: sg_ref[ks, cols], lambda ks: su_ref[ks, cols], shared_limit)


def experts_fwd_kernel_down(h_ref, ids_ref, ids2_ref, w_ref, wd_ref, sd_ref, o_ref, *, BKI, n_chunks, n_routed,
                            has_shared):
    # h_ref [S, TP, I]; ids_ref [P]; ids2_ref [TP, K]; w_ref [TP, K] fp32; wd_ref [E, I, D]; sd_ref [I, D];
    # o_ref [TP, BD]
    tp, bd = o_ref.shape
    dt = o_ref.dtype
    o_d = pl.multiple_of(pl.program_id(0) * bd, bd)
    ids_flat = ids_ref[...]
    ids2 = ids2_ref[...]
    wts = w_ref[...]

    cols = pl.ds(o_d, bd)

    def expert_out(s, load_d):
        def body(c, acc):
            o_k = pl.multiple_of(c * BKI, BKI)
            return acc + _matmul(h_ref[s, :, pl.ds(o_k, BKI)], load_d(pl.ds(o_k, BKI)))

        acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((tp, bd), jnp.float32))
        return acc.astype(dt)  # [TP, BD] compute dtype, as the reference rounds each expert's output

    def slot(s, acc):
        e, owner = _ownership(ids_flat, s, n_routed)

        def add(acc):
            w_tok = jnp.sum(jnp.where(ids2 == e, wts, 0.0), axis=1)  # [TP] routing weight of e per token
            used = jnp.sum(jnp.where(ids2 == e, 1, 0), axis=1) > 0
            out = expert_out(s, lambda ks: wd_ref[e, ks, cols]).astype(jnp.float32)
            return acc + jnp.where(used[:, None], w_tok[:, None] * out, 0.0)

        return lax.cond(owner, add, lambda a: a, acc)

    routed = lax.fori_loop(0, n_routed, slot, jnp.zeros((tp, bd), jnp.float32))
    y = routed.astype(dt)
    if has_shared:
        y = y + expert_out(n_routed, lambda ks: sd_ref[ks, cols])  # compute-dtype add, as the reference adds the shared expert
    o_ref[...] = y


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "tuning"))
def moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, *, limit, shared_limit,
                      tuning: ExpertsTuning = ExpertsTuning()):
    n, d = x.shape
    e, _, i = we_gate.shape
    k = ids.shape[1]
    if k & (k - 1):
        raise ValueError(f"the Pallas experts kernel needs a power-of-two top_k, got K={k}")
    has_shared = ws_gate is not None
    if not has_shared:
        # Stand-ins that are never read: the shared slot does not exist (has_shared=False is static).
        ws_gate = ws_up = ws_down = jnp.zeros((1, 1), x.dtype)
    elif ws_gate.shape[1] != i:
        raise ValueError(f"the Pallas experts kernel needs Is = I; got Is={ws_gate.shape[1]}, I={i}")
    bi = min(tuning.block_i, i & -i)
    bk = min(tuning.block_k, d & -d)
    bd = min(tuning.block_d, d & -d)
    bki = min(tuning.block_ki, i & -i)
    if min(bi, bk, bd, bki) < (1 if n == 1 else 16):
        raise ValueError(f"the Pallas experts kernel needs D={d} and I={i} divisible by 16 for T > 1")
    tp = 1 if n == 1 else max(16, _pow2(n))
    if tp != n:
        x = jnp.pad(x, ((0, tp - n), (0, 0)))
        ids = jnp.pad(ids, ((0, tp - n), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, tp - n), (0, 0)))
    ids_flat = ids.reshape(-1)  # [TP·K]
    n_routed = n * k
    n_slots = n_routed + int(has_shared)
    interpret = interpret_mode()
    whole = pl.no_block_spec
    h = pl.pallas_call(
        functools.partial(experts_fwd_kernel_gate_up, BK=bk, BI=bi, n_chunks=d // bk, n_routed=n_routed,
                          limit=limit, shared_limit=shared_limit, has_shared=has_shared),
        grid=(n_slots, i // bi),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((None, tp, bi), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_slots, tp, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_gate_up, num_stages=tuning.stages_gate_up),
        interpret=interpret,
        name="experts_fwd_kernel_gate_up",
    )(x, ids_flat, we_gate, we_up, ws_gate, ws_up)
    y = pl.pallas_call(
        functools.partial(experts_fwd_kernel_down, BKI=bki, n_chunks=i // bki, n_routed=n_routed,
                          has_shared=has_shared),
        grid=(d // bd,),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((tp, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((tp, d), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.warps_down, num_stages=tuning.stages_down),
        interpret=interpret,
        name="experts_fwd_kernel_down",
    )(h, ids_flat, ids, weights, we_down, ws_down)
    return y[:n]


def moe_experts(x, weights, ids, we_gate, we_up, we_down, ws_gate=None, ws_up=None, ws_down=None, *, limit=0.0,
                shared_limit=0.0, tuning: ExpertsTuning = ExpertsTuning()):
    """Same contract as `reference.moe_experts`; shapes already validated by the dispatcher."""
    return moe_experts_fused(x, weights, ids, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, limit=limit,
                             shared_limit=shared_limit, tuning=tuning)
