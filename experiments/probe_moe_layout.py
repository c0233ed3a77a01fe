"""Probe: do MoE expert weights stored [out, in] (torch layout) stream faster than [in, out] at batch 1?

Device time per kernel (JAX profiler) of the MoE experts and the router GEMV at Ling-3.0-flash sizes, old layout
(experiments/_old_moe_experts.py, the kernels before the change) against the new one, over NL = 8 layers of cold
weights (64 experts per layer here, 9 used, 106 MB per layer: far past the 60 MB L2). Every new variant is
checked compiled against the reference first.

The old kernels are not in the tree: `git show f144aad:pallas_kernels/moe/experts.py >
experiments/_old_moe_experts.py` and `git show cf5cb96:pallas_kernels/moe/router.py >
experiments/_old_moe_router.py` (the split-K router over [D, E], before the router went [E, D]) first. The run in
RESULTS.md (session 3, call 1) was made at commit 0a437ab, when the new down kernel also read [E, D, I] (torch
layout); that down measured slower (14.9-20.8 µs against 11.3) and the down projection went back to [E, I, D]
([in, out]), which this script now passes.

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_moe_layout.py`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_header  # noqa: E402
from probe_moe_t1 import record_row  # noqa: E402

try:
    import _old_moe_experts as old  # noqa: E402
    import _old_moe_router as old_router  # noqa: E402
except ImportError as exc:
    raise SystemExit("probe_moe_layout.py compares against the kernels of commits f144aad and cf5cb96: first run "
                     "`git show f144aad:pallas_kernels/moe/experts.py > experiments/_old_moe_experts.py` and "
                     "`git show cf5cb96:pallas_kernels/moe/router.py > experiments/_old_moe_router.py`") from exc
from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402
from pallas_kernels.moe.experts import DECODE_TUNING, ExpertsTuning, moe_experts_fused  # noqa: E402

D, I, K, NL, EL, E_ROUTER = 2560, 768, 8, 8, 64, 512
ROUTE_KW = dict(n_group=8, topk_group=4, top_k=K, routed_scaling_factor=2.5)


def make_layers(T):
    rng = np.random.default_rng(0)
    layers = []
    for l in range(NL):
        k = jax.random.split(jax.random.key(l), 8)
        bf = jnp.bfloat16
        s = D ** -0.5
        lay = dict(wg=jax.random.normal(k[0], (EL, D, I), bf) * s, wu=jax.random.normal(k[1], (EL, D, I), bf) * s,
                   wd=jax.random.normal(k[2], (EL, I, D), bf) * I ** -0.5, sg=jax.random.normal(k[3], (D, I), bf) * s,
                   su=jax.random.normal(k[4], (D, I), bf) * s, sd=jax.random.normal(k[5], (I, D), bf) * I ** -0.5,
                   router=jax.random.normal(k[6], (D, E_ROUTER), jnp.float32) * s,
                   bias=0.01 * jax.random.normal(k[7], (E_ROUTER,), jnp.float32))
        for name in ("wg", "wu", "sg", "su", "router"):
            lay[name + "_t"] = jnp.swapaxes(lay[name], -1, -2) + 0  # materialised copy in the [out, in] layout
        ids = np.stack([rng.choice(EL, K, replace=False) for _ in range(T)])
        if T > 1:  # overlap across tokens, as in verify
            ids[1:, :3] = ids[0, :3]
        lay["ids"] = jnp.asarray(ids, jnp.int32)
        lay["w"] = jnp.asarray(rng.random((T, K)), jnp.float32)
        layers.append(lay)
    x = jax.random.normal(jax.random.key(99), (T, D), jnp.bfloat16)
    return x, layers


def old_experts(tuning):
    def f(x, lay):
        return old.moe_experts_fused(x, lay["w"], lay["ids"], lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"],
                                     lay["sd"], limit=4.0, shared_limit=5.0, tuning=tuning)
    return f


def new_experts(tuning):
    def f(x, lay):
        return moe_experts_fused(x, lay["w"], lay["ids"], lay["wg_t"], lay["wu_t"], lay["wd"], lay["sg_t"],
                                 lay["su_t"], lay["sd"], limit=4.0, shared_limit=5.0, tuning=tuning)
    return f


def ref_experts(x, lay):  # today's layout: gate/up [out, in] (the "_t" copies), down [in, out]
    return reference.moe_experts(x, lay["w"], lay["ids"], lay["wg_t"], lay["wu_t"], lay["wd"], lay["sg_t"],
                                 lay["su_t"], lay["sd"], limit=4.0, shared_limit=5.0)


def gemv_ed_kernel(x_ref, w_ref, p_ref, *, BK, n_chunks):
    # x_ref [1, D]; w_ref [E, D] fp32; p_ref [1, BE]: partial logits of split k
    j, k = pl.program_id(0), pl.program_id(1)
    be = p_ref.shape[1]
    rows = pl.ds(pl.multiple_of(j * be, be), be)

    def body(c, acc):
        ks = pl.ds(pl.multiple_of(k * n_chunks * BK + c * BK, BK), BK)
        return acc + w_ref[rows, ks] * x_ref[:, ks].astype(jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((be, BK), jnp.float32))
    p_ref[...] = jnp.sum(acc, axis=1)[None, :]


def route_ed(be, ks, bk, warps, stages):
    def f(x, lay):
        w = lay["router_t"]
        e = w.shape[0]
        part = pl.pallas_call(
            functools.partial(gemv_ed_kernel, BK=bk, n_chunks=D // ks // bk),
            grid=(e // be, ks), in_specs=[pl.no_block_spec] * 2,
            out_specs=pl.BlockSpec((None, 1, be), lambda j, k: (k, 0, j)),
            out_shape=jax.ShapeDtypeStruct((ks, 1, e), jnp.float32),
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=interpret_mode(), name="router_gemv_ed")(x, w)
        g = ROUTE_KW["n_group"]
        return pl.pallas_call(
            functools.partial(router_mod.router_fwd_kernel_topk, topk_group=4, top_k=K, scale=2.5, norm=True),
            grid=(1,),
            in_specs=[pl.BlockSpec((ks, None, g, e // g), lambda i: (0, i, 0, 0)),
                      pl.BlockSpec((g, e // g), lambda i: (0, 0))],
            out_specs=[pl.BlockSpec((1, K), lambda i: (i, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((1, K), jnp.float32), jax.ShapeDtypeStruct((1, K), jnp.int32)],
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
            interpret=interpret_mode(), name="router_fwd_kernel_topk",
        )(part.reshape(ks, 1, g, e // g), lay["bias"].reshape(g, e // g))
    return f


def route_old(x, lay):  # the split-K router over [D, E] with the defaults before session 3 (commit cf5cb96's file)
    tuning = old_router.RouterTuning(gemv_dot=True, k_splits=8, block_k=64, topk_warps=1)
    return old_router.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=tuning)


def main():
    results = {**run_header(), "rows": []}

    def record(label, fn, x, layers, check=None):
        record_row(results, "probe_moe_layout.json", label, fn, x, layers, check)

    x, layers = make_layers(1)
    check_route = lambda x, lay: reference.route(x, lay["router_t"], lay["bias"], **ROUTE_KW)  # noqa: E731
    record("router old", route_old, x, layers, check=check_route)
    record("router today (DECODE_TUNING)", lambda x, lay: router_mod.route(x, lay["router_t"], lay["bias"],
                                                                            **ROUTE_KW), x, layers, check=check_route)
    for be, ks, bk, w, st in [(4, 1, 256, 4, 3), (8, 1, 128, 4, 3), (4, 2, 256, 4, 3), (8, 4, 128, 4, 3),
                              (4, 1, 512, 4, 3), (2, 1, 512, 2, 3), (4, 4, 128, 4, 4), (16, 4, 64, 4, 3)]:
        record(f"router [E,D] BE{be} KS{ks} BK{bk} w{w} s{st}", route_ed(be, ks, bk, w, st), x, layers,
               check=check_route)
    record("experts old default", old_experts(old.ExpertsTuning()), x, layers, check=ref_experts)
    record("experts old best split", old_experts(old.ExpertsTuning(block_i=128, block_k=64, k_splits=4,
                                                                     warps_gate_up=8)), x, layers, check=ref_experts)
    # Call 1 swept 15 tunings of the kernels at commit 0a437ab (see its copy of this script); today's choices:
    new_t1 = [DECODE_TUNING, ExpertsTuning(), ExpertsTuning(t1_gate_up="dot_x")]
    for tu in new_t1:
        record(f"experts new {tu}", new_experts(tu), x, layers, check=ref_experts)
    del layers
    for T in (6, 16):
        x, layers = make_layers(T)
        record(f"T={T} experts old default", old_experts(old.ExpertsTuning()), x, layers, check=ref_experts)
        for tu in (ExpertsTuning(), ExpertsTuning(block_k=128, block_ki=128), ExpertsTuning(block_d=16)):
            record(f"T={T} experts new {tu}", new_experts(tu), x, layers, check=ref_experts)
        del layers


if __name__ == "__main__":
    main()
