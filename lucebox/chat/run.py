"""One generation, start to finish: prompt, limits, PFlash, engine, detokenizer, event pipeline, usage.

A dialect (api/) parses its body into a `ChatRequest` and starts a
`GenerationRun`; the run renders the chat template (tools, thinking, a forced
tool call), checks the prompt against the context, applies the thinking
budget, submits to the engine and turns its tokens into the typed events of
chat/events.py, which the dialect renders in its own wire format. Everything
about prompts, limits, sampling defaults, reasoning, thinking budgets, stop
strings and tool-call parsing happens here, once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lucebox.chat.events import Event, Finish, TextDelta, ToolCallEnd, merge_events
from lucebox.chat.prompt import PromptBuilder
from lucebox.chat.reasoning import ReasoningConfig
from lucebox.chat.request import ChatRequest, bad_field, show_value
from lucebox.chat.stream import EventPipeline
from lucebox.chat.template import TemplateError
from lucebox.engine.pflash.service import Compression
from lucebox.engine.runtime.async_engine import Generation, QueueFull
from lucebox.engine.runtime.sampler import SamplingParams, TokenLogprobs
from lucebox.errors import LuceboxError
from lucebox.http import HttpError
from lucebox.http.router import CLIENT_CLOSED

if TYPE_CHECKING:  # the server's state, which the API layer owns; imported for its type only (no cycle)
    from lucebox.api.common import ServerContext

DEFAULT_MAX_TOKENS = 4096
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def client_closed() -> HttpError:
    """The error a handler ends with when its client left first; nobody reads it, the log and metrics do."""
    return HttpError(CLIENT_CLOSED, "the client closed the connection before the answer was complete",
                     "client_closed")


@dataclass
class Usage:
    """What a run counted (tokens, prompt-cache hits, timings); complete once its Finish event is out."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    timings: dict[str, Any] = field(default_factory=dict)

    def log_fields(self) -> dict[str, Any]:
        """What the server's one line per request says of a generation: tokens, and where its TTFT went."""
        t = self.timings
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "queue_ms": t.get("queue_ms"),
                "prefill_ms": t.get("prefill_ms")}


