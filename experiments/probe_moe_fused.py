"""Probe: the fused three-launch MoE layer at T = 1 (pallas_kernels/moe/layer.py) against route + experts, by
device time per kernel (JAX profiler), NL = 8 layers of cold Flash-size weights (512 experts, 6 GB per layer);
plus two read ceilings: a Pallas kernel that only sums the 18 gate/up slabs a layer reads (70.8 MB, the gate/up
kernel's grid), and XLA's sum over 1 GiB.

Run on the GPU: `PYTHONPATH=. python3 experiments/probe_moe_fused.py`.
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
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_layout import per_kernel_us  # noqa: E402
import probe_moe_layout  # noqa: E402

from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402
from pallas_kernels.moe.experts import ExpertsTuning, moe_experts_fused  # noqa: E402
from pallas_kernels.moe.layer import LayerTuning, moe_layer_t1  # noqa: E402
from pallas_kernels.moe.router import RouterTuning  # noqa: E402

D, I, K, NL, E = 2560, 768, 8, 8, 512
ROUTE_KW = dict(n_group=8, topk_group=4, top_k=K, routed_scaling_factor=2.5)
LIMITS = dict(limit=4.0, shared_limit=5.0)


def make_layers():
    layers = []
    for l in range(NL):
        k = jax.random.split(jax.random.key(l), 8)
        bf, s = jnp.bfloat16, D ** -0.5
        layers.append(dict(
            wg=jax.random.normal(k[0], (E, I, D), bf) * s, wu=jax.random.normal(k[1], (E, I, D), bf) * s,
            wd=jax.random.normal(k[2], (E, I, D), bf) * I ** -0.5, sg=jax.random.normal(k[3], (I, D), bf) * s,
            su=jax.random.normal(k[4], (I, D), bf) * s, sd=jax.random.normal(k[5], (I, D), bf) * I ** -0.5,
            router=jax.random.normal(k[6], (D, E), jnp.float32) * s,
            bias=0.01 * jax.random.normal(k[7], (E,), jnp.float32)))
    return jax.random.normal(jax.random.key(99), (1, D), jnp.bfloat16), layers


def reference_layer(x, lay):
    w, ids = reference.route(x, lay["router"], lay["bias"], **ROUTE_KW)
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731  gather first, then view the 8 experts as [D, I]
    local = jnp.arange(K, dtype=jnp.int32)[None]  # the K selected experts, gathered, renumbered 0..K-1
    y = reference._routed_gather(x, w, local, t(lay["wg"][ids[0]]), t(lay["wu"][ids[0]]), lay["wd"][ids[0]], 4.0)
    return (y.astype(x.dtype) + reference.mlp(x, t(lay["sg"]), t(lay["su"]), lay["sd"], 5.0)).astype(x.dtype)


def separate(experts_tuning=ExpertsTuning(), router_tuning=RouterTuning()):
    def f(x, lay):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **ROUTE_KW, tuning=router_tuning)
        return moe_experts_fused(x, w, ids, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"],
                                 **LIMITS, tuning=experts_tuning)
    return f


def fused(tuning=LayerTuning()):
    def f(x, lay):
        return moe_layer_t1(x, lay["router"], lay["bias"], lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"],
                            lay["sd"], **ROUTE_KW, norm_topk_prob=True, **LIMITS, tuning=tuning)
    return f


def read_kernel(w_ref, o_ref, *, BK, n_chunks, unroll):
    rows = pl.ds(pl.multiple_of(pl.program_id(1) * o_ref.shape[0], o_ref.shape[0]), o_ref.shape[0])

    def body(c, acc):
        for u in range(unroll):
            ks = pl.ds(pl.multiple_of((c * unroll + u) * BK, BK), BK)
            acc = acc + w_ref[pl.program_id(0), rows, ks].astype(jnp.float32)
        return acc

    acc = lax.fori_loop(0, n_chunks // unroll, body, jnp.zeros((o_ref.shape[0], BK), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=1)


def read_ceiling(bi, bk, unroll=1, warps=4):
    def f(x, lay):  # the first 9 experts' gate and up slabs: 18 × [I, D] bf16
        out = []
        for w in (lay["wg"], lay["wu"]):
            out.append(pl.pallas_call(
                functools.partial(read_kernel, BK=bk, n_chunks=D // bk, unroll=unroll), grid=(9, I // bi),
                in_specs=[pl.no_block_spec], out_specs=pl.BlockSpec((None, bi), lambda s, j: (s, j)),
                out_shape=jax.ShapeDtypeStruct((9, I), jnp.float32),
                compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=3), name="read_ceiling")(w))
        return out
    return f


def main():
    results = {**run_header(), "rows": []}
    x, layers = make_layers()

    def record(label, fn, check=True):
        try:
            err = None
            if check:
                a = np.asarray(jax.jit(fn)(x, layers[0]), np.float64)
                b = np.asarray(jax.jit(reference_layer)(x, layers[0]), np.float64)
                err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            ks = per_kernel_us(fn, x, layers)
        except Exception as exc:  # one variant's failure must not lose the others
            print(f"{label}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
            return
        total = sum(us * per for us, per in ks.values())
        results["rows"].append(dict(label=label, err=err, total_us=round(total, 2), kernels=ks))
        print(f"{label:48s} err {err}  total {total:6.2f} µs  " +
              "  ".join(f"{k[:30]} {v[0]}" + (f"x{v[1]:.2g}" if v[1] != 1 else "") for k, v in ks.items()),
              flush=True)
        write_results("probe_moe_fused.json", results)

    record("separate route + experts (defaults)", separate())
    record("fused default", fused())
    E_ = ExpertsTuning
    for label, et, rt in [
        ("gate/up unroll 2", E_(unroll_gate_up=2), None),
        ("gate/up unroll 5", E_(unroll_gate_up=5), None),
        ("gate/up BK128 unroll 4", E_(block_k=128, unroll_gate_up=4), None),
        ("gate/up reduce_each BK512", E_(reduce_each=True, block_k=512), None),
        ("gate/up reduce_each BK512 unroll 5", E_(reduce_each=True, block_k=512, unroll_gate_up=5), None),
        ("gate/up reduce_each BK256 unroll 2", E_(reduce_each=True, unroll_gate_up=2), None),
        ("gate/up reduce_each BK1024 w8", E_(reduce_each=True, block_k=1024, warps_gate_up=8), None),
        ("gate/up reduce_each BI8 BK512 unroll 5", E_(reduce_each=True, block_i=8, block_k=512, unroll_gate_up=5),
         None),
        ("gate/up BI8 unroll 2", E_(block_i=8, unroll_gate_up=2), None),
        ("down unroll 2", E_(unroll_down=2), None),
        ("down unroll 3", E_(unroll_down=3), None),
        ("down unroll 6", E_(unroll_down=6), None),
        ("down BKI256 unroll 3", E_(block_ki=256, unroll_down=3), None),
        ("down stages 4", E_(stages_down=4), None),
        ("router KS16 BK32", None, RouterTuning(k_splits=16, block_k=32)),
        ("router BE8", None, RouterTuning(block_e=8)),
        ("router fma KS16 BK32", None, RouterTuning(gemv_dot=False, k_splits=16, block_k=32)),
        ("router topk warps 4", None, RouterTuning(topk_warps=4)),
    ]:
        record(label, separate(et or ExpertsTuning(), rt or RouterTuning()))
    for bi, bk, un, w in [(8, 512, 1, 4), (16, 256, 2, 4), (8, 512, 5, 4), (16, 128, 4, 4), (8, 256, 2, 2),
                          (32, 256, 2, 8)]:
        record(f"read ceiling 70.8 MB BI{bi} BK{bk} unroll {un} w{w}", read_ceiling(bi, bk, un, w), check=False)
    big = jax.random.normal(jax.random.key(5), (8, 64, 1 << 20), jnp.bfloat16)  # 8 × 128 MiB
    rows = per_kernel_us(lambda x, lay: jnp.sum(lay.astype(jnp.float32)), x, list(big))
    print("XLA sum over 128 MiB (cold, 8 buffers):", rows, flush=True)
    results["xla_sum_128MiB"] = rows
    write_results("probe_moe_fused.json", results)


if __name__ == "__main__":
    main()
