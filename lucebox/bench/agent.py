"""`python -m lucebox bench agent`: time to first token, turn by turn, of replayed coding-agent sessions.

An agent client sends the same long system prompt with every request, plus the
whole conversation so far, and waits for the first token before it can act. So
what a user of an agent feels is the TTFT of a *warm* turn: a long cached
prefix and a few hundred new tokens. This benchmark replays such sessions
against a server and reports exactly that, the same way for any
OpenAI-compatible server (`--url`: Lucebox, llama-server, vLLM), or for a
Lucebox it starts itself on `--model`.

The workload, deterministic given `--seed` (and the server's greedy replies):
  - one fixed system prefix shared by every session: the real Codex CLI system
    prompts of lucebox/data/agent_prompts, after a first line that depends on
    the seed (a new seed is a new, uncached prefix), repeated or cut to about
    `--prefix-tokens` tokens as the server's tokenizer counts them;
  - `--sessions` sessions of `--turns` turns: the first user message is a
    SWE-bench issue (a different one per session); each later turn appends the
    model's previous reply and one new user message, either a synthetic tool
    result (a SWE-bench patch or test patch presented as command output) or a
    follow-up from the user (SWE-bench hints), each cut to at most
    `--turn-tokens`; their sizes are the data's own;
  - `max_tokens` = `--max-tokens` (1 by default: the request measures prefill),
    greedy, streamed with `stream_options.include_usage`.

Turn 1 of session 1 runs alone first: it is the one *cold* turn (nothing
cached, unless the server already saw this seed's prefix, which is reported).
Every other turn is *warm*: its prefix is one the server has seen. Then with
`--concurrency 1` the sessions interleave, one request at a time, round robin
(session 1 turn 2, session 2 turn 2, ...), the pattern that makes one
session's cache compete with another's; with `--concurrency C` every session
runs its turns in order and at most C requests are in flight.

Per turn: TTFT (request sent -> first frame carrying generated content, or its
finish frame when the one token is invisible), total time, prompt and
completion tokens (usage), cached tokens when the server reports them
(`usage.prompt_tokens_details.cached_tokens`, or llama.cpp's
`timings.cache_n`). Warm turns are grouped by the size of what they append
(power-of-two buckets of new tokens); the "no stalls" check of issue 12 is the
largest TTFT of a bucket over that bucket's median, which should stay at most
STALL_LIMIT.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lucebox.bench.http_client import HttpClientError, SSEFrame, get_json, request_json, stream_sse
from lucebox.bench.report import environment, print_table, write_json
from lucebox.bench.serve import ServerProcess, load_documents, parse_chat_frame, percentile, wait_ready
from lucebox.data import data_dir as resolve_data_dir
from lucebox.errors import LuceboxError
from lucebox.progress import Progress

COLD, WARM = "cold", "warm"
STALL_LIMIT = 1.3
"""Issue 12: across a replay no turn is slower than 1.3x the median of turns of its size."""
DEFAULT_PREFIX_TOKENS = 20_000
"""The issue's agent prefix; clipped to what the server's context leaves after the history."""
CHARS_PER_TOKEN = 4.0
"""How text is measured when the server has no /tokenize (then every size is an estimate)."""
TOOL_SHARE = 0.7
"""Share of later turns that append a tool result rather than a user follow-up."""
TURN_OVERHEAD = 24
"""Tokens per turn the chat template and the reply add, for the context check (an allowance)."""


# ----- statistics ----------------------------------------------------------------------


def size_bucket(tokens: int) -> int:
    """Lower bound of the power-of-two bucket holding `tokens` new tokens (0 for none): 300 -> 256."""
    return 0 if tokens < 1 else 1 << (tokens.bit_length() - 1)


def bucket_label(lo: int) -> str:
    return "0" if lo == 0 else f"{lo}-{2 * lo - 1}"


@dataclass
class Turn:
    """One request of one session, as measured."""

    session: int
    turn: int
    kind: str
    """COLD or WARM."""
    appended: str
    """What this turn appended: task (first user message), tool (a tool result) or user (a follow-up)."""
    new_tokens: int
    """Tokens of the appended message, counted by the server's tokenizer (or estimated), template excluded."""
    start: float = 0.0
    end: float = 0.0
    first: float | None = None
    """perf_counter() of the first frame with generated content."""
    finish: float | None = None
    """perf_counter() of the first frame with a finish_reason."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    reply: list[str] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        stamp = self.first if self.first is not None else self.finish
        return None if stamp is None else stamp - self.start

    @property
    def bucket(self) -> int:
        return size_bucket(self.new_tokens)

    def record(self, t0: float) -> dict[str, Any]:
        ttft = self.ttft
        return {
            "session": self.session, "turn": self.turn, "kind": self.kind, "appended": self.appended,
            "new_tokens": self.new_tokens, "bucket": COLD if self.kind == COLD else bucket_label(self.bucket),
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": None if ttft is None else ttft * 1000,
            "ttft_from": "content" if self.first is not None else ("finish" if self.finish is not None else None),
            "total_ms": (self.end - self.start) * 1000,
            "sent_at_s": self.start - t0,
            "error": self.error,
        }


def _median(values: Sequence[float | int]) -> float | None:
    return statistics.median(values) if values else None


def ttft_stats(turns: Sequence[Turn]) -> dict[str, Any]:
    """TTFT p50/p99/max (ms) and median sizes over the turns that succeeded."""
    ok = [t for t in turns if t.error is None and t.ttft is not None]
    ms = [t.ttft * 1000 for t in ok]  # type: ignore[operator]
    cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
    return {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "ttft_ms": {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms) if ms else None},
        "new_tokens_p50": _median([t.new_tokens for t in ok]),
        "prompt_tokens_p50": _median([t.prompt_tokens for t in ok if t.prompt_tokens is not None]),
        "cached_tokens_p50": _median(cached),
        "turns_reporting_cached": len(cached),
    }


def bucket_stats(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """The warm turns grouped by new-token bucket, smallest first; each with max/median TTFT (its stall ratio)."""
    groups: dict[int, list[Turn]] = {}
    for t in turns:
        if t.kind == WARM:
            groups.setdefault(t.bucket, []).append(t)
    out = []
    for lo in sorted(groups):
        s = ttft_stats(groups[lo])
        ms = s["ttft_ms"]
        ratio = ms["max"] / ms["p50"] if ms["p50"] else None
        out.append({"bucket": bucket_label(lo), "bucket_lo": lo, **s, "stall_ratio": ratio})
    return out


def stall_check(buckets: Sequence[dict[str, Any]], limit: float = STALL_LIMIT) -> dict[str, Any]:
    """The worst bucket's max/median TTFT against `limit`; buckets of one turn cannot stall and are skipped."""
    judged = [b for b in buckets if b["stall_ratio"] is not None and b["turns"] - b["errors"] >= 2]
    worst = max(judged, key=lambda b: b["stall_ratio"], default=None)
    ratio = worst["stall_ratio"] if worst else None
    return {"limit": limit, "max_ratio": ratio, "bucket": worst["bucket"] if worst else None,
            "buckets_judged": len(judged), "no_stalls": None if ratio is None else ratio <= limit}


