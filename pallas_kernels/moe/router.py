"""Pallas-Triton router: fp32 GEMV over expert rows (kernel 1), then sigmoid + grouped top-k by masked argmax
(kernel 2).

Layout: the router is stored [E, D], torch's [out, in] (the checkpoint's `mlp.gate.weight` as it is, in its stored
dtype, fp32 or bf16; ling_jax/params.py), so an expert's weights are one contiguous 10 KB (fp32) or 5 KB (bf16) D-row
at Flash size. Each weight tile is widened to fp32 in registers before its products, so a bf16 router gives exactly
the partial logits of its fp32 copy (same products, same order) from half the bytes.

Kernel 1 (`router_fwd_kernel_gemv`), grid (E / BE, KS, NP / BN): program (j, k, n) owns expert rows
[j·BE, (j+1)·BE) and reads their D-split k, [k·D/KS, (k+1)·D/KS), end to end in [BE, BK] tiles (row-contiguous
reads, as the experts' gate/up programs), writing partial logits [BN, BE] for BN tokens. Split-K exists for the
number of programs in flight: 5.2 MB of fp32 rows streamed by E/BE = 256-512 one-warp programs took 4.7-5.6 µs on
the H200, against 3.8 µs for 512 programs of the previous [D, E] split-K kernel (RESULTS.md, "MoE, session 4").
Products of a one-token program (T = 1, or N > 1 with `multi_token="per_token"`), by `t1_gemv` (T1_GEMV_MODES):
  `fma`: x[k]·w[e, k] into a [BE, BK] fp32 tile, reduced over BK once at the end;
  `fma_reduce` (DECODE_TUNING, VERIFY_TUNING): the same products reduced every tile into [1, BE];
  `dot`: the token broadcast to 16 rows, a tensor-core dot as below.
N > 1 with `multi_token="dot"`: a tensor-core fp32 dot (precision HIGHEST) of BN tokens (padded to >= 16 rows)
per program, BE >= 16; `dot_gemv` picks the orientation: `dot_x` x·Wᵀ (the [BE, BK] weight tile as the
transposed operand) or `dot_w` W·xᵀ (the weight tile as the left operand).
The router is never rounded: an fp32-stored router stays fp32 (5.2 MB for Flash) so the logits equal the
reference's up to fp32 summation order (a bf16 copy would move near-ties); a bf16-stored one (2.6 MB) is read as is.
Tunings by T (`default_tuning`): `DECODE_TUNING` (T = 1: one-warp programs of one expert row split 5 ways, the
best of the H200 sweep; `DECODE_TUNING_BF16` for a bf16 router, two rows per program), `VERIFY_TUNING`
(2 <= N <= 16: the same one-warp programs, one token each, `multi_token="per_token"`, 2 splits: a weight tile's
reads after the first come from L2; their cost grows ~0.6 µs per token) and `WIDE_TUNING` (N > 16: the dot with BN
tokens per program, flat at 14.6 µs over T = 2..16; 2.1× the per-token programs at T = 6, 1.1× at T = 16).

Kernel 2 (`router_fwd_kernel_topk`), grid (N,), one program per token over its scores laid out [G, E/G]: sums
the KS partials in split order, sigmoid, then few serial reductions: per-group top-2 sums for all groups at once
(row max, row argmax, row max without that argmax), the best groups by rank counting on the G scores (a group is
kept when fewer than topk_group groups beat it: larger, or equal at a lower index), then K argmax passes over the
kept experts (argmax returns the first maximum) and the K weights in one [K, E] reduction. Every tie goes to the
lower index, exactly as `lax.top_k`. ~14 serial reductions instead of ~50 (per-group and per-pick loops before).
The GEMV stays out of this program: one program cannot stream 5 MB fast, and folding the top-k into the GEMV
kernel's last program (an arrival counter) was slower (RESULTS.md, "MoE, session 4").
Prefetch (`route(..., prefetch=arrays)`, `RouterTuning.prefetch_chunk_bytes`; on in DECODE_TUNING and
VERIFY_TUNING, off in WIDE_TUNING, not measured there): the top-k launch gets one more program per chunk of the
given arrays (the shared expert's gate, up and down, which the experts kernels read next and which do not depend on
the routing); each hands its chunk to L2 with one bulk prefetch (pallas_kernels/common/prefetch.py) while the top-k
programs compute with HBM otherwise idle. MoE layer on the H200: T = 1 37.1-37.3 -> 35.8-35.9 µs (RESULTS.md,
"Session 8"), T = 2 77.4 -> 76.9 µs ("Session 9"). Programs past the N tokens only prefetch; their block indices
map onto the last token's blocks, which they neither read nor write.
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
from pallas_kernels.common.prefetch import prefetch_l2
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2

# Products of a one-token program (T = 1, or N > 1 with multi_token="per_token") of a [BE, BK] weight tile with
# the token's [1, BK] slice, by mode (accumulator shape): fma [BE, BK] elementwise, reduced once at the end;
# fma_reduce [1, BE] reduced every tile; dot [16, BE] tensor-core dot on the row broadcast to 16 rows (BE >= 16).
# N > 1 with multi_token="dot" takes the dot over BN tokens per program.
T1_GEMV_MODES = ("fma", "fma_reduce", "dot")


@dataclasses.dataclass(frozen=True)
class RouterTuning:
    # Field defaults: the tensor-core dot path for N > 1; DECODE_TUNING / VERIFY_TUNING / WIDE_TUNING below.
    block_e: int = 16  # BE: expert rows per GEMV program (>= 16 for a dot)
    block_k: int = 64  # BK: hidden-dim chunk per GEMV step (>= 16 for a dot)
    k_splits: int = 1  # KS: D-splits (partial logits summed by the top-k kernel); the largest count <= KS that
    #                    divides D into multiples of 16 is used (KS = 5 at D = 2560: 512 each; 4 at D = 256: 64)
    num_warps: int = 4  # GEMV program
    num_stages: int = 3  # GEMV program
    t1_gemv: str = "fma"  # one-token programs' products: "fma" | "fma_reduce" | "dot" (T1_GEMV_MODES)
    dot_gemv: str = "dot_x"  # the dot's orientation: "dot_x" x·Wᵀ (weight tile transposed) | "dot_w" W·xᵀ
    multi_token: str = "dot"  # N > 1: "dot" (BN tokens per program) | "per_token" (one token per program, the
    #                           T = 1 products; the N reads of a weight tile after the first come from L2)
    block_n: int = 16  # BN: tokens per GEMV program at N > 1 (>= 16: dot rows)
    topk_warps: int = 4  # warps of the top-k program (one token per program)
    # L2 prefetch of the arrays passed as `route(..., prefetch=...)` (the shared expert, which the experts kernels
    # read next and which does not depend on the routing): extra programs of the top-k launch each hand one chunk of
    # this many bytes to the memory system (pallas_kernels/common/prefetch.py) while the top-k program computes.
    # 0: off. DECODE_TUNING: 120 KiB chunks (T = 1 layer 37.1-37.3 -> 35.8-35.9 µs on the H200; RESULTS.md,
    # "Session 8").
    prefetch_chunk_bytes: int = 0
    # L2 policy of the prefetched lines: evict_last, else evict_normal (the default: the routed stream is evict_first
    # anyway, evict_last measured the same, 35.80 µs against 35.83-35.92, and would leave 11.8 MB per layer marked
    # to stay in L2 after their use)
    prefetch_evict_last: bool = False

    def __post_init__(self):
        check_pow2_fields(self, ("block_e", "block_k", "num_warps", "topk_warps"))
        check_pow2_fields(self, ("block_n",), 16)
        for name in ("num_stages", "k_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterTuning.{name}={getattr(self, name)} must be >= 1")
        if self.prefetch_chunk_bytes < 0 or self.prefetch_chunk_bytes % 16:
            raise ValueError(f"RouterTuning.prefetch_chunk_bytes={self.prefetch_chunk_bytes} must be a non-negative "
                             "multiple of 16 bytes (cp.async.bulk), or 0 for no prefetch")
        if self.t1_gemv not in T1_GEMV_MODES:
            raise ValueError(f"RouterTuning.t1_gemv={self.t1_gemv!r} must be one of {T1_GEMV_MODES}")
        if self.multi_token not in ("dot", "per_token"):
            raise ValueError(f"RouterTuning.multi_token={self.multi_token!r} must be 'dot' or 'per_token'")
        if self.dot_gemv not in ("dot_x", "dot_w"):
            raise ValueError(f"RouterTuning.dot_gemv={self.dot_gemv!r} must be 'dot_x' or 'dot_w'")
        if self.t1_gemv == "dot" and self.block_e < 16:
            raise ValueError(f"RouterTuning.block_e={self.block_e} with t1_gemv='dot': tensor-core dots need "
                             "block_e >= 16 expert rows; use t1_gemv='fma' or 'fma_reduce' for fewer")


# Best of the H200 sweeps by device time (RESULTS.md, "MoE, session 4"): T = 1 GEMV 3.1 µs + top-k 3.3 µs (S4
# call 6; the top-k launch takes 3.7-3.8 µs since it also prefetches the shared expert, session 8). 2 <= N <= 16:
# one-token programs, 2 splits, 256-wide tiles (S4 call 8: GEMV 4.5 / 7.0 / 13.1 µs at T = 2 / 6 / 16, ~0.6 µs
# per token). N > 16: the tensor-core dot (W·xᵀ, 4 splits: 14.6 µs flat over T = 2..16, so cheaper from ~T = 18
# on; not measured past 16); with no split the dot took 54 µs at T = 6.
DECODE_TUNING = RouterTuning(block_e=1, block_k=512, k_splits=5, num_warps=1, t1_gemv="fma_reduce",
                             prefetch_chunk_bytes=120 * 1024)
# A bf16 router (as a BF16 checkpoint may store it) at T = 1: two expert rows per program, 1280 programs of 2 KB as
# DECODE_TUNING's fp32 programs read. MoE layer on the H200, probes' chain: 33.38-33.75 µs against 33.90-34.01 with
# one bf16 row per program (1 KB) and 34.12-34.31 with the fp32 router; the production bench 33.40-33.44 from the
# first layer (RESULTS.md, "Session 12", S12 1-2). Two rows per program gain the fp32 router nothing (34.19), four
# cost the bf16 one +1.0-1.35.
DECODE_TUNING_BF16 = dataclasses.replace(DECODE_TUNING, block_e=2)
# The shared-expert prefetch is on for 2 <= N <= 16 too (off before session 9): MoE layer span at T = 2 77.36 -> 76.93 µs (two runs each),
# T = 6 unchanged within noise (171.8 -> 171.7; RESULTS.md, "Session 9", S9 6).
VERIFY_TUNING = dataclasses.replace(DECODE_TUNING, multi_token="per_token", k_splits=2, block_k=256)
WIDE_TUNING = RouterTuning(dot_gemv="dot_w", k_splits=4)
PER_TOKEN_MAX = 16  # the largest N given VERIFY_TUNING by default


def default_tuning(n_tokens: int, router_dtype=jnp.float32) -> RouterTuning:
    """The tuning for N tokens and a router held in `router_dtype` (only T = 1 tells the two apart; the N > 1
    tunings were measured with fp32 routers only)."""
    if n_tokens == 1:
        return DECODE_TUNING_BF16 if jnp.dtype(router_dtype) == jnp.bfloat16 else DECODE_TUNING
    return VERIFY_TUNING if n_tokens <= PER_TOKEN_MAX else WIDE_TUNING


def _f32(w):
    return w if w.dtype == jnp.float32 else w.astype(jnp.float32)  # exact for bf16


def _gemv_rows(x_ref, w_ref, *, BK, n_chunks, mode):
    """Partial logits [BN, BE] fp32 of x_ref [BN, D/KS] (compute dtype) · w_ref [BE, D/KS]ᵀ (one D-split of BE fp32
    or bf16 expert rows, read end to end, widened to fp32)."""
    bn, be = x_ref.shape[0], w_ref.shape[0]
    if mode == "fma":
        def body_fma(c, acc):
            ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
            return acc + _f32(w_ref[:, ks]) * x_ref[:, ks].astype(jnp.float32)  # [BE, BK] · [1, BK]

        acc = lax.fori_loop(0, n_chunks, body_fma, jnp.zeros((be, BK), jnp.float32))
        return jnp.sum(acc, axis=1)[None, :]
    if mode == "fma_reduce":
        def body_red(c, acc):
            ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
            return acc + jnp.sum(_f32(w_ref[:, ks]) * x_ref[:, ks].astype(jnp.float32), axis=1)[None, :]

        return lax.fori_loop(0, n_chunks, body_red, jnp.zeros((1, be), jnp.float32))
    rows = max(16, bn)  # dot tiles need >= 16 rows
    w_left = mode == "dot_w"

    def body_dot(c, acc):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        b_x = jnp.broadcast_to(x_ref[:, ks].astype(jnp.float32), (rows, BK))  # [rows, BK]
        a, b = (_f32(w_ref[:, ks]), b_x) if w_left else (b_x, _f32(w_ref[:, ks]))
        return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body_dot, jnp.zeros((be, rows) if w_left else (rows, be), jnp.float32))
    if w_left:
        acc = acc.T  # [rows, BE]
    if bn == 1:  # T = 1 broadcast its row: keep row 0
        acc = jnp.sum(jnp.where((lax.iota(jnp.int32, rows) == 0)[:, None], acc, 0.0), axis=0)[None, :]
    return acc


def router_fwd_kernel_gemv(x_ref, w_ref, l_ref, *, BK, n_chunks, mode):
    # x_ref [BN, D/KS] compute dtype (BN = 1: one token); w_ref [BE, D/KS] fp32 or bf16, one D-split of BE rows;
    # l_ref [BN, BE] fp32 partial logits of that split
    l_ref[...] = _gemv_rows(x_ref, w_ref, BK=BK, n_chunks=n_chunks, mode=mode)


def _select_topk(logits, bias, *, topk_group, top_k, scale, norm):
    """In-kernel grouped top-k of one token: logits, bias [G, E/G] fp32 -> (weights [K] fp32, ids [K] int32)."""
    n_group, gsz = logits.shape
    e = n_group * gsz
    s = jax.nn.sigmoid(logits)  # [G, E/G]
    choice = s + bias
    neg = jnp.float32(-jnp.inf)
    # Group scores for all groups at once: top-2 sum = max + max with the first argmax removed (a duplicated
    # maximum counts twice, as in lax.top_k). Three row reductions, no per-group loop.
    col = lax.broadcasted_iota(jnp.int32, (n_group, gsz), 1)
    m1 = jnp.max(choice, axis=1)
    i1 = jnp.argmax(choice, axis=1).astype(jnp.int32)  # first index of the maximum
    m2 = jnp.max(jnp.where(col == i1[:, None], neg, choice), axis=1)
    g_score = m1 + m2  # [G]
    # Best groups by rank counting on G values: group g is kept when fewer than topk_group groups beat it (a
    # larger score, or an equal one at a lower index: lax.top_k's tie order).
    gi = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 0)
    gj = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 1)
    sc_g, sc_h = g_score[:, None], g_score[None, :]
    beats = (sc_h > sc_g) | ((sc_h == sc_g) & (gj < gi))  # [g, h]: h beats g
    rank = jnp.sum(beats.astype(jnp.int32), axis=1)
    masked = jnp.where((rank < topk_group)[:, None], choice, neg).reshape(e)
    # Top-k among the kept experts: K argmax passes (one reduction each; argmax returns the first maximum).
    i_e = lax.iota(jnp.int32, e)
    i_k = lax.iota(jnp.int32, top_k)
    ids = jnp.zeros((top_k,), jnp.int32)
    for k in range(top_k):
        ik = jnp.argmax(masked).astype(jnp.int32)
        ids = jnp.where(i_k == k, ik, ids)
        masked = jnp.where(i_e == ik, neg, masked)
    # Weights: the unbiased scores of the K picks in one [K, E] reduction.
    w = jnp.sum(jnp.where(i_e[None, :] == ids[:, None], s.reshape(e)[None, :], 0.0), axis=1)
    if norm:
        w = w / (jnp.sum(w) + 1e-20)
    return w * scale, ids


def _sum_partials(p_ref):
    """p_ref [KS, G, E/G] fp32 partial logits -> [G, E/G], summed in split order."""
    logits = p_ref[0]
    for k in range(1, p_ref.shape[0]):
        logits = logits + p_ref[k]
    return logits


def _split_count(d, k_splits):
    """The largest split count <= k_splits dividing D into multiples of 16 (1 always qualifies: D % 16 checked)."""
    return max(k for k in range(1, k_splits + 1) if d % k == 0 and (d // k) % 16 == 0)


def router_fwd_kernel_topk(p_ref, b_ref, *refs, n_tokens, chunks, evict_last, **select_kw):
    # p_ref [KS, G, E/G] fp32 partial logits of one token; b_ref [G, E/G] fp32; refs: the flat arrays to prefetch,
    # then w_ref [1, K] fp32, i_ref [1, K] int32. Programs >= n_tokens only prefetch: chunks[m] = (elements per
    # chunk, chunk count, bytes of the last chunk) of array m.
    *pref, w_ref, i_ref = refs
    p = pl.program_id(0)

    @pl.when(p < n_tokens)
    def _():
        w, ids = _select_topk(_sum_partials(p_ref), b_ref[...], **select_kw)
        w_ref[0, :] = w
        i_ref[0, :] = ids

    issue_prefetch_chunks(pref, chunks, p - n_tokens, evict_last)


def issue_prefetch_chunks(pref, chunks, q, evict_last):
    """In a program of a launch with one program per chunk (`_prefetch_chunks(pref, ...)`, the arrays' chunks in
    order): hand chunk q to L2 (q outside [0, number of chunks): nothing)."""
    for ref, (elems, count, last_bytes) in zip(pref, chunks):
        full = elems * ref.dtype.itemsize

        @pl.when((q >= 0) & (q < count - 1))
        def _():
            prefetch_l2(ref, q * elems, full, evict_last=evict_last)

        @pl.when(q == count - 1)
        def _():
            prefetch_l2(ref, q * elems, last_bytes, evict_last=evict_last)

        q = q - count


def _prefetch_chunks(arrays, chunk_bytes):
    """(elements per chunk, chunk count, bytes of the last chunk) of each array, cut into chunk_bytes pieces."""
    out = []
    for a in arrays:
        item = jnp.dtype(a.dtype).itemsize
        total = a.size * item
        if total % 16 or a.size >= 2 ** 31:
            raise ValueError(f"a prefetched array must hold a multiple of 16 bytes (cp.async.bulk) and fewer than "
                             f"2^31 elements; got shape {tuple(a.shape)} {a.dtype} = {total} bytes")
        chunk = min(chunk_bytes, total)
        count = -(-total // chunk)
        out.append((chunk // item, count, total - (count - 1) * chunk))
    return tuple(out)


def gemv_partials(x, router, tuning: RouterTuning):
    """Kernel 1: partial logits [KS, N_pad, E] fp32 of x [N, D] · router [E, D]ᵀ over the KS D-splits (N_pad: N
    padded to the tokens per program)."""
    n, d = x.shape
    e = router.shape[0]
    one_row = n == 1 or tuning.multi_token == "per_token"  # one token per GEMV program
    mode = tuning.t1_gemv if one_row else "dot"
    be = min(tuning.block_e, e)
    if mode == "dot" and be < 16:
        raise ValueError(f"RouterTuning.block_e={tuning.block_e} (E={e}: {be} expert rows per program) at N={n} "
                         "tokens: the tensor-core dot needs >= 16; only one-token programs (T = 1, or "
                         "multi_token='per_token') with t1_gemv 'fma'/'fma_reduce' take fewer (N > 1: use "
                         "router.VERIFY_TUNING)")
    if d % 16:
        raise ValueError(f"the Pallas router needs D={d} divisible by 16")
    ks = _split_count(d, tuning.k_splits)
    dk = d // ks
    bk = min(tuning.block_k, dk & -dk)
    if mode == "dot" and bk < 16:
        raise ValueError(f"RouterTuning.block_k={tuning.block_k} at N={n} tokens with the tensor-core dot: it "
                         "needs >= 16 (one-token FMA programs take any power of two)")
    bn = 1 if one_row else min(tuning.block_n, max(16, next_pow2(n)))
    n_pad = -(-n // bn) * bn
    xp = x if n_pad == n else jnp.pad(x, ((0, n_pad - n), (0, 0)))
    return pl.pallas_call(
        functools.partial(router_fwd_kernel_gemv, BK=bk, n_chunks=dk // bk,
                          mode=tuning.dot_gemv if mode == "dot" else mode),
        grid=(e // be, ks, n_pad // bn),
        in_specs=[pl.BlockSpec((bn, dk), lambda j, k, i: (i, k)), pl.BlockSpec((be, dk), lambda j, k, i: (j, k))],
        out_specs=pl.BlockSpec((None, bn, be), lambda j, k, i: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((ks, n_pad, e), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="router_fwd_kernel_gemv",
    )(xp, router)


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "tuning"))
def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True,
          tuning: RouterTuning | None = None, prefetch=()):
    """Same contract as `reference.route` (router [E, D] fp32 or bf16); shapes already validated by the dispatcher.
    `tuning` None: `default_tuning(N, router.dtype)`. `prefetch`: arrays the caller reads next, handed to L2 by the
    top-k launch when `tuning.prefetch_chunk_bytes` > 0 (a hint: no result depends on it)."""
    n = x.shape[0]
    e = router.shape[0]
    tuning = tuning or default_tuning(n, router.dtype)
    for name, v in (("E", e), ("E/n_group", e // n_group), ("top_k", top_k)):
        if v & (v - 1):
            raise ValueError(f"the Pallas router needs power-of-two sizes: {name}={v}")
    partial = gemv_partials(x, router, tuning)
    ks, n_pad, _ = partial.shape
    gsz = e // n_group
    pref = [a.reshape(-1) for a in prefetch if a.size] if tuning.prefetch_chunk_bytes else []
    chunks = _prefetch_chunks(pref, tuning.prefetch_chunk_bytes)
    tok = lambda i: jnp.minimum(i, n - 1)  # noqa: E731  (prefetch-only programs map onto the last token's blocks)
    w, ids = pl.pallas_call(
        functools.partial(router_fwd_kernel_topk, n_tokens=n, chunks=chunks, evict_last=tuning.prefetch_evict_last,
                          topk_group=topk_group, top_k=top_k, scale=float(routed_scaling_factor),
                          norm=bool(norm_topk_prob)),
        grid=(n + sum(c for _, c, _ in chunks),),
        in_specs=[pl.BlockSpec((ks, None, n_group, gsz), lambda i: (0, tok(i), 0, 0)),
                  pl.BlockSpec((n_group, gsz), lambda i: (0, 0))] + [pl.no_block_spec] * len(pref),
        out_specs=[pl.BlockSpec((1, top_k), lambda i: (tok(i), 0)), pl.BlockSpec((1, top_k), lambda i: (tok(i), 0))],
        out_shape=[jax.ShapeDtypeStruct((n, top_k), jnp.float32), jax.ShapeDtypeStruct((n, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.topk_warps, num_stages=1),
        interpret=interpret_mode(),
        name="router_fwd_kernel_topk",
    )(partial.reshape(ks, n_pad, n_group, gsz), expert_bias.reshape(n_group, gsz), *pref)
    return w, ids
