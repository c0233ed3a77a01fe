"""Probe: does XLA launch our Pallas-Triton kernels with programmatic dependent launch (PDL), and does an early
`griddepcontrol.launch_dependents` in every program shorten the T = 1 MoE layer?

A streaming launch costs ~2-3 µs beyond its bytes (probe_moe_down_slabs), the layer has five launches, and every
fusion of launches tried so far was slower (RESULTS.md, "MoE, session 4/5"). With PDL (sm_90), a kernel launched
with programmatic stream serialization may start before its predecessor ends; it must execute
`griddepcontrol.wait` before reading the predecessor's output (XLA inserts it at kernel entry when it enables PDL
for a Triton kernel). The predecessor lets its dependents launch once all of its blocks have executed
`griddepcontrol.launch_dependents` (or exited). Here every MoE kernel's programs may issue that instruction first.

Each configuration runs in a subprocess with its own XLA_FLAGS (the flags are read once per process): the default,
`--xla_gpu_enable_pdl=false`, and PDL + PDL launch forced on. Reported per layer of an 8-layer cold chain: the
kernel-duration sum (overlapping kernels count twice, so with PDL it overstates) and the timeline span / 8 (first
kernel start to last kernel end: what a decode step pays when the GPU is kept busy). Also counts `griddepcontrol`
in the PTX XLA dumps for the Pallas kernels, and checks the layer against the reference.

Run on the GPU: `PYTHONPATH=.:experiments python3 experiments/probe_pdl.py` (session 5's call 4); call 5:
`--configs default --early-sets "router_fwd_kernel_gemv;router_fwd_kernel_topk;experts_fwd_kernel_gate_up;
experts_fwd_kernel_down" --out probe_pdl_s5c5a.json`, then `--configs default --early-sets ";router_fwd_kernel_topk"
--router-bf16 --out probe_pdl_s5c5b.json`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "default": "",
    "pdl_off": "--xla_gpu_enable_pdl=false",
    "pdl_on": "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true",
}


EARLY_KERNELS = ("router_fwd_kernel_gemv", "router_fwd_kernel_topk", "experts_fwd_kernel_gate_up",
                 "experts_fwd_kernel_down")


def child(early: str, n: int, dump: str | None, router_bf16: bool):
    import functools

    import dataclasses

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).parent))
    import probe_moe_t1 as pt
    from profile_ops import call_span_us, split_calls, trace_kernels

    from pallas_kernels.moe import experts as ex
    from pallas_kernels.moe import router as rm

    if early:
        from pallas_kernels.common.pdl import launch_dependents

        def launch_dependents_first(kernel):
            @functools.wraps(kernel)
            def wrapped(*refs, **kw):
                launch_dependents()
                return kernel(*refs, **kw)
            return wrapped

        for mod, names in ((rm, EARLY_KERNELS[:2]), (ex, EARLY_KERNELS[2:])):
            for name in names:
                if name in early.split(","):
                    setattr(mod, name, launch_dependents_first(getattr(mod, name)))
        rm.route.clear_cache()
        ex.moe_experts_fused.clear_cache()
    x, layers = pt.make_layers()
    if router_bf16:  # the checkpoint's bf16 router kept as it is (the reference upcasts the same values)
        for lay in layers:
            lay["router"] = lay["router"].astype(jnp.bfloat16)
    # Triggers only where --early says (DECODE_TUNING has the down kernel's own since S5 6: pinned off here).
    fn = pt.separate(dataclasses.replace(ex.DECODE_TUNING, early_launch_down=False))
    err = pt.rel_err(jax.jit(fn)(x, layers[0]), jax.jit(pt.reference_layer)(x, layers[0]))
    run = jax.jit(lambda x, layers: [fn(x, lay) for lay in layers])
    events = trace_kernels(lambda: run(x, layers), n)
    calls = split_calls(events)
    n_k = len(calls[0])
    nl = len(layers)
    span = call_span_us(calls) / nl
    ksum = statistics.median(sum(e[2] for e in c) for c in calls) / nl
    overlap = statistics.median(sum(max(0.0, (a[1] + a[2]) - b[1]) for a, b in zip(c, c[1:])) for c in calls) / nl
    by_name = collections.defaultdict(list)
    for c in calls:
        for e in c:
            by_name[e[0][:40]].append(e[2])
    out = dict(early=early, router_bf16=router_bf16, err=err, span_per_layer=round(span, 2),
               kernel_sum_per_layer=round(ksum, 2),
               overlap_per_layer=round(overlap, 2), kernels_per_call=n_k,
               kernels={k: round(statistics.median(v), 2) for k, v in by_name.items()})
    if dump:
        counts = {}
        for f in glob.glob(os.path.join(dump, "*.ptx")):
            txt = Path(f).read_text()
            for m in re.finditer(r"\.entry\s+(\w+)", txt):
                start = m.end()
                nxt = txt.find(".entry", start)
                body = txt[start: nxt if nxt > 0 else len(txt)]
                counts[m.group(1)[:50]] = (body.count("griddepcontrol.wait"),
                                           body.count("griddepcontrol.launch_dependents"))
        out["ptx_griddepcontrol"] = counts
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--early", default="", help="comma-separated kernels that trigger their dependents first")
    ap.add_argument("--early-sets", default=";all", help="';'-separated --early values to run per config ('all': "
                    "every kernel; '' none)")
    ap.add_argument("--router-bf16", action="store_true")
    ap.add_argument("--dump-ptx", action="store_true", help="also count griddepcontrol in XLA's PTX dump")
    ap.add_argument("--out", default="probe_pdl.json")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--dump", default=None, help="(child) XLA dump directory to read the PTX from")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    if args.child:
        child(args.early, args.n, args.dump, args.router_bf16)
        return
    rows = []
    for cfg in args.configs.split(","):
        for early in args.early_sets.split(";"):
            early = ",".join(EARLY_KERNELS) if early == "all" else early
            dump = tempfile.mkdtemp() if args.dump_ptx else None
            flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), CONFIGS[cfg],
                                         f"--xla_dump_to={dump}" if dump else "") if f)
            cmd = [sys.executable, __file__, "--child", "--n", str(args.n), "--early", early] + (
                ["--dump", dump] if dump else []) + (["--router-bf16"] if args.router_bf16 else [])
            res = subprocess.run(cmd, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, text=True,
                                 timeout=240)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(f"{cfg} early={early}: failed\n{res.stderr[-1500:]}", flush=True)
                continue
            r = {"config": cfg, **json.loads(line[0][7:])}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], args.out).write_text(json.dumps(rows, indent=1))
    (Path(__file__).parent / "results" / args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