class GenerationRun:
    """Prompt → engine → detokenizer → event pipeline, for one request.

    Create with `await start()` (renders, tokenizes and validates off the
    event loop; may raise HttpError), then iterate `events()`; after the
    Finish event `usage` is complete.
    """

    def __init__(self, ctx: ServerContext, req: ChatRequest, prompt_ids: list[int], prompt_text: str | None,
                 max_tokens: int, reasoning: ReasoningConfig | None, prefix: str, thinking_budget: int | None,
                 disconnected: asyncio.Event | None) -> None:
        self.ctx = ctx
        self.req = req
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.max_tokens = max_tokens
        self.reasoning = reasoning
        self.prefix = prefix  # text already in the prompt that the parser must see (forced tool call)
        self.thinking_budget = thinking_budget
        self.disconnected = disconnected
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.logprobs: list[TokenLogprobs] = []
        self.gen: Generation | None = None
        self.tool_calls: list[ToolCallEnd] = []
        self.compression: Compression | None = None  # set when PFlash compressed the prompt

    # -- building ------------------------------------------------------------------

    @classmethod
    async def start(cls, ctx: ServerContext, req: ChatRequest,
                    disconnected: asyncio.Event | None = None) -> GenerationRun:
        engine, builder = ctx.ready()
        # Rendering and tokenizing a long prompt takes a while: never on the loop.
        ids, text, reasoning, prefix = await asyncio.to_thread(cls._prompt, ctx, builder, req)
        max_tokens = resolve_max_tokens(ctx, req, len(ids))  # the raw prompt must fit: PFlash is no context extender
        arrived = time.monotonic()
        compression = await maybe_compress(ctx, builder, req, ids, text)
        if compression is not None:
            ids = compression.ids
            max_tokens = resolve_max_tokens(ctx, req, len(ids))
        cache = engine.engine.cache
        exact_key = compression.key if compression is not None else None
        hint = await asyncio.to_thread(cache.prepare, ids, exact_key) if cache is not None else None
        budget = thinking_budget(ctx, req) if reasoning is not None and reasoning.enabled else None
        run = cls(ctx, req, ids, text, max_tokens, reasoning, prefix, budget, disconnected)
        run.compression = compression
        params = SamplingParams(**{**req.params.__dict__, "max_tokens": max_tokens})
        try:
            run.gen = engine.submit(ids, params, disconnected, cache_hint=hint)
        except QueueFull as exc:
            raise HttpError(503, str(exc), "overloaded_error", headers={"Retry-After": "1"}) from None
        except LuceboxError as exc:
            raise HttpError(400, str(exc), "invalid_request_error") from None
        if compression is not None:
            run.gen.timings.arrival = arrived  # TTFT counts the scorer (queue_ms holds it: see compress_ms)
        return run

    @staticmethod
    def _prompt(ctx: ServerContext, builder: PromptBuilder,
                req: ChatRequest) -> tuple[list[int], str | None, ReasoningConfig | None, str]:
        prefix = ""
        reasoning = None
        text: str | None = None
        if req.prompt is not None:
            if isinstance(req.prompt, str):
                reject_oversized(ctx, builder.tokenizer, req.prompt)
                ids = builder.tokenizer.encode(req.prompt, add_special=True)
            else:
                ids = list(req.prompt)
                if any(not (0 <= i < builder.tokenizer.vocab_size) for i in ids):
                    raise bad_field("prompt", "holds token ids outside the vocabulary")
        else:
            text, reasoning, prefix = render_chat(ctx, builder, req)
            reject_oversized(ctx, builder.tokenizer, text)
            ids = builder.tokenizer.encode(text, add_special=False)
        return ids, text, reasoning, prefix

    # -- running -------------------------------------------------------------------

    async def events(self) -> AsyncIterator[Event]:
        assert self.gen is not None
        engine, builder = self.ctx.ready()
        tok = builder.tokenizer
        tools = self.req.tools if self.req.tool_choice != "none" else None
        pipeline = EventPipeline(stops=self.req.stop, tools=tools, reasoning=self.reasoning)
        detok = tok.detokenizer(skip_special=True)
        seq = self.gen.seq
        n_lp = 0
        reasoning_tokens = 0
        forced = False
        if self.prefix:
            for ev in pipeline.push(self.prefix):
                yield ev
        reason = "stop"
        # A forced call (tool_choice required / named) is the whole answer: stop once it is complete.
        forced_call = bool(self.prefix)
        try:
            async for new in engine.stream(self.gen):
                for token in new:
                    if pipeline.in_reasoning:
                        reasoning_tokens += 1
                    for ev in pipeline.push(detok.push(token)):
                        if isinstance(ev, ToolCallEnd):
                            self.tool_calls.append(ev)
                        if forced_call and self.tool_calls and isinstance(ev, TextDelta):
                            continue
                        yield ev
                if forced_call and self.tool_calls:
                    engine.cancel(self.gen, "stop")
                    break
                if self.req.params.logprobs is not None and len(seq.logprobs) > n_lp:
                    self.logprobs.extend(seq.logprobs[n_lp:])
                    n_lp = len(seq.logprobs)
                if pipeline.done:
                    engine.cancel(self.gen, "stop")
                    break
                if (self.thinking_budget is not None and not forced and pipeline.in_reasoning
                        and reasoning_tokens >= self.thinking_budget):
                    close = (self.ctx.card.thinking_terminator_hint if self.ctx.card else None) or "\n</think>\n\n"
                    engine.force_tokens(self.gen, tok.encode(close, add_special=False))
                    forced = True
            reason = self.gen.finish_reason or "stop"
        except asyncio.CancelledError:
            engine.cancel(self.gen)
            raise
        finally:
            if self.gen.finish_reason is None:
                engine.cancel(self.gen)
        if reason not in ("stop", "length", "cancelled", "error"):
            reason = "stop"
        tail = detok.flush()
        for ev in pipeline.push(tail) if tail and not pipeline.done else []:
            if isinstance(ev, ToolCallEnd):
                self.tool_calls.append(ev)
            if forced_call and self.tool_calls and isinstance(ev, TextDelta):
                continue
            yield ev
        for ev in pipeline.finish(reason):
            if isinstance(ev, ToolCallEnd):
                self.tool_calls.append(ev)
            if forced_call and self.tool_calls and isinstance(ev, TextDelta):
                continue
            if isinstance(ev, Finish):
                self._finish_usage(reasoning_tokens)
                self._remember_calls(tok)
            yield ev

    def _remember_calls(self, tok: Any) -> None:
        """Keep the exact text of a tool-call turn, so the next request can render it back verbatim."""
        if not self.tool_calls or self.gen is None:
            return
        ids = list(self.gen.seq.output_ids)
        while ids and ids[-1] in tok.eos_ids:
            ids.pop()
        self.ctx.replay.remember([c.call_id for c in self.tool_calls], self.prefix + tok.decode(ids))

    def _finish_usage(self, reasoning_tokens: int) -> None:
        gen = self.gen
        assert gen is not None
        self.usage.completion_tokens = gen.output_tokens
        self.usage.cached_tokens = gen.cached_tokens
        self.usage.reasoning_tokens = reasoning_tokens
        self.usage.timings = gen.timings.as_dict(gen.prompt_tokens, gen.output_tokens, gen.seq)
        if self.compression is not None:
            self.usage.timings["prefill_compression"] = self.compression.as_dict()
        self.ctx.metrics.observe_generation(self.usage, gen.finish_reason or "stop")

    async def collect(self) -> tuple[list[Event], Finish]:
        """Run to the end (non-streaming); events merged by kind."""
        events = [ev async for ev in self.events()]
        finish = events[-1]
        assert isinstance(finish, Finish)
        if finish.reason == "cancelled" and self.disconnected is not None and self.disconnected.is_set():
            raise client_closed()
        return merge_events(events[:-1]), finish


