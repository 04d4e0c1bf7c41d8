"""One generation, start to finish: prompt, limits, PFlash, engine, detokenizer, event pipeline, usage.

A dialect (api/) parses its body into a `ChatRequest` and starts a
`GenerationRun`; the run renders the chat template (tools, thinking), holds the
answer to its grammar where the request asks for one (forced tool calls, JSON:
chat/constrain.py), checks the prompt against the context, applies the thinking
budget, submits to the engine and turns its tokens into the typed events of
chat/events.py, which the dialect renders in its own wire format. Everything
about prompts, limits, sampling defaults, reasoning, thinking budgets, stop
strings and tool-call parsing happens here, once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lucebox.chat.constrain import plan_output, unreadable_tools
from lucebox.chat.events import Event, Finish, ToolCallEnd, merge_events
from lucebox.chat.prompt import PromptBuilder
from lucebox.chat.reasoning import ReasoningConfig
from lucebox.chat.request import ChatRequest, bad_field
from lucebox.chat.stream import EventPipeline
from lucebox.chat.template import TemplateError
from lucebox.engine.pflash.service import Compression
from lucebox.engine.runtime.async_engine import AsyncEngine, Generation, QueueFull
from lucebox.engine.runtime.grammar import Constraint, GrammarError, compiler_for, grammar_from_lark
from lucebox.engine.runtime.sampler import SamplingParams, TokenLogprobs
from lucebox.errors import LuceboxError
from lucebox.http import HttpError
from lucebox.http.router import CLIENT_CLOSED

if TYPE_CHECKING:  # the server's state, which the API layer owns; imported for its type only (no cycle)
    from lucebox.api.common import ServerContext

log = logging.getLogger(__name__)

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
    constrained: str | None = None  # why the answer followed a grammar (chat/constrain.py kinds), or None

    def log_fields(self) -> dict[str, Any]:
        """What the server's one line per request says of a generation: tokens, and where its TTFT went."""
        t = self.timings
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "queue_ms": t.get("queue_ms"),
                "prefill_ms": t.get("prefill_ms"), "constrained": self.constrained}


