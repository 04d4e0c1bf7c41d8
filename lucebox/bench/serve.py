"""`python -m lucebox bench serve`: throughput and latency of the HTTP server under concurrent streaming requests.

The benchmark is a client: it speaks HTTP to a server, either a running one
(`--url`) or one it starts itself (`python -m lucebox serve` as a subprocess,
stopped with SIGTERM at the end). The workload is chat requests built from real
text (SWE-bench problem statements, or the JSONL prompts in lucebox/data),
each one different so no request can reuse another's cache, trimmed to about
`--prompt-len` tokens as the server counts them (POST /tokenize), greedy,
`max_tokens` = `--gen-len`.

For each concurrency level C, N requests run with at most C in flight. Per
request: TTFT (request sent -> first content delta), inter-token latency (gaps
between consecutive content deltas), output tokens (the usage the server
reports). Per level: aggregate output tok/s = all output tokens / the level's
wall time. The baseline is the same kind of workload run one request at a time
(no batching); each level's speedup is its tok/s over the baseline's.

Against a Lucebox server each level also gives the server's CPU time per output
token on its event-loop thread (HTTP, templates, detokenizing, SSE) and on its
engine thread (scheduling, launches, sampling), read from /metrics before and
after the level: where a stream's host time goes when serving trails
`bench decode`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lucebox import procs
from lucebox.bench.http_client import HttpClientError, SSEFrame, get_json, post_json, request_json, stream_sse
from lucebox.bench.report import environment, print_table, write_json
from lucebox.data import data_dir as resolve_data_dir
from lucebox.errors import LuceboxError
from lucebox.progress import Progress

INSTRUCTION = "Explain the text above in detail, point by point, and then write a long, thorough answer."
START_TIMEOUT = 600.0
"""Seconds to wait for a server to load its model."""
MIN_BODY_TOKENS = 8


# ----- statistics ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100), linear between closest ranks (numpy's default); None without values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is not in 0..100")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms_stats(seconds: Sequence[float]) -> dict[str, float | None]:
    ms = [s * 1000 for s in seconds]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": sum(ms) / len(ms) if ms else None}


def parse_levels(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16]; every level a positive integer."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LuceboxError(f"--concurrency {text!r}: expected comma-separated integers like 1,4,16") from None
    if not levels or any(c < 1 for c in levels):
        raise LuceboxError(f"--concurrency {text!r}: every level must be an integer >= 1")
    return levels


# ----- workload ------------------------------------------------------------------------


def load_documents(data_dir: Path) -> tuple[list[str], str]:
    """Real texts to build prompts from, and where they came from.

    SWE-bench problem statements when the folder has the parquet file, else
    every prompt in prompts/*.jsonl (MT-Bench turns, benchmark messages).
    """
    from lucebox.train.data import read_parquet_column  # with or without pyarrow

    parquet = data_dir / "swe_bench_verified.parquet"
    if parquet.is_file():
        texts = _unique(t.strip() for t in read_parquet_column(parquet, "problem_statement") if isinstance(t, str))
        if texts:
            return texts, f"{parquet} (problem_statement)"
    texts = []
    files = sorted((data_dir / "prompts").glob("*.jsonl"))
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.extend(_texts_of(json.loads(line)))
            except ValueError:
                raise LuceboxError(f"{path}:{n}: not a JSON line") from None
    texts = _unique(t.strip() for t in texts)
    if not texts:
        raise LuceboxError(f"no prompt text in {data_dir}: it needs swe_bench_verified.parquet (read with pyarrow) "
                           "or prompts/*.jsonl; pass --data-dir")
    return texts, f"{data_dir / 'prompts'}/*.jsonl"


def _texts_of(obj: Any) -> list[str]:
    if not isinstance(obj, dict):
        return []
    out = [t for t in obj.get("turns") or [] if isinstance(t, str)]
    messages = [m for m in obj.get("messages") or [] if isinstance(m, dict)]
    out += [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if isinstance(obj.get("prompt"), str):
        out.append(obj["prompt"])
    return out


def _unique(texts: Any) -> list[str]:
    return list(dict.fromkeys(t for t in texts if t))


def _head(k: int) -> str:
    return f"Text {k + 1}:\n"


class PromptBuilder:
    """Builds user messages of about `target` prompt tokens (chat template included) from the documents.

    Message k is `Text k+1:`, then documents k, k+1, ... joined and cut to the
    token budget (cut by the server's own tokenizer: /tokenize, /detokenize),
    then INSTRUCTION. The numbered head makes every message differ from its
    first tokens on, even when there are fewer documents than requests.
    """

    def __init__(self, base: str, docs: list[str], headers: dict[str, str]) -> None:
        self.base, self.docs, self.headers = base, docs, headers
        self._doc_tokens: dict[int, int] = {}

    async def count(self, text: str) -> int:
        return len(await self.tokenize(text))

    async def tokenize(self, text: str) -> list[int]:
        return (await post_json(self.base + "/tokenize", {"content": text}, headers=self.headers))["tokens"]

    async def build(self, n: int, target: int, template_tokens: int) -> list[str]:
        fixed = template_tokens + await self.count(_head(n) + "\n\n" + INSTRUCTION)
        budget = target - fixed
        if budget < MIN_BODY_TOKENS:
            raise LuceboxError(f"--prompt-len {target} is too short: the chat template and the instruction alone take "
                               f"{fixed} tokens; use at least {fixed + MIN_BODY_TOKENS}")
        sem = asyncio.Semaphore(8)

        async def one(k: int) -> str:
            async with sem:
                return _head(k) + await self._body(k, budget) + "\n\n" + INSTRUCTION

        return list(await asyncio.gather(*(one(k) for k in range(n))))

    async def _body(self, k: int, budget: int) -> str:
        parts, total, i = [], 0, k
        while total < budget and i < k + len(self.docs):
            j = i % len(self.docs)
            if j not in self._doc_tokens:
                self._doc_tokens[j] = await self.count(self.docs[j])
            parts.append(self.docs[j])
            total += self._doc_tokens[j]
            i += 1
        ids = await self.tokenize("\n\n".join(parts))
        if len(ids) < budget:
            raise LuceboxError(f"the documents hold only {len(ids)} tokens, fewer than the {budget} a prompt needs: "
                               "lower --prompt-len or give --data-dir with more text")
        detok = await post_json(self.base + "/detokenize", {"tokens": ids[:budget]}, headers=self.headers)
        return detok["content"].strip()


# ----- one request ---------------------------------------------------------------------


@dataclass
class RequestResult:
    start: float = 0.0
    end: float = 0.0
    deltas: list[float] = field(default_factory=list)
    """perf_counter() at the arrival of each frame carrying generated content."""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish: str | None = None
    done: bool = False
    """The stream's end marker arrived ([DONE] / message_stop)."""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.deltas[0] - self.start if self.deltas else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.deltas, self.deltas[1:])]


def chat_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


@dataclass
class ChatFrame:
    """What one OpenAI Chat Completions stream frame says, as the benchmarks read it."""

    done: bool = False
    """The `[DONE]` marker."""
    error: str | None = None
    content: str = ""
    token: bool = False
    """It carries generated content: text, reasoning (`reasoning_content` or `reasoning`) or tool calls.
    Role-only first frames (vLLM sends one before the prefill ends) are not a token."""
    finish: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI, Lucebox, recent llama.cpp), else llama.cpp's
    `timings.cache_n`; None when the server reports neither."""


def parse_chat_frame(frame: SSEFrame) -> ChatFrame:
    """One Chat Completions stream frame (raises ValueError on a frame that is not JSON)."""
    if frame.data == "[DONE]":
        return ChatFrame(done=True)
    obj = json.loads(frame.data)
    if "error" in obj:
        return ChatFrame(error=f"error in stream: {json.dumps(obj['error'])}")
    out = ChatFrame()
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        out.content += delta.get("content") or ""
        out.token |= bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                          or delta.get("tool_calls"))
        out.finish = choice.get("finish_reason") or out.finish
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.prompt_tokens, out.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.cached_tokens = cached if isinstance(cached, int) else None
    timings = obj.get("timings")
    if out.cached_tokens is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        out.cached_tokens = timings["cache_n"]
    return out


def chat_frame(frame: SSEFrame, r: RequestResult) -> None:
    """Fold one OpenAI Chat Completions stream frame into the result."""
    f = parse_chat_frame(frame)
    r.done |= f.done
    r.error = f.error or r.error
    if f.token:
        r.deltas.append(frame.time)
    r.finish = f.finish or r.finish
    if f.completion_tokens is not None or f.prompt_tokens is not None:
        r.prompt_tokens, r.output_tokens = f.prompt_tokens, f.completion_tokens


def anthropic_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}


def anthropic_frame(frame: SSEFrame, r: RequestResult) -> None:
    """Fold one Anthropic Messages stream frame into the result."""
    obj = json.loads(frame.data)
    kind = obj.get("type") or frame.event
    if kind == "message_start":
        r.prompt_tokens = obj["message"]["usage"]["input_tokens"]
    elif kind == "content_block_delta":
        delta = obj.get("delta") or {}
        if delta.get("text") or delta.get("thinking") or delta.get("partial_json"):
            r.deltas.append(frame.time)
    elif kind == "message_delta":
        r.output_tokens = (obj.get("usage") or {}).get("output_tokens")
        r.finish = (obj.get("delta") or {}).get("stop_reason")
    elif kind == "message_stop":
        r.done = True
    elif kind == "error":
        r.error = f"error in stream: {json.dumps(obj.get('error'))}"


@dataclass(frozen=True)
class Dialect:
    path: str
    body: Callable[[str, str, int], dict[str, Any]]
    on_frame: Callable[[SSEFrame, RequestResult], None]


DIALECTS = {
    "chat": Dialect("/v1/chat/completions", chat_body, chat_frame),
    "anthropic": Dialect("/v1/messages", anthropic_body, anthropic_frame),
}

JSON_ANSWER = {"chat": {"response_format": {"type": "json_object"}},
               "anthropic": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}}
"""What `--constrained` adds to each request: the answer is a JSON object (a grammar masks every token)."""


def constrained(dialect: Dialect, name: str) -> Dialect:
    """`dialect` with every request held to a JSON answer (bench serve --constrained)."""
    extra = JSON_ANSWER[name]
    return Dialect(dialect.path, lambda m, c, n: {**dialect.body(m, c, n), **extra}, dialect.on_frame)


async def one_request(base: str, dialect: Dialect, model: str, content: str, max_tokens: int,
                      headers: dict[str, str], r: RequestResult | None = None) -> RequestResult:
    """Stream one request to its end; failures are recorded in the result, not raised.

    `r`: the result to fill as frames arrive (a caller may read it while the request runs, or cancel it)."""
    r = r or RequestResult()
    r.start = time.perf_counter()
    try:
        async for frame in stream_sse(base + dialect.path, dialect.body(model, content, max_tokens), headers=headers):
            dialect.on_frame(frame, r)
    except HttpClientError as exc:
        r.error = str(exc)
    except (ValueError, KeyError, TypeError) as exc:
        r.error = f"unexpected stream frame: {exc!r}"
    r.end = time.perf_counter()
    if r.error is None and not r.done:
        r.error = "the stream ended without its end marker"
    if r.error is None and r.output_tokens is None:
        r.error = "the stream carried no usage (output token count)"
    return r


# ----- one level -----------------------------------------------------------------------


CPU_COUNTERS = {"event_loop": "lucebox_event_loop_cpu_seconds_total",
                "engine": "lucebox_engine_thread_cpu_seconds_total"}
"""The server's CPU time by thread, from a Lucebox server's /metrics: where the host's share of a token goes."""


async def server_cpu(base: str, headers: dict[str, str]) -> dict[str, float] | None:
    """CPU seconds so far of the server's event-loop and engine threads; None from a server without them."""
    try:
        status, text = await request_json("GET", base + "/metrics", headers=headers, timeout=10)
    except HttpClientError:
        return None
    if status != 200 or not isinstance(text, str):
        return None
    names = {metric: key for key, metric in CPU_COUNTERS.items()}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            with contextlib.suppress(ValueError):  # a peer's /metrics is not ours to trust
                found[names[name]] = float(value)
    return found if len(found) == len(CPU_COUNTERS) else None


@dataclass
class Level:
    name: str
    concurrency: int
    results: list[RequestResult]
    wall: float
    cpu: dict[str, float] | None = None  # the server's CPU seconds by thread over the level (CPU_COUNTERS)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens or 0 for r in self.ok)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall if self.wall > 0 else 0.0

    def summary(self, baseline_tok_s: float | None) -> dict[str, Any]:
        ok = self.ok
        errors = [r.error for r in self.results if r.error is not None]
        tpot = [(r.deltas[-1] - r.deltas[0]) / (r.output_tokens - 1)
                for r in ok if len(r.deltas) >= 2 and (r.output_tokens or 0) >= 2]
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "wall_s": self.wall,
            "output_tokens": self.output_tokens,
            "output_tokens_mean": self.output_tokens / len(ok) if ok else None,
            "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else None,
            "finished_by_length": sum(r.finish in ("length", "max_tokens") for r in ok),
            "tok_s": self.tok_s,
            "speedup": self.tok_s / baseline_tok_s if baseline_tok_s else None,
            "ttft_ms": _ms_stats([r.ttft for r in ok if r.ttft is not None]),
            "itl_ms": _ms_stats([gap for r in ok for gap in r.itl]),
            "tpot_ms": _ms_stats(tpot),
            "latency_ms": _ms_stats([r.end - r.start for r in ok]),
            "server_cpu_us_per_token": ({k: v * 1e6 / self.output_tokens for k, v in self.cpu.items()}
                                        if self.cpu is not None and self.output_tokens else None),
        }


async def run_level(name: str, base: str, dialect: Dialect, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int | list[int], headers: dict[str, str], progress: Progress) -> Level:
    """All `prompts`, at most `concurrency` in flight; wall time from the first send to the last answer.
    `max_tokens`: one for all, or one per prompt."""
    sem = asyncio.Semaphore(concurrency)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)

    async def one(content: str, limit: int) -> RequestResult:
        async with sem:
            r = await one_request(base, dialect, model, content, limit, headers)
        progress.advance()
        return r

    cpu = await server_cpu(base, headers)
    t = time.perf_counter()
    results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, limits, strict=True)))
    level = Level(name, concurrency, list(results), time.perf_counter() - t)
    if cpu is not None and (cpu_after := await server_cpu(base, headers)) is not None:
        level.cpu = {k: cpu_after[k] - cpu[k] for k in cpu}
    errors = [r.error for r in results if r.error is not None]
    if errors and not level.ok:
        raise LuceboxError(f"bench serve: every request of '{name}' failed; first: {errors[0]}")
    if errors:
        print(f"bench serve: {name}: {len(errors)} of {len(results)} requests failed; first: {errors[0]}",
              file=sys.stderr)
    return level


# ----- decode streams while a long prompt prefills -------------------------------------

LONG_STREAMS = 8
"""Most streams that decode beside a long prompt (the largest --concurrency, up to this)."""
STREAM_TOKENS = 2048
"""max_tokens of those streams (they are cut when its prefill ends); 8 of them fit a 24K-token KV cache."""
STEADY_TOKENS = 16
"""Tokens every stream must have produced before the steady window opens (admission and warm-up done)."""
STEADY_SECONDS = 1.0


def _gaps_between(results: Sequence[RequestResult], lo: float, hi: float) -> list[float]:
    """Inter-token gaps whose later token arrived in (lo, hi]."""
    return [b - a for r in results for a, b in zip(r.deltas, r.deltas[1:]) if lo < b <= hi]


async def long_prompt_case(base: str, dialect: Dialect, model: str, streams: list[str], long_prompt: str,
                           headers: dict[str, str]) -> dict[str, Any]:
    """`streams` decode; once steady, one request with `long_prompt` (max_tokens 1) is sent.

    Returns the streams' inter-token latency in the steady window before it
    and while it prefills (sent -> its first token), and its TTFT. The streams
    are then cut (their sockets closed: the server sees disconnects).
    """
    results = [RequestResult() for _ in streams]
    tasks = [asyncio.create_task(one_request(base, dialect, model, c, STREAM_TOKENS, headers, r))
             for c, r in zip(streams, results)]
    try:
        deadline = time.perf_counter() + START_TIMEOUT
        while any(len(r.deltas) < STEADY_TOKENS and r.error is None and not r.end for r in results):
            if time.perf_counter() > deadline:
                raise LuceboxError("bench serve --long-prompt: the streams did not start")
            await asyncio.sleep(0.01)
        steady_from = time.perf_counter()
        await asyncio.sleep(STEADY_SECONDS)
        long = await one_request(base, dialect, model, long_prompt, 1, headers)
        if long.error is not None or long.ttft is None:
            raise LuceboxError(f"bench serve --long-prompt: the long request failed: {long.error}")
        sent, first = long.start, long.start + long.ttft
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise LuceboxError(f"bench serve --long-prompt: a stream failed: {failed[0]}")
        if any(r.end and r.end < first for r in results):
            raise LuceboxError(f"bench serve --long-prompt: a stream ended ({STREAM_TOKENS} tokens) before the "
                               "long prompt's prefill did")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steady, during = _gaps_between(results, steady_from, sent), _gaps_between(results, sent, first)
    s, d = _ms_stats(steady), _ms_stats(during)
    return {
        "streams": len(streams),
        "long_prompt_tokens": long.prompt_tokens,
        "long_ttft_ms": long.ttft * 1000,
        "steady_itl_ms": s,
        "during_itl_ms": {**d, "max": max(during) * 1000 if during else None},
        "steady_gaps": len(steady),
        "during_gaps": len(during),
        "p99_during_over_steady_p50": d["p99"] / s["p50"] if d["p99"] and s["p50"] else None,
    }


# ----- the server ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int, max_num_seqs: int) -> list[str]:
    """The `serve` command line a benchmark starts: the bench's engine flags passed through."""
    cmd = [sys.executable, "-m", "lucebox", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(max_num_seqs)]
    if args.model:
        cmd += ["--model", str(args.model)]
    if args.n_ctx:
        cmd += ["--ctx-size", str(args.n_ctx)]
    if args.chat_template_file:
        cmd += ["--chat-template-file", str(args.chat_template_file)]
    if getattr(args, "kv_tokens", None):
        cmd += ["--kv-tokens", str(args.kv_tokens)]
    if getattr(args, "weights", "auto") != "auto":
        cmd += ["--weights", args.weights]
    if getattr(args, "gpu_memory", None):
        cmd += ["--gpu-memory", str(args.gpu_memory)]
    return cmd


class ServerProcess:
    """`python -m lucebox serve` on a free local port; its output goes to a temporary log file."""

    def __init__(self, args: argparse.Namespace, max_num_seqs: int, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = serve_command(args, self.port, max_num_seqs)
        cmd += list(extra)
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile(prefix="lucebox-bench-serve-", suffix=".log", delete=False)
        print(f"bench serve: starting {' '.join(cmd)}", file=sys.stderr, flush=True)
        # dies with this process: a killed benchmark leaves no 2 GB server behind
        self.proc = procs.spawn(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def exited(self) -> str | None:
        """None while it runs; else why it stopped, with the end of its log."""
        code = self.proc.poll()
        if code is None:
            return None
        self.log.flush()
        tail = Path(self.log.name).read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        return f"the server exited with code {code}:\n" + "\n".join("  " + line for line in tail)

    def stop(self) -> None:
        """SIGTERM (the server finishes in-flight requests and exits), SIGKILL if it hangs."""
        procs.stop(self.proc, timeout=30)
        self.log.close()
        os.unlink(self.log.name)


async def wait_ready(base: str, server: ServerProcess | None, headers: dict[str, str],
                     timeout: float = START_TIMEOUT) -> None:
    """Poll GET /health until it answers 200, printing progress while the model loads."""
    t0 = last = time.monotonic()
    while True:
        try:
            status, body = await request_json("GET", base + "/health", headers=headers, timeout=10)
            if status == 200:
                print(f"bench serve: server ready after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
                return
            if status != 503:
                raise LuceboxError(f"GET {base}/health -> {status}: {body}")
        except HttpClientError as exc:
            if server is None:
                raise LuceboxError(f"no server at {base}: {exc}") from None
        if server is not None and (why := server.exited()):
            raise LuceboxError(why)
        now = time.monotonic()
        if now - t0 > timeout:
            raise LuceboxError(f"the server at {base} was not ready after {timeout:.0f} s")
        if now - last >= 5:
            last = now
            print(f"bench serve: waiting for the server to load the model ({now - t0:.0f} s)", file=sys.stderr,
                  flush=True)
        await asyncio.sleep(0.5)


# ----- main ----------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    levels = parse_levels(args.concurrency)
    for name in ("prompt_len", "gen_len", "requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LuceboxError(f"--{name.replace('_', '-')} must be >= 1, not {value}")
    if args.dialect not in DIALECTS:
        raise LuceboxError(f"--dialect {args.dialect!r}: one of {', '.join(DIALECTS)}")
    if args.url and args.model:
        raise LuceboxError("--url benchmarks a running server, --model starts one: give one or the other")
    data_dir = resolve_data_dir(args.data_dir)
    docs, source = load_documents(data_dir)
    key = args.api_key or os.environ.get("LUCEBOX_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    server = None if args.url else ServerProcess(args, args.max_num_seqs or max(levels))
    base = (args.url or server.url).rstrip("/")  # type: ignore[union-attr]
    try:
        payload = asyncio.run(_bench(args, base, server, levels, docs, source, headers))
    finally:
        if server is not None:
            server.stop()

    seq = payload["sequential"]
    rows = [_row(seq)] + [_row(level) for level in payload["levels"]]
    model = payload["model"] or {}
    settings = payload["server"] or {}
    title = (f"bench serve: {model.get('name', '?')} ({model.get('quant', '?')} file, {model.get('dtype', '?')}) on "
             f"{model.get('device', '?')}, {args.dialect} dialect, prompt ~{args.prompt_len} tokens, "
             f"max_tokens {args.gen_len}, server max_num_seqs {settings.get('max_num_seqs', '?')}")
    print_table(title, ["case", "requests", "errors", "out tok/req", "tok/s", "speedup", "TTFT p50 ms",
                        "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "loop CPU us/tok", "engine CPU us/tok"], rows)
    if payload["constrained"]:
        print_table("the same prompts, every answer a JSON object (a grammar masks each token), then free with "
                    "each answer's length; vs free: tok/s and decode tok/s (1 / TPOT) against that free run",
                    ["case", "requests", "errors", "out tok/req", "tok/s", "vs free", "TPOT ms", "decode vs free",
                     "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"],
                    [[s["name"], s["requests"], s["errors"], s["output_tokens_mean"], s["tok_s"], s["speedup"],
                      s["tpot_ms"]["mean"], _ratio(base["tpot_ms"]["mean"], s["tpot_ms"]["mean"]),
                      s["ttft_ms"]["p50"], s["itl_ms"]["p50"], s["itl_ms"]["p99"]]
                     for base, s in _pairs(payload["constrained"])])
    if (lp := payload["long_prompt"]) is not None:
        s, d = lp["steady_itl_ms"], lp["during_itl_ms"]
        print_table(f"{lp['streams']} streams while one {lp['long_prompt_tokens']}-token prompt prefills "
                    f"(its TTFT {lp['long_ttft_ms']:.0f} ms)",
                    ["window", "gaps", "ITL p50 ms", "ITL p99 ms", "ITL max ms"],
                    [["steady", lp["steady_gaps"], s["p50"], s["p99"], None],
                     ["during the prefill", lp["during_gaps"], d["p50"], d["p99"], d["max"]]])
        ratio = lp["p99_during_over_steady_p50"]
        print(f"ITL p99 during / steady p50: {ratio:.2f}x" if ratio else "ITL p99 during / steady p50: -")
    write_json(args.json, payload)
    return 0


def _pairs(held: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(its free run, the row) for each row of the constrained table: free rows first, each before its JSON row."""
    return [(held[i - i % 2], s) for i, s in enumerate(held)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _row(s: dict[str, Any]) -> list[Any]:
    cpu = s["server_cpu_us_per_token"] or {}
    return [s["name"], s["requests"], s["errors"], s["output_tokens_mean"], s["tok_s"], s["speedup"],
            s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p99"],
            cpu.get("event_loop"), cpu.get("engine")]


async def _bench(args: argparse.Namespace, base: str, server: ServerProcess | None, levels: list[int],
                 docs: list[str], source: str, headers: dict[str, str]) -> dict[str, Any]:
    await wait_ready(base, server, headers)
    props = await get_json(base + "/props", headers=headers)
    model_id = str(props.get("model_id") or "lucebox")
    dialect = DIALECTS[args.dialect]

    # Warm-up, which also measures what the chat template adds to a message's tokens.
    warm = await one_request(base, dialect, model_id, INSTRUCTION, min(args.gen_len, 8), headers)
    if warm.error is not None:
        raise LuceboxError(f"the warm-up request failed: {warm.error}")
    builder = PromptBuilder(base, docs, headers)
    template_tokens = (warm.prompt_tokens or 0) - await builder.count(INSTRUCTION)

    sizes = [args.requests or max(8, 2 * c) for c in levels]
    n_seq = min(args.requests, 32) if args.requests else 8  # the baseline: a handful is enough
    prompts = await builder.build(sum(sizes) + n_seq, args.prompt_len, template_tokens)
    progress = Progress("bench serve", total=len(prompts), unit="requests")
    runs: list[Level] = []
    offset = 0
    for c, n in zip(levels, sizes):
        runs.append(await run_level(f"concurrency {c}", base, dialect, model_id, prompts[offset:offset + n], c,
                                    args.gen_len, headers, progress))
        offset += n
    sequential = await run_level("sequential", base, dialect, model_id, prompts[offset:], 1, args.gen_len, headers,
                                 progress)
    progress.close()
    held: list[dict[str, Any]] = []
    if args.constrained:
        # The same prompts again, every answer held to a JSON grammar; then free once more with each prompt's
        # max_tokens set to the length its JSON answer had: a JSON answer ends when its object closes, and answers
        # of staggered lengths admit new requests (prefill beside decode) where equal ones end together, so the
        # baseline must do the same work in the same pattern.
        grammar = constrained(dialect, args.dialect)
        progress = Progress("bench serve --constrained", total=2 * sum(sizes), unit="requests")
        offset = 0
        for c, n in zip(levels, sizes):
            batch = prompts[offset:offset + n]
            # Both met these prompts cold, as the free level did (Lucebox's admin route; a peer may lack it).
            with contextlib.suppress(HttpClientError):
                await post_json(base + "/cache/clear", {}, headers=headers)
            level = await run_level(f"concurrency {c}, JSON", base, grammar, model_id, batch, c, args.gen_len,
                                    headers, progress)
            with contextlib.suppress(HttpClientError):
                await post_json(base + "/cache/clear", {}, headers=headers)
            lengths = [max(r.output_tokens or args.gen_len, 1) for r in level.results]
            free = await run_level(f"concurrency {c}, free, same lengths", base, dialect, model_id, batch, c,
                                   lengths, headers, progress)
            held += [{**free.summary(free.tok_s), "vs": free.name}, {**level.summary(free.tok_s), "vs": free.name}]
            offset += n
        progress.close()
    long_case = None
    if args.long_prompt:
        print(f"bench serve: {min(max(levels), LONG_STREAMS)} streams decoding while a {args.long_prompt}-token "
              "prompt prefills",
              file=sys.stderr, flush=True)
        streams = await builder.build(min(max(levels), LONG_STREAMS), args.prompt_len, template_tokens)
        # from the documents in reverse order: its text shares no prefix with the streams' prompts
        long_prompt = (await PromptBuilder(base, docs[::-1], headers).build(1, args.long_prompt, template_tokens))[0]
        long_case = await long_prompt_case(base, dialect, model_id, streams, long_prompt, headers)

    model = props.get("model") or {}
    device = torch.device(model.get("device") or "cpu")
    try:
        env = environment(device)
    except (RuntimeError, AssertionError):  # a CUDA server seen from a client without CUDA
        env = {**environment(torch.device("cpu")), "device": str(device)}
    env["server_process"] = "started by the benchmark" if server else "running at --url"
    return {
        "benchmark": "serve",
        "url": base,
        "server_command": server.cmd if server else None,
        "dialect": args.dialect,
        "model": props.get("model"),
        "model_id": model_id,
        "server": props.get("server"),
        "workload": {"source": source, "prompt_len": args.prompt_len, "gen_len": args.gen_len, "temperature": 0,
                     "template_tokens": template_tokens, "requests_per_level": dict(zip(map(str, levels), sizes)),
                     "sequential_requests": n_seq},
        "env": env,
        "sequential": sequential.summary(sequential.tok_s),
        "levels": [run.summary(sequential.tok_s) for run in runs],
        "constrained": held,
        "long_prompt": long_case,
    }