def summarize(turns: Sequence[Turn]) -> dict[str, Any]:
    buckets = bucket_stats(turns)
    return {"cold": ttft_stats([t for t in turns if t.kind == COLD]),
            "warm": ttft_stats([t for t in turns if t.kind == WARM]),
            "buckets": buckets, "stalls": stall_check(buckets)}


# ----- token counting ------------------------------------------------------------------


class TokenCounter:
    """Counts tokens with the server's own tokenizer: POST /tokenize, in the llama.cpp / Lucebox form
    ({"content"}) or vLLM's ({"model", "prompt"}); without either, CHARS_PER_TOKEN estimates."""

    def __init__(self, base: str, model: str, headers: dict[str, str]) -> None:
        self.base, self.model, self.headers = base, model, headers
        self.method = "estimate"

    async def probe(self) -> str:
        for method in ("llama.cpp", "vllm"):
            self.method = method
            try:
                await self.count("hello world")
                return method
            except (HttpClientError, KeyError, TypeError):
                continue
        self.method = "estimate"
        return self.method

    async def count(self, text: str) -> int:
        if self.method == "estimate":
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        body: dict[str, Any] = ({"content": text} if self.method == "llama.cpp" else
                                {"model": self.model, "prompt": text, "add_special_tokens": False})
        status, obj = await request_json("POST", self.base + "/tokenize", body, headers=self.headers)
        if status != 200:
            raise HttpClientError(f"POST {self.base}/tokenize -> {status}")
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise TypeError("tokens is not a list")
        return len(tokens)