class GenerationRun:
    """Prompt → engine → detokenizer → event pipeline, for one request.

    Create with `await start()` (renders, tokenizes and validates off the
    event loop; may raise HttpError), then iterate `events()`; after the
    Finish event `usage` is complete.
    """

    def __init__(self, ctx: ServerContext, req: ChatRequest, prompt_ids: list[int], prompt_text: str | None,
                 max_tokens: int, reasoning: ReasoningConfig | None, thinking_budget: int | None,
                 disconnected: asyncio.Event | None, constraint: Constraint | None = None) -> None:
        self.ctx = ctx
        self.req = req
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.max_tokens = max_tokens
        self.reasoning = reasoning
        self.constraint = constraint  # the grammar the answer follows (chat/constrain.py), or None
        self.thinking_budget = thinking_budget
        self.disconnected = disconnected
        self.usage = Usage(prompt_tokens=len(prompt_ids), constrained=constraint.kind if constraint else None)
        self.logprobs: list[TokenLogprobs] = []
        self.gen: Generation | None = None
        self.tool_calls: list[ToolCallEnd] = []
        self.compression: Compression | None = None  # set when PFlash compressed the prompt
        # The output length where the engine holds the sequence for the thinking budget from its submission
        # (the template opened the reasoning; ThinkingBudget), or None.
        opened = reasoning is not None and reasoning.start_in_reasoning
        self.hold_at = thinking_budget if opened else None

    # -- building ------------------------------------------------------------------

    @classmethod
    async def start(cls, ctx: ServerContext, req: ChatRequest,
                    disconnected: asyncio.Event | None = None) -> GenerationRun:
        engine, builder = ctx.ready()
        # Rendering and tokenizing a long prompt takes a while: never on the loop.
        ids, text, reasoning, constraint = await asyncio.to_thread(cls._prompt, ctx, builder, req)
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
        run = cls(ctx, req, ids, text, max_tokens, reasoning, budget, disconnected, constraint)
        run.compression = compression
        params = SamplingParams(**{**req.params.__dict__, "max_tokens": max_tokens})
        try:
            run.gen = engine.submit(ids, params, disconnected, cache_hint=hint, constraint=constraint,
                                    hold_at=run.hold_at)
        except QueueFull as exc:
            raise HttpError(503, str(exc), "overloaded_error", headers={"Retry-After": "1"}) from None
        except LuceboxError as exc:
            raise HttpError(400, str(exc), "invalid_request_error") from None
        if compression is not None:
            run.gen.timings.arrival = arrived  # TTFT counts the scorer (queue_ms holds it: see compress_ms)
        return run

    @staticmethod
    def _prompt(ctx: ServerContext, builder: PromptBuilder,
                req: ChatRequest) -> tuple[list[int], str | None, ReasoningConfig | None, Constraint | None]:
        constraint = None
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
            text, reasoning = render_chat(ctx, builder, req)
            reject_oversized(ctx, builder.tokenizer, text)
            ids = builder.tokenizer.encode(text, add_special=False)
            constraint = output_constraint(ctx, builder, req, reasoning)
        return ids, text, reasoning, constraint

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
        close = (self.ctx.card.thinking_terminator_hint if self.ctx.card else None) or "\n</think>\n\n"
        thinking = ThinkingBudget(engine, self.gen, self.thinking_budget, self.hold_at,
                                  lambda: tok.encode(close, add_special=False))
        reason = "stop"
        try:
            thinking.check(pipeline.in_reasoning)  # a budget of 0: closed before the first token
            async for new in engine.stream(self.gen):
                batch: list[Event] = []
                if pipeline.has_reasoning:  # each token counts as reasoning or not, by where it lands
                    for token in new:
                        thinking.count(pipeline.in_reasoning)
                        batch.extend(pipeline.push(detok.push(token)))
                else:  # all answer text: the tokens of one event are decoded and parsed as one piece
                    thinking.count_answer(len(new))
                    batch = pipeline.push(detok.push_many(new))
                for ev in merge_events(batch):  # tokens that arrived together go out as one delta
                    if isinstance(ev, ToolCallEnd):
                        self.tool_calls.append(ev)
                    yield ev
                if self.req.params.logprobs is not None and len(seq.logprobs) > n_lp:
                    self.logprobs.extend(seq.logprobs[n_lp:])
                    n_lp = len(seq.logprobs)
                if pipeline.done:
                    engine.cancel(self.gen, "stop")
                    break
                thinking.check(pipeline.in_reasoning)
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
            yield ev
        for ev in pipeline.finish(reason):
            if isinstance(ev, ToolCallEnd):
                self.tool_calls.append(ev)
            if isinstance(ev, Finish):
                self._finish_usage(thinking.tokens)
                self._remember_calls(tok)
            yield ev

    def _remember_calls(self, tok: Any) -> None:
        """Keep the exact text of a tool-call turn, so the next request can render it back verbatim."""
        if not self.tool_calls or self.gen is None:
            return
        ids = list(self.gen.seq.output_ids)
        while ids and ids[-1] in tok.eos_ids:
            ids.pop()
        self.ctx.replay.remember([c.call_id for c in self.tool_calls], tok.decode(ids))

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


