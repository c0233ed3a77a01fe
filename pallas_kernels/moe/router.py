"""Pallas-Triton router: fp32 GEMV over expert rows (kernel 1), then sigmoid + grouped top-k by masked argmax
(kernel 2).

Layout: the router is stored [E, D], torch's [out, in] (the checkpoint's `mlp.gate.weight` as it is, in its stored
dtype, fp32 or bf16; ling_jax/params.py), so an expert's weights are one contiguous 10 KB (fp32) or 5 KB (bf16) D-row
at Flash size. Every product is exact in fp32: the one-token FMA programs widen each tile to fp32 (so a bf16 router
gives exactly the partial logits of its fp32 copy from half the bytes); the multi-token dot with bf16 tokens runs on
tensor cores with fp32 accumulation, over the bf16 router as it is or over an fp32 router split into three bf16
pieces whose sum is exact; with fp32 tokens it is an fp32 dot at precision HIGHEST. An fp32-stored router is never
rounded: a bf16 copy would move near-ties.

Kernel 1 (`router_fwd_kernel_gemv`), grid (E / BE, KS, N_pad / BN): program (j, k, n) owns expert rows
[j·BE, (j+1)·BE) and reads their D-split k end to end in [BE, BK] tiles, writing partial logits [BN, BE] for BN
tokens. Split-K keeps enough programs in flight: one-row one-warp programs stream the 5.2 MB fp32 router in 3.07 µs
with 5 splits against 4.45 with none on the H200 (experiments/RESULTS.md, "MoE").
A one-token program (T = 1, or N > 1 with `multi_token="per_token"`) reduces each tile's products x[k]·w[e, k] into
[1, BE] by FMAs. N > 1 with `multi_token="dot"` takes dots W·xᵀ of BN >= 16 tokens per program, BE >= 16.
With `norm_weight` (the block's post-attention RMSNorm) kernel 1 norms x in its prologue: each program scales its
split's x tiles by rsqrt(Σx²/D + eps), the sums of squares taken by XLA where they fuse into x's producer (o_proj's
K-split sum), and the programs of expert block 0 write the normed x the experts read, so the norm takes no launch
of its own (one fewer per MoE layer).

Kernel 2 (`router_fwd_kernel_topk`), grid (N + prefetch chunks,), one program per token over its scores laid out
[G, E/G]: sums the KS partials in split order, sigmoid, then few serial reductions: per-group top-2 sums for all
groups at once, the best groups by rank counting on the G scores, K argmax passes over the kept experts and the K
weights in one [K, E] reduction. Every tie goes to the lower index, exactly as `lax.top_k`. Two launches: the
router in one (the last GEMV program to arrive runs the top-k) took 7.7-11.3 µs against 6.8 (experiments/FINDINGS.md).
Prefetch (`route(..., prefetch=arrays)`, `RouterTuning.prefetch_chunk_bytes`): the top-k launch gets one more
program per chunk of the given arrays (the shared expert's gate, up and down, which the experts kernels read next
and which do not depend on the routing); each hands its chunk to L2 with one bulk prefetch
(pallas_kernels/common/prefetch.py) while the top-k programs compute with HBM otherwise idle: T = 1 MoE layer
37.1-37.3 -> 35.8-35.9 µs, T = 2 77.4 -> 76.9 on the H200. Programs past the N tokens only prefetch; their block
indices map onto the last token's blocks, which they neither read nor write.
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
from pallas_kernels.common.norm import rms_normed
from pallas_kernels.common.prefetch import prefetch_l2
from pallas_kernels.common.sizes import check_pow2_fields, next_pow2


@dataclasses.dataclass(frozen=True)
class RouterTuning:
    # Field defaults: the tensor-core dot path for N > 1; DECODE_TUNING / VERIFY_TUNING / WIDE_TUNING below.
    block_e: int = 16  # BE: expert rows per GEMV program (>= 16 for the dot)
    block_k: int = 64  # BK: hidden-dim chunk per GEMV step (>= 16 for the dot)
    k_splits: int = 1  # KS: D-splits (partial logits summed by the top-k kernel); the largest count <= KS that
    #                    divides D into multiples of 16 is used (KS = 5 at D = 2560: 512 each; 4 at D = 256: 64)
    num_warps: int = 4  # GEMV program
    num_stages: int = 3  # GEMV program
    multi_token: str = "dot"  # N > 1: "dot" (BN tokens per program) | "per_token" (one token per program, the
    #                           T = 1 products; the N reads of a weight tile after the first come from L2)
    block_n: int = 16  # BN: tokens per GEMV program with the dot (>= 16: dot rows)
    topk_warps: int = 4  # warps of the top-k program (one token per program)
    # L2 prefetch of the arrays passed as `route(..., prefetch=...)`: extra programs of the top-k launch each hand
    # one chunk of this many bytes to the memory system; 0: off.
    prefetch_chunk_bytes: int = 0

    def __post_init__(self):
        check_pow2_fields(self, ("block_e", "block_k", "num_warps", "topk_warps"))
        check_pow2_fields(self, ("block_n",), 16)
        for name in ("num_stages", "k_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterTuning.{name}={getattr(self, name)} must be >= 1")
        if self.prefetch_chunk_bytes < 0 or self.prefetch_chunk_bytes % 16:
            raise ValueError(f"RouterTuning.prefetch_chunk_bytes={self.prefetch_chunk_bytes} must be a non-negative "
                             "multiple of 16 bytes (cp.async.bulk), or 0 for no prefetch")
        if self.multi_token not in ("dot", "per_token"):
            raise ValueError(f"RouterTuning.multi_token={self.multi_token!r} must be 'dot' or 'per_token'")


# Best of the H200 sweeps by device time (experiments/RESULTS.md, "MoE"). T = 1: one-row one-warp programs, 5
# splits: GEMV 3.1 µs + top-k 3.7 (with the 120 KiB-chunk prefetch of the shared expert).
DECODE_TUNING = RouterTuning(block_e=1, block_k=512, k_splits=5, num_warps=1, prefetch_chunk_bytes=120 * 1024)
# A bf16 router at T = 1: two rows per program read the 2 KB an fp32 program reads; MoE layer 33.38-33.75 µs
# against 33.90-34.01 with one bf16 row per program (four rows: +1.0-1.35).
DECODE_TUNING_BF16 = dataclasses.replace(DECODE_TUNING, block_e=2)
# 2 <= N <= 16: one-token programs, 2 splits, 256-wide tiles: GEMV 4.5 / 7.0 / 13.1 µs at T = 2 / 6 / 16, ~0.6 µs
# per token (a weight tile's reads after the first come from L2). The shared-expert prefetch stays on.
VERIFY_TUNING = dataclasses.replace(DECODE_TUNING, multi_token="per_token", k_splits=2, block_k=256)
# N > 16: the dot with 4 splits, flat at 14.6 µs over T = 2..16, so cheaper than per-token programs from ~T = 18
# (extrapolated); with no split it took 54 µs at T = 6.
WIDE_TUNING = RouterTuning(k_splits=4)
PER_TOKEN_MAX = 16  # the largest N given VERIFY_TUNING by default
# N > WIDE_MAX (prefill): 64 x 64 dot tiles and no D-split, so each program reuses its tiles over 64 tokens and
# experts and no [KS, N, E] partials are written.
PREFILL_TUNING = RouterTuning(block_e=64, block_n=64, block_k=64, k_splits=1)
WIDE_MAX = 256


def default_tuning(n_tokens: int, router_dtype=jnp.float32) -> RouterTuning:
    """The tuning for N tokens and a router held in `router_dtype` (only T = 1 tells the two apart; the 2..256-token
    tunings were measured with fp32 routers, PREFILL_TUNING with a bf16 one)."""
    if n_tokens == 1:
        return DECODE_TUNING_BF16 if jnp.dtype(router_dtype) == jnp.bfloat16 else DECODE_TUNING
    if n_tokens <= PER_TOKEN_MAX:
        return VERIFY_TUNING
    return WIDE_TUNING if n_tokens <= WIDE_MAX else PREFILL_TUNING


def _f32(w):
    return w if w.dtype == jnp.float32 else w.astype(jnp.float32)  # exact for bf16


def _gemv_rows(x_chunk, w_ref, *, bn, BK, n_chunks, one_row):
    """Partial logits [BN, BE] fp32 of x [BN, D/KS] (compute dtype; `x_chunk(ks)` its columns ks) · w_ref
    [BE, D/KS]ᵀ (one D-split of BE fp32 or bf16 expert rows, read end to end, widened to fp32); `one_row`: BN = 1,
    by FMAs, else a dot (BN >= 16)."""
    be = w_ref.shape[0]
    if one_row:
        def body_fma(c, acc):
            ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
            return acc + jnp.sum(_f32(w_ref[:, ks]) * x_chunk(ks).astype(jnp.float32), axis=1)[None, :]

        return lax.fori_loop(0, n_chunks, body_fma, jnp.zeros((1, be), jnp.float32))

    def pieces(w):
        if w.dtype == jnp.bfloat16:
            return (w,)
        hi = w.astype(jnp.bfloat16)
        rest = w - hi.astype(jnp.float32)
        mid = rest.astype(jnp.bfloat16)
        return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)

    dims = (((1,), (1,)), ((), ()))

    def body_dot(c, acc):
        ks = pl.ds(pl.multiple_of(c * BK, BK), BK)
        x = x_chunk(ks)
        # bf16 x bf16 products are exact in fp32, so with bf16 tokens a tensor-core dot accumulating in fp32
        # computes the fp32 GEMV up to summation order: a bf16 router directly, an fp32 one as three exact bf16
        # pieces (hi + mid + lo = w: 3 x 8 significand bits hold fp32's 24). The full-precision FMA dot, left for
        # fp32 tokens, ran 2.2 TFLOP/s at prefill sizes on the H200 (experiments/RESULTS.md, "Prefill").
        if x.dtype == jnp.bfloat16:
            for piece in pieces(w_ref[:, ks]):
                acc = acc + lax.dot_general(piece, x, dims, preferred_element_type=jnp.float32)
            return acc
        return acc + lax.dot_general(_f32(w_ref[:, ks]), x.astype(jnp.float32), dims,
                                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body_dot, jnp.zeros((be, bn), jnp.float32))
    return acc.T  # [BN, BE]


def router_fwd_kernel_gemv(x_ref, w_ref, *refs, BK, n_chunks, one_row, d, eps):
    # x_ref [BN, D/KS] compute dtype (BN = 1: one token); w_ref [BE, D/KS] fp32 or bf16, one D-split of BE rows;
    # refs: with the norm (eps not None) ss_ref [BN, 1] fp32, x's sums of squares over all D, and g_ref [1, D/KS]
    # the norm weight's split; then l_ref [BN, BE] fp32 partial logits of that split, and with the norm xn_ref
    # [BN, D/KS], the normed x, which the programs of expert block 0 write.
    if eps is None:
        (l_ref,) = refs
        x_chunk = lambda ks: x_ref[:, ks]  # noqa: E731
    else:
        ss_ref, g_ref, l_ref, xn_ref = refs
        inv_rms = lax.rsqrt(ss_ref[:, 0] / d + eps)  # [BN]
        writes_x = pl.program_id(0) == 0

        def x_chunk(ks):
            xn = rms_normed(x_ref[:, ks], g_ref[0, ks], inv_rms)

            @pl.when(writes_x)
            def _():
                xn_ref[:, ks] = xn
            return xn
    l_ref[...] = _gemv_rows(x_chunk, w_ref, bn=x_ref.shape[0], BK=BK, n_chunks=n_chunks, one_row=one_row)


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


def router_fwd_kernel_topk(p_ref, b_ref, *refs, n_tokens, chunks, **select_kw):
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

    issue_prefetch_chunks(pref, chunks, p - n_tokens)


def issue_prefetch_chunks(pref, chunks, q):
    """In a program of a launch with one program per chunk (`_prefetch_chunks(pref, ...)`, the arrays' chunks in
    order): hand chunk q to L2 (q outside [0, number of chunks): nothing)."""
    for ref, (elems, count, last_bytes) in zip(pref, chunks):
        full = elems * ref.dtype.itemsize

        @pl.when((q >= 0) & (q < count - 1))
        def _():
            prefetch_l2(ref, q * elems, full)

        @pl.when(q == count - 1)
        def _():
            prefetch_l2(ref, q * elems, last_bytes)

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


def gemv_partials(x, router, tuning: RouterTuning, norm=None):
    """Kernel 1 -> (partial logits [KS, N_pad, E] fp32 of x [N, D] · router [E, D]ᵀ over the KS D-splits, N_pad
    being N padded to the tokens per program; the normed x [N, D] or None). `norm` (weight [D], eps): x is normed in
    the prologue with `rms_norm`'s roundings, its sums of squares taken by XLA, where they fuse into x's producer."""
    n, d = x.shape
    e = router.shape[0]
    one_row = n == 1 or tuning.multi_token == "per_token"  # one token per GEMV program
    be = min(tuning.block_e, e)
    if not one_row and be < 16:
        raise ValueError(f"RouterTuning.block_e={tuning.block_e} (E={e}: {be} expert rows per program) at N={n} "
                         "tokens: the tensor-core dot needs >= 16; only one-token programs (T = 1, or "
                         "multi_token='per_token') take fewer (N > 1: use router.VERIFY_TUNING)")
    if d % 16:
        raise ValueError(f"the Pallas router needs D={d} divisible by 16")
    ks = _split_count(d, tuning.k_splits)
    dk = d // ks
    bk = min(tuning.block_k, dk & -dk)
    if not one_row and bk < 16:
        raise ValueError(f"RouterTuning.block_k={tuning.block_k} at N={n} tokens with the tensor-core dot: it "
                         "needs >= 16 (one-token FMA programs take any power of two)")
    bn = 1 if one_row else min(tuning.block_n, max(16, next_pow2(n)))
    n_pad = -(-n // bn) * bn
    pad = lambda a: a if n_pad == n else jnp.pad(a, ((0, n_pad - n), (0, 0)))  # noqa: E731
    x_spec = pl.BlockSpec((bn, dk), lambda j, k, i: (i, k))
    in_specs = [x_spec, pl.BlockSpec((be, dk), lambda j, k, i: (j, k))]
    out_specs = [pl.BlockSpec((None, bn, be), lambda j, k, i: (k, i, j))]
    out_shape = [jax.ShapeDtypeStruct((ks, n_pad, e), jnp.float32)]
    args = [pad(x), router]
    eps = None
    if norm is not None:
        weight, eps = norm
        x32 = x.astype(jnp.float32)
        args += [pad(jnp.sum(x32 * x32, axis=1, keepdims=True)), weight.reshape(1, d)]
        in_specs += [pl.BlockSpec((bn, 1), lambda j, k, i: (i, 0)), pl.BlockSpec((1, dk), lambda j, k, i: (0, k))]
        out_specs.append(x_spec)
        out_shape.append(jax.ShapeDtypeStruct((n_pad, d), x.dtype))
    out = pl.pallas_call(
        functools.partial(router_fwd_kernel_gemv, BK=bk, n_chunks=dk // bk, one_row=one_row, d=d,
                          eps=None if eps is None else float(eps)),
        grid=(e // be, ks, n_pad // bn),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret_mode(),
        name="router_fwd_kernel_gemv",
    )(*args)
    return out[0], None if norm is None else out[1][:n]


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "tuning", "eps"))
def route(x, router, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob=True,
          tuning: RouterTuning | None = None, prefetch=(), norm_weight=None, eps=None):
    """Same contract as `reference.route` (router [E, D] fp32 or bf16); shapes already validated by the dispatcher.
    `tuning` None: `default_tuning(N, router.dtype)`. `prefetch`: arrays the caller reads next, handed to L2 by the
    top-k launch when `tuning.prefetch_chunk_bytes` > 0 (a hint: no result depends on it). `norm_weight` [D] and
    `eps`: x is the block's input before its RMSNorm, normed in the GEMV's prologue, and the normed x [N, D] is a
    third result."""
    n = x.shape[0]
    e = router.shape[0]
    tuning = tuning or default_tuning(n, router.dtype)
    for name, v in (("E", e), ("E/n_group", e // n_group), ("top_k", top_k)):
        if v & (v - 1):
            raise ValueError(f"the Pallas router needs power-of-two sizes: {name}={v}")
    if (norm_weight is None) != (eps is None):
        raise ValueError("the router's norm prologue takes norm_weight and eps together (both or neither)")
    norm = None if norm_weight is None else (norm_weight, eps)
    partial, normed = gemv_partials(x, router, tuning, norm)
    ks, n_pad, _ = partial.shape
    gsz = e // n_group
    pref = [a.reshape(-1) for a in prefetch if a.size] if tuning.prefetch_chunk_bytes else []
    chunks = _prefetch_chunks(pref, tuning.prefetch_chunk_bytes)
    tok = lambda i: jnp.minimum(i, n - 1)  # noqa: E731  (prefetch-only programs map onto the last token's blocks)
    w, ids = pl.pallas_call(
        functools.partial(router_fwd_kernel_topk, n_tokens=n, chunks=chunks, topk_group=topk_group, top_k=top_k,
                          scale=float(routed_scaling_factor), norm=bool(norm_topk_prob)),
        grid=(n + sum(c for _, c, _ in chunks),),
        in_specs=[pl.BlockSpec((ks, None, n_group, gsz), lambda i: (0, tok(i), 0, 0)),
                  pl.BlockSpec((n_group, gsz), lambda i: (0, 0))] + [pl.no_block_spec] * len(pref),
        out_specs=[pl.BlockSpec((1, top_k), lambda i: (tok(i), 0)), pl.BlockSpec((1, top_k), lambda i: (tok(i), 0))],
        out_shape=[jax.ShapeDtypeStruct((n, top_k), jnp.float32), jax.ShapeDtypeStruct((n, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.topk_warps, num_stages=1),
        interpret=interpret_mode(),
        name="router_fwd_kernel_topk",
    )(partial.reshape(ks, n_pad, n_group, gsz), expert_bias.reshape(n_group, gsz), *pref)
    return (w, ids) if normed is None else (w, ids, normed)
