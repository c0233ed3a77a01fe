"""Pallas-Triton MoE layer for one token (batch-1 decode): router, top-k, 8 routed experts and the shared expert in
three launches, with the router's latency-bound steps overlapped by the shared expert's streaming.

Route + experts as separate ops cost four launches, and two of them (router GEMV, top-k) move almost no bytes
but take ~9 µs of device time on the H200. Here:

Kernel 1 (`moe_fwd_kernel_router_shared`), 1-D grid: programs [0, E/BE·KS) write split-K partial router logits
(fp32, `router.gemv_block`); the rest compute the shared expert's gate/up + SwiGLU for BI intermediate rows.
Kernel 2 (`moe_fwd_kernel_topk_gate_up`): programs [0, D/BD) stream the shared expert's down projection
(`experts.down_cols`); every other program (slot k, rows block j) first recomputes the grouped top-k from the
partial logits (`router.select_topk`: ~20 reductions over 512 scores, from L2) and then streams gate/up rows of
expert ids[k]. Program (0, 0) writes the weights and ids. The shared programs keep HBM busy while the others
select.
Kernel 3: the routed down projection (`experts.experts_fwd_kernel_down`, one slot per group), weighted fp32
partials; XLA sums them, rounds once and adds the shared output (the same combine as `experts.py`).

Numerics are those of `route` + `moe_experts`: same selection (the top-k code is shared), same rounding points.
The top-k output has distinct ids (each pick masks its expert), so every slot owns its expert.
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
from pallas_kernels.common.sizes import check_pow2_fields
from pallas_kernels.moe.experts import ExpertsTuning, down_cols, experts_fwd_kernel_down, gate_up_rows
from pallas_kernels.moe.router import RouterTuning, gemv_block, select_topk, sum_partials


@dataclasses.dataclass(frozen=True)
class LayerTuning:
    router: RouterTuning = RouterTuning()
    experts: ExpertsTuning = ExpertsTuning()
    shared_block_d: int = 64  # BD of the shared down programs of kernel 2
    num_warps: int = 4  # kernels 1 and 2
    num_stages: int = 3

    def __post_init__(self):
        check_pow2_fields(self, ("shared_block_d", "num_warps"), 1)


def moe_fwd_kernel_router_shared(x_ref, r_ref, sg_ref, su_ref, p_ref, hs_ref, *, KS, BE, BK_R, n_chunks_r, n_gemv,
                                 BI, BK, n_chunks, fma, use_dot, shared_limit):
    # x_ref [1, D]; r_ref [D, E] fp32; sg_ref/su_ref [I, D]; p_ref [KS, 1, E] fp32 partial logits;
    # hs_ref [1, I]: the shared expert's h after SwiGLU, compute dtype
    p = pl.program_id(0)

    @pl.when(p < n_gemv)
    def _():
        j, k = p // KS, p % KS
        cols = pl.ds(pl.multiple_of(j * BE, BE), BE)
        p_ref[k, :, cols] = gemv_block(x_ref, r_ref, cols, k * (n_chunks_r * BK_R), BK=BK_R, n_chunks=n_chunks_r,
                                       bn=1, use_dot=use_dot)

    if sg_ref is not None:
        @pl.when(p >= n_gemv)
        def _():
            rows = pl.ds(pl.multiple_of((p - n_gemv) * BI, BI), BI)
            hs_ref[:, rows] = gate_up_rows(x_ref, lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], BK=BK,
                                           n_chunks=n_chunks, bi=BI, to=1, fma=fma, limit=shared_limit,
                                           dt=hs_ref.dtype)


def moe_fwd_kernel_topk_gate_up(x_ref, p_ref, b_ref, wg_ref, wu_ref, hs_ref, sd_ref, h_ref, w_ref, i_ref, so_ref, *,
                                n_sd, n_blocks, BI, BK, n_chunks, BD, BKI, n_chunks_d, fma, down_fma, limit,
                                select_kw):
    # x_ref [1, D]; p_ref [KS, G, E/G] fp32 partial logits; b_ref [G, E/G] fp32; wg_ref/wu_ref [E, I, D];
    # hs_ref [1, I]; sd_ref [I, D]. Out: h_ref [K, 1, I] routed h; w_ref/i_ref [1, K]; so_ref [1, D] fp32 (the
    # shared expert's output, rounded to the compute dtype).
    p = pl.program_id(0)

    if sd_ref is not None:
        @pl.when(p < n_sd)
        def _():
            cols = pl.ds(pl.multiple_of(p * BD, BD), BD)
            so_ref[:, cols] = down_cols(lambda ks: hs_ref[:, ks], lambda ks: sd_ref[ks, cols], BKI=BKI,
                                        n_chunks=n_chunks_d, bd=BD, to=1, fma=down_fma, dt=sd_ref.dtype)

    @pl.when(p >= n_sd)
    def _():
        q = p - n_sd
        k, j = q // n_blocks, q % n_blocks
        w, ids = select_topk(sum_partials(p_ref), b_ref[...], **select_kw)

        @pl.when(q == 0)
        def _():
            w_ref[0, :] = w
            i_ref[0, :] = ids

        e = jnp.sum(jnp.where(lax.iota(jnp.int32, ids.shape[0]) == k, ids, 0))
        rows = pl.ds(pl.multiple_of(j * BI, BI), BI)
        h_ref[k, :, rows] = gate_up_rows(x_ref, lambda ks: wg_ref[e, rows, ks], lambda ks: wu_ref[e, rows, ks], BK=BK,
                                         n_chunks=n_chunks, bi=BI, to=1, fma=fma, limit=limit, dt=h_ref.dtype)


def _blocks(tuning: LayerTuning, d, e, i):
    """Static block sizes, split the same way as `router.route` and `experts.moe_experts_fused`."""
    rt, et = tuning.router, tuning.experts
    ks = rt.k_splits
    while ks > 1 and (d % ks or (d // ks) % 16):
        ks //= 2
    return dict(ks=ks, bk_r=min(rt.block_k, (d // ks) & -(d // ks)), be=min(rt.block_e, e),
                bi=min(et.block_i, i & -i), bk=min(et.block_k, d & -d), bd=min(et.block_d, d & -d),
                bki=min(et.block_ki, i & -i), bd_s=min(tuning.shared_block_d, d & -d))


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "limit", "shared_limit", "tuning"))
def moe_layer_t1(x, router, expert_bias, we_gate, we_up, we_down, ws_gate, ws_up, ws_down, *, n_group, topk_group,
                 top_k, routed_scaling_factor, norm_topk_prob, limit, shared_limit,
                 tuning: LayerTuning = LayerTuning()):
    """Same contract as `route` then `moe_experts` for x [1, D]; shapes already validated by the dispatcher."""
    n, d = x.shape
    e, i, _ = we_gate.shape
    dt = x.dtype
    if n != 1:
        raise ValueError(f"moe_layer_t1 takes one token, got T={n}")
    for name, v in (("E", e), ("E/n_group", e // n_group), ("top_k", top_k)):
        if v & (v - 1):
            raise ValueError(f"the Pallas MoE layer needs power-of-two sizes: {name}={v}")
    b = _blocks(tuning, d, e, i)
    if min(b["bk_r"], b["bi"], b["bk"], b["bd"], b["bki"], b["bd_s"]) < 16:
        raise ValueError(f"the Pallas MoE layer needs D={d} and I={i} divisible by 16")
    has_shared = ws_gate is not None
    if has_shared and ws_gate.shape[0] != i:
        raise ValueError(f"the Pallas MoE layer needs Is = I; got Is={ws_gate.shape[0]}, I={i}")
    fma, down_fma = not tuning.experts.t1_dot, tuning.experts.down_fma
    interpret = interpret_mode()
    whole = pl.no_block_spec
    params = pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    ks, bi = b["ks"], b["bi"]
    n_gemv = (e // b["be"]) * ks
    n_blocks = i // bi

    k1 = functools.partial(moe_fwd_kernel_router_shared, KS=ks, BE=b["be"], BK_R=b["bk_r"],
                           n_chunks_r=d // ks // b["bk_r"], n_gemv=n_gemv, BI=bi, BK=b["bk"], n_chunks=d // b["bk"],
                           fma=fma, use_dot=tuning.router.gemv_dot, shared_limit=shared_limit)
    k1_in = [x, router] + ([ws_gate, ws_up] if has_shared else [])
    if not has_shared:
        k1 = functools.partial(lambda x_r, r_r, p_r, hs_r, kern: kern(x_r, r_r, None, None, p_r, hs_r), kern=k1)
    parts, hs = pl.pallas_call(
        k1, grid=(n_gemv + (n_blocks if has_shared else 0),), in_specs=[whole] * len(k1_in),
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((ks, 1, e), jnp.float32), jax.ShapeDtypeStruct((1, i), dt)],
        compiler_params=params, interpret=interpret, name="moe_fwd_kernel_router_shared",
    )(*k1_in)

    gsz = e // n_group
    n_sd = d // b["bd_s"] if has_shared else 0
    select_kw = dict(topk_group=topk_group, top_k=top_k, scale=float(routed_scaling_factor), norm=bool(norm_topk_prob))
    k2 = functools.partial(moe_fwd_kernel_topk_gate_up, n_sd=n_sd, n_blocks=n_blocks, BI=bi, BK=b["bk"],
                           n_chunks=d // b["bk"], BD=b["bd_s"], BKI=b["bki"], n_chunks_d=i // b["bki"], fma=fma,
                           down_fma=down_fma, limit=limit, select_kw=select_kw)
    k2_in = [x, parts.reshape(ks, n_group, gsz), expert_bias.reshape(n_group, gsz), we_gate, we_up, hs]
    if has_shared:
        k2_in.append(ws_down)
    else:
        k2 = functools.partial(lambda *refs, kern: kern(*refs[:6], None, *refs[6:]), kern=k2)
    h, w, ids, so = pl.pallas_call(
        k2, grid=(n_sd + top_k * n_blocks,), in_specs=[whole] * len(k2_in), out_specs=[whole] * 4,
        out_shape=[jax.ShapeDtypeStruct((top_k, 1, i), dt), jax.ShapeDtypeStruct((1, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((1, top_k), jnp.int32), jax.ShapeDtypeStruct((1, d), jnp.float32)],
        compiler_params=params, interpret=interpret, name="moe_fwd_kernel_topk_gate_up",
    )(*k2_in)

    et = tuning.experts
    k3 = functools.partial(experts_fwd_kernel_down, BKI=b["bki"], n_chunks=i // b["bki"], n_routed=top_k, group=1,
                           n_groups=top_k, fma=down_fma)
    k3 = functools.partial(lambda *refs, kern: kern(*refs[:5], None, refs[5]), kern=k3)
    bd = b["bd"]
    partials = pl.pallas_call(
        k3, grid=(top_k, d // bd), in_specs=[whole] * 5,
        out_specs=pl.BlockSpec((None, 1, bd), lambda g, j: (g, 0, j)),
        out_shape=jax.ShapeDtypeStruct((top_k, 1, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=et.warps_down, num_stages=et.stages_down),
        interpret=interpret, name="experts_fwd_kernel_down",
    )(h, ids.reshape(-1), ids, w, we_down)
    y = jnp.sum(partials, axis=0).astype(dt)  # fp32 combine of the routed experts, rounded once
    return y + so.astype(dt) if has_shared else y