async def maybe_compress(ctx: ServerContext, builder: PromptBuilder, req: ChatRequest,
                         ids: list[int], text: str | None) -> Compression | None:
    """PFlash (spec PFLASH.md, server policy): the compressed prompt, or None when this request is not compressed.

    Never with tools; `auto` only above the threshold. A repeat of a prompt compressed before reuses that
    compression (no scorer). The scorer runs in a worker thread (on CUDA on its own stream: PFlashService),
    so running streams keep decoding meanwhile; this request waits for it.
    """
    pf = ctx.pflash
    if pf is None or not pf.wants(len(ids), has_tools=bool(req.tools)):
        return None
    keep_bos = False
    if text is None:
        if not isinstance(req.prompt, str) or not req.prompt:
            return None  # legacy token-id prompts have no text to score
        text = req.prompt
        tok = builder.tokenizer
        keep_bos = tok.add_bos and bool(ids) and ids[0] == tok.bos_id
    done = await asyncio.to_thread(pf.reuse, ids)
    if done is None:
        query = last_user_text(req.messages)
        job = functools.partial(pf.compress, ids, text, query, keep_bos)
        try:
            done = await asyncio.to_thread(job)
        except LuceboxError as exc:
            raise HttpError(400, str(exc), "invalid_request_error") from None
    return done if done.shrinks else None


def last_user_text(messages: list[dict]) -> str | None:
    """The text of the last user message (PFlash appends it again when too little of it survived)."""
    for m in reversed(messages):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            return "".join(parts) or None
        return None
    return None


def render_chat(ctx: ServerContext, builder: PromptBuilder, req: ChatRequest) -> tuple[str, ReasoningConfig | None,
                                                                                      str]:
    """Template render; returns (prompt text, reasoning config, forced prefix)."""
    template = builder.template
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    # Template variables the server sets itself cannot come from chat_template_kwargs.
    kwargs = {k: v for k, v in req.template_kwargs.items()
              if k not in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")}
    enable = req.enable_thinking
    if enable is None and "enable_thinking" in kwargs:
        enable = bool(kwargs.pop("enable_thinking"))
    try:
        text = template.render(ctx.replay.rewrite(req.messages), tools=tools, add_generation_prompt=True,
                               enable_thinking=enable, **kwargs)
    except TemplateError as exc:
        raise HttpError(400, str(exc), "invalid_request_error") from None
    reasoning = None
    if template.supports_thinking:
        tail = text[-200:]
        opened = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)
        reasoning = ReasoningConfig(enabled=enable is not False, start_in_reasoning=opened)
    prefix = tool_choice_prefix(template.source, req) if tools else ""
    return text + prefix, reasoning, prefix