def _cut(text: str, chars: int) -> str:
    """The first `chars` characters, ended at the last whitespace when one is near (no half words)."""
    head = text[:max(chars, 1)]
    space = max(head.rfind(" "), head.rfind("\n"))
    return head[:space] if space > len(head) - 200 and space > 0 else head


async def trim(counter: TokenCounter, text: str, target: int) -> tuple[str, int]:
    """`text` cut to about `target` tokens (within ~2%), and its token count; shorter text is kept whole."""
    n = await counter.count(text)
    cut = text
    for _ in range(4):
        if n <= target * 1.02 and (n >= target * 0.98 or len(cut) == len(text)):
            break
        cut = _cut(text, int(len(cut) * target / max(n, 1)))
        n = await counter.count(cut)
    return cut, n


# ----- workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    appended: str
    """task | tool | user"""
    content: str
    tokens: int


@dataclass(frozen=True)
class Pools:
    """Real texts the turns are made of, and where they came from."""

    tasks: list[str]
    tools: list[str]
    followups: list[str]
    source: str


def load_pools(data_dir: Path) -> Pools:
    """SWE-bench issues (tasks), patches and test patches (tool results), hints (follow-ups); without the
    parquet file (another --data-dir), the prompts/*.jsonl texts stand in for all three."""
    parquet = data_dir / "swe_bench_verified.parquet"
    if parquet.is_file():
        from lucebox.train.data import read_parquet_column  # reads it with or without pyarrow

        def column(name: str, min_chars: int) -> list[str]:
            return [t.strip() for t in read_parquet_column(parquet, name) if t and len(t.strip()) >= min_chars]

        tasks = column("problem_statement", 1)
        tools = column("patch", 1) + column("test_patch", 1)
        followups = column("hints_text", 40)
        if tasks and tools and followups:
            return Pools(tasks, tools, followups, f"{parquet} (problem_statement, patch, test_patch, hints_text)")
    texts, source = load_documents(data_dir)
    return Pools(texts, texts, texts, source)


def load_prefix_texts(data_dir: Path) -> list[str]:
    files = sorted((data_dir / "agent_prompts").glob("*.md"))
    if not files:
        raise LuceboxError(f"no agent prompts in {data_dir / 'agent_prompts'}: bench agent needs its *.md files")
    return [f.read_text(encoding="utf-8").strip() for f in files]


def prefix_head(seed: int) -> str:
    """The prefix's first line: a new seed is a new prefix from its first token on, so a server that ran
    another seed has nothing of it cached."""
    return f"<environment_context>session set {seed}; cwd /workspace/run-{seed}</environment_context>\n\n"


async def build_prefix(counter: TokenCounter, texts: list[str], seed: int, target: int) -> tuple[str, int]:
    """The agent prompts, repeated as needed after the seed's head, cut to about `target` tokens."""
    body = "\n\n".join(texts)
    per_copy = max(await counter.count(body), 1)
    copies = math.ceil(target / per_copy) + 1
    return await trim(counter, prefix_head(seed) + "\n\n".join([body] * copies), target)


