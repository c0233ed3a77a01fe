"""How many tokens per verify step would the suffix drafter (ling_jax/engine/suffix.py) commit on a coding agent's
workload, one that re-emits files with small edits?

Run: `PYTHONPATH=. python3 experiments/bench_suffix.py` (CPU is enough; `--smoke`: a tiny version in seconds that
writes nothing under experiments/results).

Workload, deterministic (`--seed`): the .py files of the installed `jax` package (pinned to 0.11.2 by the project)
of `--min-bytes`..`--max-bytes`, sorted by path and shuffled with the seed; the first `--requests` that parse and
take an edit of each kind are the requests, the next `--train-files` train the tokenizer (held out).
  - prompt: an instruction header naming the file and listing its edits, then the original file in a ```python
    block;
  - output: the file re-emitted in a ```python block with the edits applied, as an agent rewriting a file does:
    one identifier (4+ characters, not a keyword or builtin, 2..40 uses) renamed everywhere (`name` -> `name_v2`
    and the like), one integer literal changed (n -> n + 1), two comment lines inserted (indented as the line they
    precede), one line deleted (one whose removal still parses). The edited file parses.
Tokenizer: no Ling tokenizer is available offline, so a byte-level BPE (`tokenizers`, `--vocab` entries) is trained
on the held-out files; prompt and output are encoded separately, as Arctic's simulator does.

Simulation (the method of Arctic Inference's suffix-decoding simulator, written anew): each output is replayed
step by step. At each step the drafter proposes up to k tokens from the history (prompt + output so far); the
accepted count is the longest prefix of the valid drafts equal to the true next tokens; the step commits the
accepted tokens plus the target's own next token (none past the output's end), and the drafter observes them.
The sweep runs SuffixDrafter.propose_host, the drafter's numpy twin (equal drafts: tests/test_suffix.py), since
the jitted device path takes milliseconds per step on a CPU. For the largest k and the last cut-off of each
history, the first `--check-requests` requests are also replayed through the jitted `propose` / `observe` inside
one `lax.while_loop` per request, and every step (tokens committed, drafts, accepted) must equal the host replay.
Reported per (history, k, min_token_prob):
  - accept_len: committed tokens / verify steps over all requests (SGLang's accept length, bonus included);
  - accept_len_req: the mean over requests of each one's committed / steps (Arctic's simulator speed-up);
  - proposal_frac: steps with at least one valid draft; drafted: valid drafts per step; accept_rate: accepted /
    drafted (what the min_token_prob cut-off trades: fewer wasted verify positions against accept length).
History: `request` holds only the current request, its newest `--capacity` tokens (the drafter's default 4096: a
long request's oldest tokens drop out); `global` also holds every earlier request's prompt and output, oldest
dropped first (`--global-capacity`), as Arctic's global tree caches earlier responses.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import json
import keyword
import random
import re
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from common import print_table, run_header, write_results
from ling_jax.engine.suffix import SuffixDrafter

RENAME_SUFFIXES = ("_v2", "_new", "_impl", "_local")
COMMENTS = ("# Keep the previous behaviour for compatibility.", "# TODO: validate the inputs here.",
            "# The fast path comes first.", "# Callers rely on this order.")
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
RESERVED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}


def source_files(min_bytes: int, max_bytes: int, seed: int) -> tuple[Path, list[Path]]:
    root = Path(jax.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if min_bytes <= p.stat().st_size <= max_bytes)
    random.Random(seed).shuffle(files)
    return root.parent, files


def parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


def rename(text: str, rng: random.Random) -> tuple[str, str] | None:
    counts = Counter(IDENTIFIER.findall(text))
    names = sorted(n for n, c in counts.items() if 2 <= c <= 40 and len(n) >= 4 and n not in RESERVED)
    if not names:
        return None
    old = rng.choice(names)
    new = old + rng.choice(RENAME_SUFFIXES)
    return re.sub(rf"\b{old}\b", new, text), f"rename `{old}` to `{new}` everywhere"


def change_literal(text: str, rng: random.Random) -> tuple[str, str] | None:
    found = list(INTEGER.finditer(text))
    if not found:
        return None
    m = rng.choice(found)
    line = text.count("\n", 0, m.start()) + 1
    new = str(int(m.group()) + 1)
    return text[:m.start()] + new + text[m.end():], f"change the literal {m.group()} on line {line} to {new}"


def insert_comment(text: str, rng: random.Random) -> tuple[str, str] | None:
    lines = text.split("\n")
    at = rng.randrange(len(lines))
    indent = re.match(r"\s*", lines[at]).group()
    comment = indent + rng.choice(COMMENTS)
    return "\n".join(lines[:at] + [comment] + lines[at:]), f"insert `{comment.strip()}` before line {at + 1}"


def delete_line(text: str, rng: random.Random) -> tuple[str, str] | None:
    lines = text.split("\n")
    candidates = [i for i, line in enumerate(lines) if line.strip()]
    for at in rng.sample(candidates, min(len(candidates), 20)):
        edited = "\n".join(lines[:at] + lines[at + 1:])
        if parses(edited):
            return edited, f"delete line {at + 1} (`{lines[at].strip()[:40]}`)"
    return None


EDITS = (rename, change_literal, insert_comment, insert_comment, delete_line)


def agent_rewrite(text: str, rng: random.Random) -> tuple[str, list[str]] | None:
    """(the edited file, the instructions) or None when an edit finds nothing to change or the result fails to
    parse."""
    instructions = []
    for edit in EDITS:
        done = edit(text, rng)
        if done is None:
            return None
        text, what = done
        instructions.append(what)
    return (text, instructions) if parses(text) else None


def build_requests(files: list[Path], root: Path, n: int, seed: int) -> tuple[list[dict], list[Path]]:
    """The first n files that parse and take every edit, and the files after them (held out)."""
    requests = []
    for i, path in enumerate(files):
        original = path.read_text(encoding="utf-8", errors="replace")
        name = str(path.relative_to(root))
        rewritten = agent_rewrite(original, random.Random(f"{seed}:{name}")) if parses(original) else None
        if rewritten is None:
            continue
        edited, instructions = rewritten
        prompt = (f"Rewrite {name} with these edits and return the whole file:\n"
                  + "".join(f"- {line}\n" for line in instructions) + f"\n```python\n{original}```\n")
        requests.append(dict(file=name, prompt=prompt, output=f"```python\n{edited}```\n"))
        if len(requests) == n:
            return requests, files[i + 1:]
    raise SystemExit(f"only {len(requests)} of {n} requests could be built; lower --requests or widen "
                     f"--min-bytes/--max-bytes")


def train_tokenizer(files: list[Path], vocab: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([p.read_text(encoding="utf-8", errors="replace") for p in files], trainer)
    return tokenizer


@functools.partial(jax.jit, static_argnames=("drafter", "k"))
def replay_on_device(drafter: SuffixDrafter, k: int, history, length, truth, out_len):
    """One request through the drafter's jitted propose / observe: history [1, capacity] (the prompt and, for a
    global history, earlier requests), truth [P] the output padded with -1. -> int32 [3, P]: per step the tokens
    committed, the valid drafts and the accepted drafts (zeros after the last step)."""

    def step(carry):
        state, pos, i, log = carry
        drafts, valid = drafter.propose(state, k)
        upcoming = jax.lax.dynamic_slice(truth, (pos,), (k + 1,))
        accepted = jnp.sum(jnp.cumprod((drafts[0] == upcoming[:k]) & valid[0], dtype=jnp.int32))
        n = jnp.minimum(accepted + 1, out_len - pos)
        state = drafter.observe(state, jnp.maximum(upcoming, 0)[None], n)
        log = log.at[:, i].set(jnp.stack([n, jnp.sum(valid, dtype=jnp.int32), accepted]))
        return state, pos + n, i + 1, log

    carry = (drafter.init(history, length), jnp.int32(0), jnp.int32(0), jnp.zeros((3, truth.shape[0]), jnp.int32))
    return jax.lax.while_loop(lambda c: c[1] < out_len, step, carry)[3]


def replay_on_host(drafter: SuffixDrafter, k: int, context: list[int], output: list[int]) -> np.ndarray:
    """The same replay through SuffixDrafter.propose_host (equal drafts, tested): int32 [3, steps]."""
    sequence = np.array(context + output, np.int64)
    start, pos, log = len(context), 0, []
    while pos < len(output):
        drafts = drafter.propose_host(sequence[max(0, start + pos - drafter.capacity):start + pos], k)
        accepted = 0
        while accepted < len(drafts) and pos + accepted < len(output) and drafts[accepted] == output[pos + accepted]:
            accepted += 1
        n = min(accepted + 1, len(output) - pos)
        log.append((n, len(drafts), accepted))
        pos += n
    return np.array(log, np.int32).T


def contexts(requests: list[dict], global_history: bool) -> list[list[int]]:
    """What each request's history holds before its output: its prompt, after every earlier request's prompt and
    output when the history is global."""
    earlier, out = [], []
    for r in requests:
        out.append(earlier + r["prompt_ids"])
        if global_history:
            earlier = earlier + r["prompt_ids"] + r["output_ids"]
    return out


def check_device_path(requests, drafter, k, global_history) -> None:
    """Replay the requests through the jitted device path too; every step must match the host replay."""
    pad = max(len(r["output_ids"]) for r in requests) + k + 1
    for r, context in zip(requests, contexts(requests, global_history)):
        kept = context[-drafter.capacity:]
        history = np.zeros((1, drafter.capacity), np.int32)
        history[0, :len(kept)] = kept
        truth = np.full(pad, -1, np.int32)
        truth[:len(r["output_ids"])] = r["output_ids"]
        device = np.asarray(replay_on_device(drafter, k, history, np.array([len(kept)], np.int32), truth,
                                             np.int32(len(r["output_ids"]))))
        host = replay_on_host(drafter, k, context, r["output_ids"])
        steps = host.shape[1]
        if not (np.array_equal(device[:, :steps], host) and not device[:, steps:].any()):
            raise SystemExit(f"{r['file']}: the device and host replays differ ({drafter}, k={k})")


def summarise(logs: list[np.ndarray]) -> dict:
    committed, drafted, accepted = np.concatenate(logs, axis=1).sum(axis=1)
    steps = sum(log.shape[1] for log in logs)
    proposing = sum(int((log[1] > 0).sum()) for log in logs)
    return dict(accept_len=round(committed / steps, 3),
                accept_len_req=round(float(np.mean([log[0].sum() / log.shape[1] for log in logs])), 3),
                proposal_frac=round(proposing / steps, 3), drafted=round(drafted / steps, 2),
                accept_rate=round(accepted / max(drafted, 1), 3), steps=int(steps), tokens=int(committed))


def time_propose(spec: str, max_match: int, steps: int = 50, repeats: int = 5) -> None:
    """Device time of one propose + observe at each capacity:k, chained `steps` times in one executable."""
    rows = []
    for item in spec.split(","):
        capacity, k = map(int, item.split(":"))
        history = jax.random.randint(jax.random.key(0), (1, capacity), 0, 64)  # a small alphabet: many matches
        for counting in ("pairs", "sorted"):
            drafter = SuffixDrafter(capacity=capacity, max_match=max_match, counting=counting)

            @jax.jit
            def chain(state):
                def body(_, state):
                    drafts, valid = drafter.propose(state, k)
                    return drafter.observe(state, jnp.concatenate([drafts, drafts[:, :1]], 1), jnp.int32(1))
                return jax.lax.fori_loop(0, steps, body, state)

            state = drafter.init(history)
            jax.block_until_ready(chain(state))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(chain(state))
                times.append((time.perf_counter() - t0) / steps * 1e6)
            rows.append(dict(capacity=capacity, k=k, counting=counting, us_per_step=round(float(np.median(times)), 1)))
            print(json.dumps(rows[-1]), flush=True)
    write_results("bench_suffix_propose.json", dict(rows=rows, **run_header()), to_repo=jax.default_backend() != "cpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--train-files", type=int, default=120, help="held-out files the tokenizer is trained on")
    ap.add_argument("--min-bytes", type=int, default=2000)
    ap.add_argument("--max-bytes", type=int, default=8000)
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    ap.add_argument("--ks", default="1,3,5,8,16", help="draft lengths")
    ap.add_argument("--probs", default="0,0.1,0.5", help="min_token_prob cut-offs")
    ap.add_argument("--histories", default="request,global")
    ap.add_argument("--capacity", type=int, default=4096,
                    help="history tokens of the per-request runs (the drafter's default)")
    ap.add_argument("--global-capacity", type=int, default=32768, help="history tokens of the global runs")
    ap.add_argument("--max-match", type=int, default=64)
    ap.add_argument("--min-match", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-requests", type=int, default=2,
                    help="requests also replayed through the jitted device path, for the largest k and the last "
                         "cut-off of each history: every step must equal the host replay")
    ap.add_argument("--smoke", action="store_true", help="3 small requests, k 1 and 4, on the CPU in seconds")
    ap.add_argument("--time-propose", default="",
                    help="capacity:k pairs, e.g. 4096:5,4096:16: time the jitted propose + observe per step "
                         "(batch 1, both counting methods, 50 chained steps, median of 5) and exit")
    args = ap.parse_args()
    if args.time_propose:
        return time_propose(args.time_propose, args.max_match)
    if args.smoke:
        args.requests, args.train_files, args.min_bytes, args.max_bytes, args.vocab = 3, 8, 1000, 2500, 1024
        args.ks, args.probs, args.capacity, args.global_capacity = "1,4", "0,0.5", 2048, 3072
        args.check_requests = 3
    ks = [int(k) for k in args.ks.split(",")]
    probs = [float(p) for p in args.probs.split(",")]
    histories = args.histories.split(",")
    if unknown := set(histories) - {"request", "global"}:
        raise SystemExit(f"--histories {','.join(sorted(unknown))}: unknown; use request, global or both")
    meta = run_header()

    root, files = source_files(args.min_bytes, args.max_bytes, args.seed)
    requests, held_out = build_requests(files, root, args.requests, args.seed)
    tokenizer = train_tokenizer(held_out[:args.train_files], args.vocab)
    for r in requests:
        r["prompt_ids"] = tokenizer.encode(r["prompt"]).ids
        r["output_ids"] = tokenizer.encode(r["output"]).ids
    tokenizer_line = (f"byte-level BPE, {tokenizer.get_vocab_size()} entries, trained on "
                      f"{len(held_out[:args.train_files])} held-out jax {jax.__version__} files (no Ling tokenizer "
                      f"offline)")
    print(f"{len(requests)} requests from jax {jax.__version__} sources; tokenizer: {tokenizer_line}")
    print(f"prompt tokens {sum(len(r['prompt_ids']) for r in requests)}, output tokens "
          f"{sum(len(r['output_ids']) for r in requests)} (largest prompt + output "
          f"{max(len(r['prompt_ids']) + len(r['output_ids']) for r in requests)})", flush=True)

    rows = []
    for history in histories:
        capacity = args.capacity if history == "request" else args.global_capacity
        context = contexts(requests, history == "global")
        for p in probs:
            drafter = SuffixDrafter(capacity=capacity, max_match=args.max_match, min_token_prob=p,
                                    min_match=args.min_match)
            for k in ks:
                t0 = time.perf_counter()
                logs = [replay_on_host(drafter, k, c, r["output_ids"]) for c, r in zip(context, requests)]
                rows.append(dict(history=history, capacity=capacity, k=k, min_token_prob=p, **summarise(logs),
                                 s=round(time.perf_counter() - t0, 1)))
                print(" ".join(f"{c}={rows[-1][c]}" for c in ("history", "k", "min_token_prob", "accept_len", "s")),
                      flush=True)
        if args.check_requests:
            t0 = time.perf_counter()
            check_device_path(requests[:args.check_requests], drafter, max(ks), history == "global")
            print(f"device path = host path, step for step: {args.check_requests} requests, {history} history, "
                  f"k={max(ks)}, min_token_prob={p} ({time.perf_counter() - t0:.1f} s)", flush=True)
    columns = ["history", "capacity", "k", "min_token_prob", "accept_len", "accept_len_req", "proposal_frac", "drafted",
               "accept_rate", "steps", "s"]
    print_table(rows, columns)
    results = dict(meta, args=vars(args), tokenizer=tokenizer_line, max_match=args.max_match,
                   min_match=args.min_match, files=[r["file"] for r in requests],
                   prompt_tokens=[len(r["prompt_ids"]) for r in requests],
                   output_tokens=[len(r["output_ids"]) for r in requests],
                   device_checked=dict(requests=args.check_requests, k=max(ks), min_token_prob=probs[-1]), rows=rows)
    write_results("bench_suffix.json", results, to_repo=not args.smoke)


if __name__ == "__main__":
    main()
