"""Probe: the T = 1 experts (gate/up, down, combine) in ONE launch of 1-warp programs, after the production router.

Why: a Pallas streaming launch pays ~1.7 µs of ramp and tail beyond its bytes (RESULTS.md, "MoE, session 3": 4.05
TB/s steady + 1.7 µs per launch), and the five-launch layer streams its 106 MB of expert weights in two launches
(gate/up 18.5 µs, down 11.1 µs) plus a 1.1 µs combine fusion. Session 5's two-launch probe (probe_moe_two.py) put
gate/up and down in one launch but its down programs held a [64, 64] tile in registers across their wait (168
registers: 12 programs per SM for every role). Here the down role carries no tile across its wait: the launch
needs 64 registers at BR 16 (the gate/up kernel alone: 59), 94-124 with the prefetch or BR 32 (sm_90, `--regs`):
  gate/up   (K + 1)·I/BI programs, slot 0 = the shared expert, then the K routed slots: the production 2-row
            `fma_reduce` rows, h written to global, one arrival on the (slot, row split) counter.
  down      (K + 1)·NR·D/BD programs (slot, row split r of I/NR rows, BD columns): wait for the split's gate/up
            programs, then stream [BR, BD] tiles of W_down (stored [in, out]) times h rows, fp32 partial out.
            `prefetch`: the first tile is loaded before the wait.
  combine   the last down program of a (slot, column block) sums its NR partials in split order, rounds (the
            reference rounds each expert's output) and scales by the routing weight; the last of the K + 1 slots of
            a column block sums the routed ones in slot order, rounds and adds the shared one in the compute dtype;
            the last column block's combiner zeroes the counters (the buffer is zero on entry and on exit).
Programs wait only on programs with a lower grid index (dispatched earlier), as in probe_moe_two.py.

Measured (RESULTS.md, "Session 7"): correct (32 sequential calls through one carried sync buffer), but the layer
spans 41.6 µs at best against 36.4-36.6 for the five-launch layer in the same calls (the one launch 35.0 µs against
~30.7 for gate/up 18.2-18.5 + down 11.2 + the combine's ~1.1 µs of exclusive time): the 1-warp down role streams
slower than the 4-warp tensor-core down kernel (13.4 vs 11.2 µs) and its waits add 1.8 µs.

Run on the GPU: `XLA_FLAGS=--xla_allow_excess_precision=false PYTHONPATH=.:experiments timeout 400 python3
experiments/probe_moe_experts_one.py --set s7c1` (`--set s7c2 --repeat 16`: the second call; `--toy`: CPU interpret
smoke run; `--regs`: registers per variant, lowered for sm_90 on this CPU machine with
experiments/triton_resources.py).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).parent))
import probe_moe_fused_router as pf  # noqa: E402
import probe_moe_t1 as pt  # noqa: E402
from bench_common import run_header, write_results  # noqa: E402
from probe_moe_mega import _pick, _wait  # noqa: E402

from pallas_kernels.common import interpret_mode  # noqa: E402
from pallas_kernels.moe import experts as ex  # noqa: E402
from pallas_kernels.moe import router as router_mod  # noqa: E402

OUT = "probe_moe_experts_one.json"
SYNC = 1024
C_ROW, C_SC, C_COL, C_DONE = 0, 256, 768, 1000  # (slot, split) | (slot, column block) | column block | done


def one_kernel(x_ref, id_ref, wt_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, sync_in, h_ref, part_ref,
               lvl_ref, y_ref, sync_ref, *, BI, BK, BD, BR, NR, limit, shared_limit, prefetch, eviction, h_volatile,
               wait, down_role):
    del sync_in  # aliased to sync_ref
    p = pl.program_id(0)
    n_routed = id_ref.shape[1]
    n_slots = n_routed + 1
    d, i_dim = x_ref.shape[1], sg_ref.shape[0]
    per_slot = i_dim // BI
    n_gu = n_slots * per_slot
    rs, n_cols = i_dim // NR, d // BD
    dt = h_ref.dtype
    f32 = jnp.float32

    @pl.when(p < n_gu)
    def _():
        s, j = p // per_slot, p % per_slot
        rows = pl.ds(pl.multiple_of(j * BI, BI), BI)

        def gate_up(load_g, load_u, lim):
            h_ref[s, :, rows] = ex._gate_up_rows(x_ref, load_g, load_u, BK=BK, n_chunks=d // BK, bi=BI, to=1,
                                                 mode="fma_reduce", limit=lim, dt=dt)

        @pl.when(s == 0)
        def _():
            gate_up(lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], shared_limit)

        @pl.when(s > 0)
        def _():
            e = _pick(id_ref[0, :], s - 1)
            gate_up(lambda ks: ex._load(wg_ref, (e, rows, ks), eviction),
                    lambda ks: ex._load(wu_ref, (e, rows, ks), eviction), limit)

        pf._arrive(sync_ref, C_ROW + s * NR + (j * BI) // rs)

    @pl.when((p >= n_gu) & down_role)
    def _():
        q = p - n_gu
        s, rem = q // (NR * n_cols), q % (NR * n_cols)
        r, cb = rem // n_cols, rem % n_cols
        cols = pl.ds(pl.multiple_of(cb * BD, BD), BD)

        def step_rows(c):
            return pl.ds(pl.multiple_of(r * rs + c * BR, BR), BR)

        def down(load_w):
            first = load_w(step_rows(0)) if prefetch else None
            zero = _wait(sync_ref, C_ROW + s * NR + r, rs // BI) if wait else jnp.int32(0)

            def product(tile, c):
                at = h_ref.at[s + zero, 0, step_rows(c)]
                hv = pf._vload(at) if h_volatile else at[...]
                return jnp.sum(tile.astype(f32) * hv.astype(f32)[:, None], axis=0)

            acc = jnp.zeros((BD,), f32) if first is None else product(first, 0)
            part_ref[s, r, cols] = lax.fori_loop(int(prefetch), rs // BR,
                                                 lambda c, acc: acc + product(load_w(step_rows(c)), c), acc)

        @pl.when(s == 0)
        def _():
            down(lambda rr: sd_ref[rr, cols])

        @pl.when(s > 0)
        def _():
            e = _pick(id_ref[0, :], s - 1)
            down(lambda rr: ex._load(wd_ref, (e, rr, cols), eviction))

        @pl.when(pf._arrive(sync_ref, C_SC + s * n_cols + cb) == NR - 1)
        def _():
            ys = pf._vload(part_ref.at[s, jnp.int32(0), cols])
            for ri in range(1, NR):
                ys = ys + pf._vload(part_ref.at[s, jnp.int32(ri), cols])
            w_s = jnp.where(s == 0, 1.0, _pick(wt_ref[0, :], s - 1))  # the shared expert is not weighted
            lvl_ref[s, cols] = w_s * ys.astype(dt).astype(f32)

            @pl.when(pf._arrive(sync_ref, C_COL + cb) == n_slots - 1)
            def _():
                routed = pf._vload(lvl_ref.at[jnp.int32(1), cols])
                for si in range(2, n_slots):
                    routed = routed + pf._vload(lvl_ref.at[jnp.int32(si), cols])
                y_ref[0, cols] = routed.astype(dt) + pf._vload(lvl_ref.at[jnp.int32(0), cols]).astype(dt)

                @pl.when(pf._arrive(sync_ref, C_DONE) == n_cols - 1)
                def _():
                    sync_ref[...] = jnp.zeros((SYNC,), jnp.int32)


def experts_one(x, w, ids, lay, sync, *, BI=2, BK=512, BD=128, BR=16, NR=12, prefetch=False,
                eviction="evict_first", stages=3, h_volatile=True, wait=True, down_role=True):
    """The one experts launch. Timing-only diagnostics (wrong results): wait=False (down programs do not wait for
    their h rows), down_role=False (down programs exit at once: the gate/up role alone)."""
    d = x.shape[1]
    i_dim = lay["sg"].shape[0]
    k = ids.shape[1]
    rs = i_dim // NR
    if i_dim % NR or rs % BI or rs % BR:
        raise ValueError(f"NR={NR} must split I={i_dim} into row blocks that are multiples of BI={BI} and BR={BR}")
    n_cols = d // BD
    if (k + 1) * NR > C_SC - C_ROW or (k + 1) * n_cols > C_COL - C_SC or n_cols > C_DONE - C_COL:
        raise ValueError(f"counters do not fit the sync buffer: K={k}, NR={NR}, D/BD={n_cols}")
    BK = min(BK, d)
    n_prog = (k + 1) * (i_dim // BI) + (k + 1) * NR * n_cols
    outs = [jax.ShapeDtypeStruct((k + 1, 1, i_dim), x.dtype), jax.ShapeDtypeStruct((k + 1, NR, d), jnp.float32),
            jax.ShapeDtypeStruct((k + 1, d), jnp.float32), jax.ShapeDtypeStruct((1, d), x.dtype),
            jax.ShapeDtypeStruct(sync.shape, jnp.int32)]
    res = pl.pallas_call(
        functools.partial(one_kernel, BI=BI, BK=BK, BD=BD, BR=BR, NR=NR, limit=pt.LIMITS["limit"],
                          shared_limit=pt.LIMITS["shared_limit"], prefetch=prefetch, eviction=eviction,
                          h_volatile=h_volatile, wait=wait, down_role=down_role),
        grid=(n_prog,), in_specs=[pl.no_block_spec] * 10, out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
        input_output_aliases={9: 4}, interpret=interpret_mode(),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=stages), name="moe_t1_experts_one",
    )(x, ids, w, lay["wg"], lay["wu"], lay["wd"], lay["sg"], lay["su"], lay["sd"], sync)
    return res[3], res[4]


def one_layer(**kw):
    """(x, lay, sync) -> (y, sync): the production router (GEMV + top-k launches), then the one experts launch."""
    def f(x, lay, sync):
        w, ids = router_mod.route(x, lay["router"], lay["bias"], **pt.ROUTE_KW)
        return experts_one(x, w, ids, lay, sync, **kw)
    return f


def fresh_sync(fn):
    """(x, lay) -> y with a zeroed sync buffer per call (checks only; the timed chain threads one buffer)."""
    return lambda x, lay: fn(x, lay, jnp.zeros((SYNC,), jnp.int32))[0]


def repeat_check_threaded(x, lay, fn, n):
    """n sequential calls (lax.scan over different tokens, one sync buffer carried: the counters' reset is tested)
    against the reference layer: the worst relative error."""
    xs = x[None] + 0.5 * jax.random.normal(jax.random.key(3), (n,) + x.shape, x.dtype)

    def run(xs, lay):  # lay is an argument, not a closure: closed-over weights would become HLO constants
        return lax.scan(lambda sync, x: fn(x, lay, sync)[::-1], jnp.zeros((SYNC,), jnp.int32), xs)

    sync, got = jax.jit(run)(xs, lay)
    ref = jax.jit(lambda xs, lay: lax.map(lambda x: pt.reference_layer(x, lay), xs))(xs, lay)
    if int(jnp.abs(sync).sum()):
        raise AssertionError("the sync buffer is not zero after the calls: the counters' reset failed")
    return max(pt.rel_err(got[i], ref[i]) for i in range(n))


def threaded_chain(fn):
    """The layers in one jit with one sync buffer zeroed once and threaded through them (its memset is inside the
    profiled span): profile_layers' `chain` for a (x, lay, sync) -> (y, sync) layer."""
    def chain(x, layers):
        sync, ys = jnp.zeros((SYNC,), jnp.int32), []
        for lay in layers:
            y, sync = fn(x, lay, sync)
            ys.append(y)
        return ys, sync
    return chain


def record(results, label, fn, x, layers):
    pt.record_row(results, OUT, label, fresh_sync(fn), x, layers, pt.reference_layer, chain=threaded_chain(fn))


VARIANTS = {  # label -> experts_one keyword arguments; "diag" labels are timing-only (wrong results)
    "BD128 BR16 NR12": dict(),
    "BD128 BR16 NR12 prefetch": dict(prefetch=True),
    "BD256 BR8 NR12": dict(BD=256, BR=8),
    "BD64 BR32 NR12": dict(BD=64, BR=32),
    "BD128 BR16 NR6": dict(NR=6),
    "BD128 BR16 NR24": dict(NR=24, BR=16),
    "BD128 BR32 NR12": dict(BR=32),
    "BD256 BR16 NR12": dict(BD=256),
    "BD128 BR16 NR12 no evict": dict(eviction=None),
    "BD128 BR32 NR12 plain h": dict(BR=32, h_volatile=False),
    "diag BD128 BR32 NR12 no wait": dict(BR=32, wait=False),
    "diag gate/up role only": dict(down_role=False),
    "BD64 BR64 NR12": dict(BD=64, BR=64),
    "BD64 BR64 NR12 plain h": dict(BD=64, BR=64, h_volatile=False),
    "BD256 BR32 NR24": dict(BD=256, BR=32, NR=24),
    "BD128 BR64 NR12 plain h": dict(BR=64, h_volatile=False),
}
SETS = {  # the device calls of RESULTS.md, "Session 7" (the first label also runs the repeat check)
    "s7c1": list(VARIANTS)[:9],
    "s7c2": ["BD128 BR32 NR12", "BD128 BR32 NR12 plain h", "diag BD128 BR32 NR12 no wait", "diag gate/up role only",
             "BD64 BR64 NR12", "BD64 BR64 NR12 plain h", "BD256 BR32 NR24", "BD128 BR64 NR12 plain h"],
}


def registers(labels):
    """Registers / spill stack of the one launch per variant at Flash size, lowered for sm_90 here (no GPU)."""
    from jax._src.pallas.triton import gpu_info

    import probe_moe_mega
    from pallas_kernels.common import pdl
    from pallas_kernels.moe import router as rt
    from triton_resources import _unescape, compile_sm90

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    for m in (ex, rt, pdl, pf, probe_moe_mega, sys.modules[__name__]):
        m.interpret_mode = lambda: False
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    e, i, d = pt.E, pt.I, pt.D
    lay = dict(wg=sds((e, i, d), bf), wu=sds((e, i, d), bf), wd=sds((e, i, d), bf), sg=sds((i, d), bf),
               su=sds((i, d), bf), sd=sds((i, d), bf), router=sds((e, d), jnp.float32), bias=sds((e,), jnp.float32))
    for label in labels:
        fn = one_layer(**VARIANTS[label])
        txt = jax.jit(fn).trace(sds((1, d), bf), lay, sds((SYNC,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
        for m in re.finditer(r'ir = "', txt):
            meta = re.search(r'name = "([^"]*)".{0,300}?num_stages = (\d+).{0,80}?num_warps = (\d+)', txt[m.end():],
                             re.S)
            if meta.group(1) != "moe_t1_experts_one":
                continue
            r = compile_sm90(_unescape(txt[m.end():]), int(meta.group(3)), int(meta.group(2)))
            print(f"{label:32s} regs {r['regs']} stack {r['stack']} smem {r['smem']}", flush=True)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="CPU smoke run: small sizes, interpret mode")
    ap.add_argument("--regs", action="store_true", help="registers per variant (sm_90, lowered on this machine)")
    ap.add_argument("--repeat", type=int, default=32)
    ap.add_argument("--only", default=None, help="';'-separated variant labels")
    ap.add_argument("--set", choices=sorted(SETS), default=None, help="a recorded call's variants")
    args = ap.parse_args()
    labels = args.only.split(";") if args.only else SETS[args.set] if args.set else list(VARIANTS)
    if args.regs:
        return registers(labels)
    results = {**run_header(), "rows": []}
    if args.toy:
        OUT = "probe_moe_experts_one_toy.json"
        x, layers = pf.toy_layers()
        variants = {"toy BD64 BR8 NR4": dict(BD=64, BR=8, NR=4), "toy prefetch": dict(BD=128, BR=4, NR=2,
                                                                                      prefetch=True)}
    else:
        x, layers = pt.make_layers()
        variants = {lb: VARIANTS[lb] for lb in labels}
    first = one_layer(**next(iter(variants.values())))
    print("repeat check: compiling and running (a hang here is a handshake bug)", flush=True)
    err = repeat_check_threaded(x, layers[0], first, 4 if args.toy else args.repeat)
    print(f"repeat check: worst rel err {err:.3g} over the calls", flush=True)
    results["repeat_err"] = err
    pt.record_row(results, OUT, "five launches (defaults)", pt.separate(), x, layers, pt.reference_layer)
    for label, kw in variants.items():
        record(results, f"one experts launch: {label}", one_layer(**kw), x, layers)
    pt.record_row(results, OUT, "five launches (defaults), again", pt.separate(), x, layers, pt.reference_layer)
    write_results(OUT, results, to_repo=not args.toy)


if __name__ == "__main__":
    main()