def choose_texts(pools: Pools, sessions: int, turns: int, seed: int) -> list[list[tuple[str, str]]]:
    """Per session, per turn: (task|tool|user, raw text), drawn with random.Random(seed)."""
    rng = random.Random(seed)
    if sessions <= len(pools.tasks):
        tasks = rng.sample(pools.tasks, sessions)
    else:
        tasks = [rng.choice(pools.tasks) for _ in range(sessions)]
    plan = []
    for s in range(sessions):
        steps = [("task", tasks[s])]
        for _ in range(1, turns):
            if rng.random() < TOOL_SHARE:
                steps.append(("tool", rng.choice(pools.tools)))
            else:
                steps.append(("user", rng.choice(pools.followups)))
        plan.append(steps)
    return plan


def _wrap(appended: str, text: str) -> str:
    if appended == "tool":
        return f"Tool result (exec_command, exit code 0):\n```\n{text}\n```"
    return text


async def build_sessions(counter: TokenCounter, plan: list[list[tuple[str, str]]],
                         turn_tokens: int) -> list[list[Message]]:
    """Every message of every session, counted, cut to at most `turn_tokens` (a tool result's frame included):
    to 97% of it, so that the cut ones, within ~2% of their target, stay in one size bucket below a
    power-of-two `turn_tokens`."""
    sem = asyncio.Semaphore(8)
    frame = {kind: await counter.count(_wrap(kind, "")) for kind in ("task", "tool", "user")}

    async def one(appended: str, text: str) -> Message:
        async with sem:
            cut, _ = await trim(counter, text, max((turn_tokens - frame[appended]) * 97 // 100, 8))
            content = _wrap(appended, cut)
            return Message(appended, content, await counter.count(content))

    return [list(await asyncio.gather(*(one(a, t) for a, t in steps))) for steps in plan]


# ----- one turn ------------------------------------------------------------------------


def turn_body(model: str, messages: list[dict[str, str]], max_tokens: int, seed: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def fold_frame(frame: SSEFrame, t: Turn) -> None:
    """One Chat Completions stream frame into the turn: content, first token, finish, usage, cached tokens."""
    f = parse_chat_frame(frame)
    t.done |= f.done
    t.error = f.error or t.error
    if f.content:
        t.reply.append(f.content)
    if f.token and t.first is None:
        t.first = frame.time
    if f.finish and t.finish is None:
        t.finish = frame.time
    t.prompt_tokens = f.prompt_tokens if f.prompt_tokens is not None else t.prompt_tokens
    t.completion_tokens = f.completion_tokens if f.completion_tokens is not None else t.completion_tokens
    t.cached_tokens = f.cached_tokens if f.cached_tokens is not None else t.cached_tokens


async def run_turn(base: str, headers: dict[str, str], body: dict[str, Any], t: Turn) -> Turn:
    """Stream one request to its end; failures are recorded in the turn, not raised."""
    t.start = time.perf_counter()
    try:
        async for frame in stream_sse(base + "/v1/chat/completions", body, headers=headers):
            fold_frame(frame, t)
    except HttpClientError as exc:
        t.error = str(exc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        t.error = f"unexpected stream frame: {exc!r}"
    t.end = time.perf_counter()
    if t.error is None and not t.done:
        t.error = "the stream ended without [DONE]"
    if t.error is None and t.ttft is None:
        t.error = "the stream carried no token (no content, no finish_reason)"
    return t


# ----- the replay ----------------------------------------------------------------------


async def replay(base: str, headers: dict[str, str], model: str, prefix: str, sessions: list[list[Message]],
                 max_tokens: int, concurrency: int, seed: int, progress: Progress) -> list[Turn]:
    """Every turn of every session: the cold one alone, then interleaved (concurrency 1) or concurrent."""
    history = [[{"role": "system", "content": prefix}] for _ in sessions]
    done: list[Turn] = []

    async def turn(s: int, k: int) -> Turn:
        msg = sessions[s][k]
        history[s].append({"role": "user", "content": msg.content})
        t = Turn(s, k, COLD if (s, k) == (0, 0) else WARM, msg.appended, msg.tokens)
        await run_turn(base, headers, turn_body(model, list(history[s]), max_tokens, seed), t)
        history[s].append({"role": "assistant", "content": "".join(t.reply)})
        done.append(t)
        progress.advance()
        return t

    cold = await turn(0, 0)
    if cold.error is not None:
        raise LuceboxError(f"bench agent: the first (cold) turn failed: {cold.error}")
    n_turns = len(sessions[0])
    if concurrency == 1:
        for k in range(n_turns):
            for s in range(len(sessions)):
                if (s, k) != (0, 0):
                    await turn(s, k)
    else:
        sem = asyncio.Semaphore(concurrency)

        async def session(s: int) -> None:
            for k in range(1 if s == 0 else 0, n_turns):
                async with sem:
                    await turn(s, k)

        await asyncio.gather(*(session(s) for s in range(len(sessions))))
    return sorted(done, key=lambda t: (t.session, t.turn))


async def server_info(base: str, headers: dict[str, str]) -> tuple[str, dict[str, Any] | None, int | None]:
    """(model id to send, /props when the server has it, its context length when it says)."""
    models = await get_json(base + "/v1/models", headers=headers)
    entries = models.get("data") if isinstance(models, dict) else None
    first = entries[0] if entries and isinstance(entries[0], dict) else {}
    model_id = str(first.get("id") or "default")
    status, props = await request_json("GET", base + "/props", headers=headers)
    props = props if status == 200 and isinstance(props, dict) else None
    n_ctx = None
    if props:
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx")
    n_ctx = n_ctx or first.get("max_model_len")  # vLLM
    return model_id, props, int(n_ctx) if n_ctx else None


async def _bench(args: argparse.Namespace, base: str, server: ServerProcess | None, headers: dict[str, str],
                 data_dir: Path) -> dict[str, Any]:
    await wait_ready(base, server, headers)
    model_id, props, n_ctx = await server_info(base, headers)
    counter = TokenCounter(base, model_id, headers)
    method = await counter.probe()
    if method == "estimate":
        print(f"bench agent: {base} has no /tokenize; sizes are estimates ({CHARS_PER_TOKEN:g} characters a token)",
              file=sys.stderr)
    pools = load_pools(data_dir)
    sessions = await build_sessions(counter, choose_texts(pools, args.sessions, args.turns, args.seed),
                                    args.turn_tokens)
    history = max(sum(m.tokens for m in msgs) for msgs in sessions) + args.turns * (TURN_OVERHEAD + args.max_tokens)
    target = args.prefix_tokens
    if target is None:
        # 5% short of what is left: the cut lands within ~2% of its target
        target = DEFAULT_PREFIX_TOKENS if n_ctx is None else min(DEFAULT_PREFIX_TOKENS, (n_ctx - history) * 95 // 100)
        if target < 64:
            raise LuceboxError(f"the server's context ({n_ctx} tokens) leaves no room for a prefix after "
                               f"{args.turns} turns of history (~{history} tokens): lower --turns or --turn-tokens")
    prefix, prefix_tokens = await build_prefix(counter, load_prefix_texts(data_dir), args.seed, target)
    if n_ctx is not None and prefix_tokens + history > n_ctx:
        raise LuceboxError(f"the longest session needs ~{prefix_tokens + history} tokens (prefix {prefix_tokens} + "
                           f"history ~{history}), more than the server's context of {n_ctx}: lower --prefix-tokens, "
                           "--turns or --turn-tokens")

    progress = Progress("bench agent", total=args.sessions * args.turns, unit="turns")
    t0 = time.perf_counter()
    turns = await replay(base, headers, model_id, prefix, sessions, args.max_tokens, args.concurrency, args.seed,
                         progress)
    wall = time.perf_counter() - t0
    progress.close()
    errors = [t.error for t in turns if t.error is not None]
    if errors:
        print(f"bench agent: {len(errors)} of {len(turns)} turns failed; first: {errors[0]}", file=sys.stderr)
    cold = turns[0]
    if cold.cached_tokens:
        print(f"bench agent: the cold turn had {cold.cached_tokens} tokens cached already (the server ran seed "
              f"{args.seed} before): pass another --seed for a cold start", file=sys.stderr)

    model = (props or {}).get("model") or {}
    device = torch.device(model.get("device") or "cpu") if isinstance(model, dict) else torch.device("cpu")
    try:
        env = environment(device)
    except (RuntimeError, AssertionError):  # a CUDA server seen from a client without CUDA
        env = {**environment(torch.device("cpu")), "device": str(device)}
    env["server_process"] = "started by the benchmark" if server else "running at --url"
    return {
        "benchmark": "agent",
        "url": base,
        "server_command": server.cmd if server else None,
        "model_id": model_id,
        "model": (props or {}).get("model"),
        "server": (props or {}).get("server"),
        "n_ctx": n_ctx,
        "workload": {
            "seed": args.seed, "sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency,
            "schedule": "interleaved, one request at a time" if args.concurrency == 1
            else f"sessions concurrent, at most {args.concurrency} requests in flight",
            "max_tokens": args.max_tokens, "temperature": 0, "turn_tokens_max": args.turn_tokens,
            "prefix_tokens_target": target, "prefix_tokens": prefix_tokens, "prefix_chars": len(prefix),
            "prefix_source": str(data_dir / "agent_prompts"), "turn_source": pools.source,
            "token_counts": "server /tokenize" if method != "estimate" else f"estimated, {CHARS_PER_TOKEN:g} chars",
        },
        "env": env,
        "wall_s": wall,
        "summary": summarize(turns),
        "turns": [t.record(t0) for t in turns],
    }


def _row(name: str, s: dict[str, Any], ratio: float | None = None) -> list[Any]:
    ms = s["ttft_ms"]
    return [name, s["turns"], s["errors"], s["new_tokens_p50"], s["prompt_tokens_p50"], s["cached_tokens_p50"],
            ms["p50"], ms["p99"], ms["max"], ratio]


def main(args: argparse.Namespace) -> int:
    for name in ("sessions", "turns", "prefix_tokens", "turn_tokens", "max_tokens", "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LuceboxError(f"--{name.replace('_', '-')} must be >= 1, not {value}")
    if args.url and args.model:
        raise LuceboxError("--url benchmarks a running server, --model starts one: give one or the other")
    data_dir = resolve_data_dir(args.data_dir)
    key = args.api_key or os.environ.get("LUCEBOX_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    server = None if args.url else ServerProcess(args, args.max_num_seqs or args.concurrency)
    base = (args.url or server.url).rstrip("/")  # type: ignore[union-attr]
    try:
        payload = asyncio.run(_bench(args, base, server, headers, data_dir))
    finally:
        if server is not None:
            server.stop()

    summary, work = payload["summary"], payload["workload"]
    rows = [_row("cold", summary["cold"]), _row("warm, all", summary["warm"])]
    rows += [_row(f"warm, +{b['bucket']} tok", b, b["stall_ratio"]) for b in summary["buckets"]]
    model = payload["model"] if isinstance(payload["model"], dict) else {}
    title = (f"bench agent: {model.get('name', payload['model_id'])} at {base}, {work['sessions']} sessions x "
             f"{work['turns']} turns, prefix {work['prefix_tokens']} tokens, max_tokens {work['max_tokens']}, "
             f"{work['schedule']}")
    print_table(title, ["turns", "n", "errors", "new tok p50", "prompt tok p50", "cached tok p50", "TTFT p50 ms",
                        "TTFT p99 ms", "TTFT max ms", "max/p50"], rows)
    stalls = summary["stalls"]
    verdict = {True: "yes", False: "NO", None: "not judged (no bucket of 2+ warm turns)"}[stalls["no_stalls"]]
    ratio = "-" if stalls["max_ratio"] is None else f"{stalls['max_ratio']:.2f}"
    print(f"no stalls (every warm turn <= {stalls['limit']}x its bucket's median TTFT): {verdict}; worst "
          f"max/median {ratio} (bucket {stalls['bucket'] or '-'})")
    write_json(args.json, payload)
    return 0
