"""Suffix decoding: a model-free drafter that proposes what followed the longest earlier match of the most recent
tokens, computed on device over a bounded history array (the method of Arctic Inference's suffix decoding and
SGLang's `--speculative-algorithm suffix`, without a suffix tree).

    SuffixState
      history  int32 [B, capacity]  committed tokens, oldest first; slots from `length` on hold 0
      length   int32 [B]            tokens held (<= capacity; when full, the oldest are dropped)

Definitions, per row, with h = history[:length] and L = length:
  - Match. For an end position i < L - 1, m(i) is the number of tokens, at most `max_match`, on which the text
    ending at h[i] and the text ending at h[L - 1] agree, read backwards. The end L - 1 itself is no candidate (it
    has no continuation yet). The longest match is m* = max m(i); the match set S is every i with m(i) = m*, and
    nothing is proposed when m* < `min_match`.
  - Draft t (0-based) follows one path: its candidates C_t are the i in S whose t tokens after the match equal
    drafts[:t] and whose next token h[i + t + 1] lies inside the history (drafts never run past its end). The
    draft is the most frequent next token over C_t; a tie goes to the token that occurs at the largest i (the
    most recent match). Its probability is (the candidates of C_t that continue with it) / |S|: the fraction of
    all matches that continued with drafts[:t + 1], i.e. the product of the conditional frequencies along the
    path, as Arctic's tree scores a path.
  - A draft is valid while its probability is > 0 and >= `min_token_prob`; from the first invalid one on, every
    draft is invalid and holds token 0 (a real id, so a verify forward may embed it).
Where Arctic's suffix tree differs: it scores the path of every match length and keeps the best-scoring one, which
may start from a shorter, more frequent match (this drafter always takes the longest match, the most specific
evidence); its node counts include the current suffix itself, which has no continuation (left out of |S| here);
and its depth, match plus draft, stops at 64 tokens (here only the history's end stops a draft).

Cost per row and step: `propose` gathers and compares max_match × capacity tokens (the match lengths of every end
position at once); then, per draft position, counting by pairs compares capacity² token pairs in one fused
reduction, counting sorted sorts the candidates' k-token continuations once and runs two binary searches per
position (O(k · capacity · log capacity)). On the H200 (experiments/RESULTS.md), batch 1, max_match 64, chained:
54 µs for k = 5 and 142 µs for k = 16 at capacity 4096 by pairs (120 and 311 µs sorted); `observe` moves
O(capacity) tokens. No
vocabulary-sized array appears anywhere, and everything is static-shaped and branch-free: no `cond`, no
data-dependent loop, no host read.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Continuation keys above every token id: a match's continuation past the history's end, and a non-candidate
# (sorted after every candidate).
_PAST_END = np.iinfo(np.int32).max - 1
_NO_MATCH = np.iinfo(np.int32).max
# The largest capacity whose (count · capacity + position) scores fit in int32.
MAX_CAPACITY = 46340
# Up to this capacity "auto" counts by pairs: on the H200 at 4096 tokens a 5-token proposal took 54 µs by pairs
# against 120 µs sorted; at 8192 both took 119-140 µs, and pairs grow quadratically from there.
PAIRS_MAX_CAPACITY = 4096


class SuffixState(NamedTuple):
    history: jax.Array  # int32 [B, capacity]
    length: jax.Array  # int32 [B]


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    capacity: int = 4096  # history tokens kept per row
    max_match: int = 64  # longest suffix compared
    min_token_prob: float = 0.1  # drafts whose path frequency among the matches is below it are cut (Arctic: 0.1)
    min_match: int = 1  # shorter longest-matches propose nothing
    # How the continuations are counted, same drafts either way: "pairs" compares every candidate with every other
    # (capacity² per draft, fastest on a GPU up to a few thousand tokens), "sorted" sorts them once (capacity · log
    # capacity per draft); "auto" takes pairs up to PAIRS_MAX_CAPACITY.
    counting: str = "auto"

    def __post_init__(self):
        if not (isinstance(self.capacity, int) and 2 <= self.capacity <= MAX_CAPACITY):
            raise ValueError(f"SuffixDrafter capacity={self.capacity!r} must be an int in [2, {MAX_CAPACITY}] "
                             f"(an earlier occurrence and the current token; a count · capacity fits in int32); "
                             f"use e.g. 4096")
        if not (isinstance(self.max_match, int) and self.max_match >= 1):
            raise ValueError(f"SuffixDrafter max_match={self.max_match!r} must be an int >= 1; use e.g. 64")
        if not (isinstance(self.min_match, int) and 1 <= self.min_match <= self.max_match):
            raise ValueError(f"SuffixDrafter min_match={self.min_match!r} must be an int in [1, max_match="
                             f"{self.max_match}]; use 1 or 2")
        if self.counting not in ("auto", "pairs", "sorted"):
            raise ValueError(f"SuffixDrafter counting={self.counting!r} is unknown; use auto, pairs or sorted")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"SuffixDrafter min_token_prob={self.min_token_prob!r} must lie in [0, 1]; "
                             f"use 0 to propose every continuation, e.g. 0.1 to cut rare ones")

    def init(self, prompt: jax.Array, lengths: jax.Array | None = None) -> SuffixState:
        """prompt [B, T] int32, every committed token (rows right-padded when `lengths` [B] says how many are
        real); each row keeps its last `capacity` tokens."""
        prompt = jnp.asarray(prompt)
        if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
            raise ValueError(f"SuffixDrafter.init: prompt has shape {prompt.shape} and dtype {prompt.dtype}; "
                             f"pass token ids [B, T] as int32")
        batch, width = prompt.shape
        if lengths is None:
            lengths = jnp.full((batch,), width, jnp.int32)
        empty = SuffixState(jnp.zeros((batch, self.capacity), jnp.int32), jnp.zeros((batch,), jnp.int32))
        return self._append(empty, prompt.astype(jnp.int32), jnp.asarray(lengths, jnp.int32))

    def propose(self, state: SuffixState, k: int) -> tuple[jax.Array, jax.Array]:
        """-> drafts [B, k] int32, valid [B, k] bool (a prefix of each row is valid; see the module docstring)."""
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"SuffixDrafter.propose: k={k!r} must be a static int >= 1 (the draft length)")
        return jax.vmap(lambda h, n: self._propose_row(h, n, k))(state.history, state.length)

    def observe(self, state: SuffixState, tokens: jax.Array, n: jax.Array) -> SuffixState:
        """Append tokens[:, :n] (tokens [B, W] int32; n int32, a scalar or one per row, clipped to [0, W])."""
        n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), state.length.shape)
        return self._append(state, tokens.astype(jnp.int32), n)

    def propose_host(self, tokens: np.ndarray, k: int) -> list[int]:
        """The valid drafts `propose` returns for a row whose committed tokens are `tokens` (1-D), computed on the
        host with numpy: for replaying long workloads on a CPU, where the device path is slow. It narrows the set of
        ends whose match reaches each length instead of comparing every end at every length."""
        history = np.asarray(tokens, np.int64)[-self.capacity:]
        last = len(history) - 1
        reach = np.flatnonzero(history[:max(last, 0)] == history[last]) if last > 0 else np.zeros(0, np.int64)
        longest = 0
        while reach.size and longest < self.max_match:  # reach: the ends whose match is >= longest + 1
            longest, matches = longest + 1, reach
            reach = reach[reach >= longest]
            reach = reach[history[reach - longest] == history[last - longest]]
        if longest < self.min_match:
            return []
        drafts, path = [], matches
        for t in range(k):
            path = path[path + t + 1 <= last]
            if not path.size:
                break
            following = history[path + t + 1]
            _, which, counts = np.unique(following, return_inverse=True, return_counts=True)
            run = counts[which]
            best = run.max()
            # The device compares in float32; so does this, for the same verdict at every cut-off.
            if np.float32(best) / np.float32(matches.size) < np.float32(self.min_token_prob):
                break
            token = history[path[run == best].max() + t + 1]
            drafts.append(int(token))
            path = path[following == token]
        return drafts

    def _append(self, state: SuffixState, tokens: jax.Array, n: jax.Array) -> SuffixState:
        capacity, width = self.capacity, tokens.shape[1]

        def row(history, length, new, count):
            count = jnp.clip(count, 0, width)
            joined = jnp.zeros((capacity + width,), jnp.int32).at[:capacity].set(history)
            joined = jax.lax.dynamic_update_slice(joined, new, (length,))
            total = length + count
            kept = jax.lax.dynamic_slice(joined, (jnp.maximum(total - capacity, 0),), (capacity,))
            new_length = jnp.minimum(total, capacity)
            return jnp.where(jnp.arange(capacity) < new_length, kept, 0), new_length

        history, length = jax.vmap(row)(state.history, state.length, tokens, n)
        return SuffixState(history, length)

    def _match_lengths(self, history: jax.Array, length: jax.Array) -> jax.Array:
        """m(i) for every end position i (0 where i is no candidate)."""
        capacity, max_match = self.capacity, self.max_match
        ends = jnp.arange(capacity)
        back = jnp.arange(max_match)
        suffix_at = length - 1 - back  # the suffix read backwards
        suffix = history[jnp.maximum(suffix_at, 0)]
        window_at = ends[None, :] - back[:, None]  # [max_match, capacity]: the text ending at each i, backwards
        agree = (history[jnp.maximum(window_at, 0)] == suffix[:, None]) & (window_at >= 0) & (suffix_at[:, None] >= 0)
        # A final all-false row makes the first disagreement exist, so a full agreement counts max_match.
        agree = jnp.concatenate([agree, jnp.zeros((1, capacity), bool)])
        match = jnp.argmin(agree, axis=0).astype(jnp.int32)
        return jnp.where(ends < length - 1, match, 0)

    def _propose_row(self, history: jax.Array, length: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        match = self._match_lengths(history, length)
        longest = jnp.max(match)
        candidates = (match == longest) & (longest >= self.min_match)
        n_matches = jnp.maximum(jnp.sum(candidates, dtype=jnp.int32), 1)
        by_pairs = self.counting == "pairs" or (self.counting == "auto" and self.capacity <= PAIRS_MAX_CAPACITY)
        path = _path_by_pairs if by_pairs else _path_by_sorting
        alive = jnp.array(True)
        drafts, valid = [], []
        for token, count in path(history, length, candidates, k):
            alive &= (count > 0) & (count.astype(jnp.float32) / n_matches >= self.min_token_prob)
            drafts.append(jnp.where(alive, token, 0))
            valid.append(alive)
        return jnp.stack(drafts), jnp.stack(valid)


# Both paths yield, per draft position t, (the token, how many matches continue with the path through it); they
# agree exactly (tested). k is small and static: the loops unroll, so the graph holds no loop.

def _path_by_pairs(history, length, candidates, k):
    """Counts each candidate's next token against every other candidate's: one fused capacity² reduction per
    draft position."""
    capacity = history.shape[0]
    ends = jnp.arange(capacity)
    for t in range(k):
        at = ends + t + 1
        candidates &= at < length
        following = history[jnp.minimum(at, capacity - 1)]
        run = jnp.sum((following[None, :] == following[:, None]) & candidates[None, :], axis=1, dtype=jnp.int32)
        token, count = _pick(run, candidates, ends, history, t)
        yield token, count
        candidates &= following == token


def _path_by_sorting(history, length, candidates, k):
    """Sorts the candidates once by their continuations (lexicographically, non-candidates last): the candidates
    of every path are then one contiguous range of rows [lo, hi), itself sorted by the token that comes next, and
    each run's length comes from two binary searches."""
    capacity = history.shape[0]
    rows = jnp.arange(capacity)
    at = rows[None, :] + jnp.arange(1, k + 1)[:, None]
    follow = jnp.where(at < length, history[jnp.minimum(at, capacity - 1)], _PAST_END)
    follow = jnp.where(candidates[None, :], follow, _NO_MATCH)
    *follow, end_at = jax.lax.sort((*follow, rows), num_keys=k)
    lo, hi = jnp.int32(0), jnp.sum(candidates, dtype=jnp.int32)
    for t, column in enumerate(follow):
        on_path = (rows >= lo) & (rows < hi)
        # Rows below the range at -1 and above it at _NO_MATCH keep the whole column sorted.
        keys = jnp.where(on_path, column, jnp.where(rows < lo, -1, _NO_MATCH))
        # scan_unrolled: the binary search as straight-line code.
        run = (jnp.searchsorted(keys, keys, side="right", method="scan_unrolled")
               - jnp.searchsorted(keys, keys, side="left", method="scan_unrolled"))
        token, count = _pick(run, on_path & (column != _PAST_END), end_at, history, t)
        yield token, count
        lo = jnp.searchsorted(keys, token, side="left", method="scan_unrolled").astype(jnp.int32)
        hi = lo + count


def _pick(run, eligible, end_at, history, t):
    """(the token of the longest run among the eligible rows, its length); a tie goes to the latest match. One
    reduction does both: score = run · capacity + end. Length 0 when no row is eligible."""
    capacity = history.shape[0]
    score = jnp.max(jnp.where(eligible, run * capacity + end_at, -1))
    count = jnp.where(score >= 0, score // capacity, 0)
    return history[jnp.clip(score % capacity + t + 1, 0, capacity - 1)], count