def tool_choice_prefix(template_source: str, req: ChatRequest) -> str:
    """Text appended to the prompt so the model must call a tool (`required` / a named one)."""
    choice = req.tool_choice
    if choice in ("auto", None, "none"):
        return ""
    xml = "<function=" in template_source
    declared = [t.get("function") or t for t in req.tools or [] if isinstance(t, dict)]
    if choice == "required" and len(declared) == 1 and isinstance(declared[0], dict):
        # One declared tool: "required" means that tool, so the call opens with its name and arguments.
        # (Several tools: only the call markup is opened; choosing the name needs constrained decoding.)
        choice = {"name": declared[0].get("name")}
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if not name:
            raise bad_field("tool_choice", "names no function")
        tool = next((t for t in declared if isinstance(t, dict) and t.get("name") == name), None)
        if tool is None:
            raise bad_field("tool_choice", f"names {show_value(name)}, which is not among the declared tools")
        # Also open the arguments with the first required parameter, so only a call of that shape can follow.
        first, is_string = first_parameter(tool.get("parameters"))
        if xml:
            return f"<tool_call>\n<function={name}>\n" + (f"<parameter={first}>\n" if first else "")
        args = "{" + (json.dumps(first) + ": " + ('"' if is_string else "") if first else "")
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}'
    if choice == "required":
        return "<tool_call>\n"
    raise bad_field("tool_choice", "must be auto, none, required or a named function")


def first_parameter(schema: Any) -> tuple[str | None, bool]:
    """The parameter a forced call opens with (first required, else first declared) and whether it is a string.

    The schema is the client's JSON, any shape: `required` or `properties` of the wrong type count as absent.
    """
    if not isinstance(schema, dict):
        return None, False
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    names = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    first = next(iter(names or props), None)
    prop = props.get(first) if first is not None else None
    return first, isinstance(prop, dict) and prop.get("type") == "string"


class ContextOverflow(HttpError):
    """The prompt alone fills the context (400; dialects may reword it)."""

    def __init__(self, n_prompt: int, n_completion: int, n_ctx: int) -> None:
        super().__init__(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + n_completion} tokens ({n_prompt} in the messages, {n_completion} in the completion). "
            "Please reduce the length of the messages or completion.",
            "invalid_request_error",
            param="messages",
        )
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


@functools.lru_cache(maxsize=8)
def max_token_chars(tok: Any) -> int:
    """The longest text one token of `tok` stands for: the characters of its longest spelling (added tokens too)."""
    return max((len(t) for t in tok.hf.get_vocab(with_added_tokens=True)), default=1) or 1


def reject_oversized(ctx: ServerContext, tok: Any, text: str) -> None:
    """ContextOverflow, without tokenizing, for a text that cannot fit in the context.

    No token covers more than `max_token_chars` characters (doubled here, for normalizers that shrink text), so a
    longer text holds more than n_ctx tokens for sure. Tokenizing it to find out took 16 MB bodies ~40 s and GBs of
    memory that were never returned, while the worker threads it held stalled every other request.
    """
    per_token = 2 * max_token_chars(tok)
    if ctx.n_ctx and len(text) > ctx.n_ctx * per_token:
        raise ContextOverflow(-(-len(text) // per_token), 0, ctx.n_ctx)


def resolve_max_tokens(ctx: ServerContext, req: ChatRequest, n_prompt: int) -> int:
    requested = req.max_tokens
    if requested is not None and requested < 1:
        raise bad_field("max_tokens", "must be at least 1")
    default = ctx.card.max_tokens if ctx.card else DEFAULT_MAX_TOKENS
    wanted = requested if requested is not None else default
    if n_prompt >= ctx.n_ctx:
        raise ContextOverflow(n_prompt, wanted, ctx.n_ctx)
    return max(1, min(wanted, ctx.n_ctx - n_prompt))


def thinking_budget(ctx: ServerContext, req: ChatRequest) -> int | None:
    if req.thinking_budget is not None:
        return req.thinking_budget
    if req.reasoning_effort and ctx.card:
        try:
            budget = ctx.card.effort_budget(req.reasoning_effort, ctx.n_ctx)
        except LuceboxError as exc:
            raise bad_field("reasoning_effort", str(exc)) from None
        return budget or None  # a card without thinking room (tier 0) sets no budget rather than a zero one
    return None