class ThinkingBudget:
    """One run's reasoning tokens, and its thinking budget enforced at an exact output position.

    The engine holds the sequence where the budget runs out (Sequence.hold_at): from the submission when the
    template opened the reasoning, else from the token where the model opened it (then the engine may have
    run past that point already, and stops where it is). At the hold the run decides: still reasoning, it
    forces the close tokens in (which lifts the hold); otherwise it lifts the hold. Reasoning that closes
    before the hold lifts it at once. So a greedy request's forced close lands at the same token every run,
    however far the engine had run ahead of the event loop (a speculative commit may pass the hold by a few
    tokens, the same ones every run).
    """

    def __init__(self, engine: AsyncEngine, gen: Generation, budget: int | None, hold: int | None,
                 close: Callable[[], list[int]]) -> None:
        self.engine = engine
        self.gen = gen
        self.budget = budget
        self.hold = hold  # the output length where the engine holds the sequence now, or None
        self.close = close  # the close tokens (model card's terminator hint or `</think>`)
        self.tokens = 0  # reasoning tokens so far (usage)
        self.seen = 0  # output tokens so far
        self.forced = False

    def count(self, in_reasoning: bool) -> None:
        """One output token, about to be pushed into the pipeline (`in_reasoning`: its state before it)."""
        if in_reasoning:
            if self.budget is not None and self.hold is None and not self.forced:  # the model opened reasoning
                self.hold = self.seen + max(self.budget - self.tokens, 0)
                self.engine.hold(self.gen, self.hold)
            self.tokens += 1
        self.seen += 1

    def count_answer(self, n: int) -> None:
        """`n` output tokens of a model without reasoning markup (none of them reasoning)."""
        self.seen += n

    def check(self, in_reasoning: bool) -> None:
        """After the tokens that arrived together: at (or past) the hold, close the reasoning or lift the hold;
        lift it too once the reasoning closed before it."""
        if self.hold is None or (in_reasoning and self.seen < self.hold):
            return
        if in_reasoning:
            self.engine.force_tokens(self.gen, self.close())
            self.forced = True
        else:
            self.engine.hold(self.gen, None)
        self.hold = None


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


def render_chat(ctx: ServerContext, builder: PromptBuilder, req: ChatRequest) -> tuple[str, ReasoningConfig | None]:
    """Template render; returns (prompt text, reasoning config)."""
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
    return text, reasoning


def output_constraint(ctx: ServerContext, builder: PromptBuilder, req: ChatRequest,
                      reasoning: ReasoningConfig | None) -> Constraint | None:
    """The grammar this request's answer follows (forced calls, tools, JSON; chat/constrain.py), compiled for
    the model's tokenizer, or None. A declaration or schema that cannot be compiled is a 400 naming it."""
    def plan(loose: frozenset[str] = frozenset()) -> Any:
        try:
            return plan_output(builder.tokenizer, builder.template.source, req.tools, req.tool_choice,
                               req.output_format, reasoning, req.parallel_tool_calls, loose)
        except LuceboxError as exc:
            raise bad_field("tool_choice", str(exc)) from None

    first = plan()
    if first is None:
        return None
    engine, _ = ctx.ready()
    try:
        compiler = compiler_for(builder.tokenizer, engine.engine.model_config.vocab_size)
    except GrammarError as exc:  # llguidance missing from a broken install
        raise bad_field(first.param, f"needs constrained decoding, which this server cannot do: {exc}") from None
    log.debug("constrained decoding: %s", first.reason)
    try:
        return compiler.constraint(grammar_from_lark(first.lark), first.reason, first.kind)
    except GrammarError as exc:
        error = exc
    bad = unreadable_tools(req.tools if req.tool_choice != "none" else None, lambda lark: compiler.check(
        grammar_from_lark(lark)))
    if bad:
        log.warning("constrained decoding: the parameters of %s do not compile (%s); their calls take any JSON "
                    "object", ", ".join(sorted(bad)), next(iter(bad.values()))[:200])
        again = plan(frozenset(bad))
        try:
            return compiler.constraint(grammar_from_lark(again.lark), again.reason, again.kind)
        except GrammarError as exc:
            error = exc
    raise bad_field(first.param, f"cannot be compiled into a grammar: {str(error)[:300]}") from None


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


def reject_oversized(ctx: ServerContext, tok: Any, text: str) -> None:
    """ContextOverflow, without tokenizing, for a text that cannot fit in the context.

    No token covers more than `tok.max_token_chars` characters (doubled here, for normalizers that shrink text), so a
    longer text holds more than n_ctx tokens for sure. Tokenizing it to find out took 16 MB bodies ~40 s and GBs of
    memory that were never returned, while the worker threads it held stalled every other request.
    """
    per_token = 2 * tok.max_token_chars
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
