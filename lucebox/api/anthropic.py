"""Anthropic Messages: `POST /v1/messages` and `/v1/messages/count_tokens` (what Claude Code speaks).

Three parts, top to bottom:

- parsing: the JSON body -> one `ChatRequest` (`parse_request`);
- rendering, pure: events -> the one JSON body (`message_body`) or the SSE
  frames (`StreamRenderer`, a content-block state machine);
- thin handlers that wire a `GenerationRun` to the two.

Choices this dialect makes (spec API.md, "Anthropic Messages"):

- Tool ids: the pipeline's `call_<hex>` goes out as `toolu_<hex>`; a
  `toolu_<x>` coming back in history becomes `call_<x>` again, so the prompt
  holds the same id whichever dialect produced the call.
- `tool_result` with `is_error: true` is rendered as the tool message
  `"Error: " + content` (`TOOL_ERROR_PREFIX`): chat templates have no error flag.
- `thinking` blocks in assistant history become `reasoning_content` (templates
  that render past reasoning can); `redacted_thinking` is dropped.
- Tools with a `type` (Anthropic server/built-in tools: `web_search_20250305`,
  `bash_20250124`, `text_editor_…`) cannot run here: dropped with one log line.
  Server-tool blocks in history (`server_tool_use`, `web_search_tool_result`, …)
  are dropped the same way.
- `system` messages inside `messages` (newer Claude Code sends an environment
  block and token notes that way; most chat templates refuse a system message
  that is not first): leading ones join the system prompt, later ones are folded
  into the user turn as `<system-reminder>` text. Consecutive turns of one role
  are merged, as the Anthropic API does.
- Usage follows Anthropic's meaning: `input_tokens` counts the prompt tokens
  that were *not* read from the prefix cache; `input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens` is the whole prompt,
  which is what `count_tokens` returns. In a stream, `message_start` carries
  what is known before the prefill and `message_delta` the final numbers.
- A prompt longer than the context answers Anthropic's own wording, `prompt is
  too long: N tokens > M maximum`, which Claude Code recognises (it compacts
  the conversation and retries).

Claude Code clean-up, on by default (kept small: only text that is per-request
noise or that makes small local models misbehave):

- system prompt (off with `ctx.raw_system`, env `LUCEBOX_/DFLASH_ANTHROPIC_RAW_SYSTEM=1`,
  which passes the system text through untouched): lines starting with
  `x-anthropic-billing-header:` are removed (their per-request `cch=` nonce
  defeats the prefix cache), and so are the identity lines "You are Claude Code,
  Anthropic's official CLI for Claude." / "You are a Claude agent, built on
  Anthropic's Claude Agent SDK." (small models then claim to be Claude);
- user content and tool results (off with `ctx.raw_user`, env
  `…_ANTHROPIC_RAW_USER=1`): `<system-reminder>` blocks whose text is one of
  Claude Code's fixed nags (`BOILERPLATE_REMINDERS`: the empty-todo-list and
  "TodoWrite hasn't been used" reminders, and the "consider whether it would be
  considered malware … MUST refuse to improve or augment the code" note appended
  to every file read, which makes small models refuse to edit code) are removed.
  Every other reminder (CLAUDE.md contents, changed files, plan mode, todo
  contents) carries real context and is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson

from lucebox.api.common import TEXT_ONLY, ServerContext, field_of, require_object, sampling_from_body, stop_list
from lucebox.chat.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from lucebox.chat.request import ChatRequest, bad_field, json_type, output_format, show_value
from lucebox.chat.run import ContextOverflow, GenerationRun, Usage, render_chat
from lucebox.http import HttpError, Request, Response, Router, error_body
from lucebox.http.router import log_failure

log = logging.getLogger(__name__)

PING_INTERVAL = 15.0
"""Seconds of silence in a stream (a long prefill, say) after which a `ping` event is sent."""

TOOL_ERROR_PREFIX = "Error: "
"""Put before the content of a `tool_result` with `is_error: true`."""

BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:.*(?:\r?\n|$)", re.MULTILINE)
IDENTITY_LINES = re.compile(
    r"^[ \t]*(?:You are Claude Code, Anthropic's official CLI for Claude"
    r"|You are a Claude agent, built on Anthropic's Claude Agent SDK)[^\n]*(?:\r?\n|$)",
    re.MULTILINE,
)
BOILERPLATE_REMINDERS = (
    "This is a reminder that your todo list is currently empty",
    "The TodoWrite tool hasn't been used recently",
    "The task tools haven't been used recently",
    "Whenever you read a file, you should consider whether it",
)
"""Claude Code `<system-reminder>` texts (prefixes) dropped from user content by default."""
_REMINDER = re.compile(r"\s*<system-reminder>\s*(.*?)\s*</system-reminder>", re.DOTALL)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence",
                "tool_calls": "tool_use", "cancelled": "end_turn"}
SERVER_BLOCKS = frozenset({"server_tool_use", "mcp_tool_use", "mcp_tool_result", "container_upload"})
"""History blocks of Anthropic-hosted tools (besides every `*_tool_result` but `tool_result`): dropped."""
_EMPTY_SCHEMA = {"type": "object", "properties": {}}


# ----- ids ----------------------------------------------------------------------------------


def new_message_id() -> str:
    """A fresh `msg_<24 hex>` id."""
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """The pipeline's `call_<x>` as Anthropic's `toolu_<x>`."""
    return "toolu_" + call_id.removeprefix("call_")


def call_id(tool_use_id: str) -> str:
    """A `toolu_<x>` from history back to `call_<x>` (other ids are kept as they are)."""
    return "call_" + tool_use_id[len("toolu_"):] if tool_use_id.startswith("toolu_") else tool_use_id


# ----- parsing ------------------------------------------------------------------------------


def clean_system(text: str) -> str:
    """The system prompt without billing-header lines and Claude identity lines (see the module doc)."""
    text = BILLING_HEADER.sub("", text)
    return IDENTITY_LINES.sub("", text).strip()


def strip_reminders(text: str) -> str:
    """`text` without Claude Code's boilerplate `<system-reminder>` blocks (others are kept)."""
    removed = False

    def repl(m: re.Match) -> str:
        nonlocal removed
        if m.group(1).startswith(BOILERPLATE_REMINDERS):
            removed = True
            return ""
        return m.group(0)

    out = _REMINDER.sub(repl, text)
    return out.strip() if removed else text


def parse_request(ctx: ServerContext, body: Any) -> ChatRequest:
    """A Messages request body -> ChatRequest; HttpError 400 naming the field for bad input."""
    body = require_object(body)
    raw = body.get("messages")
    if raw is None:
        raise bad_field("messages", "is required")
    if not isinstance(raw, list):
        raise bad_field("messages", f"must be an array, not {json_type(raw)}")
    if not raw:
        raise bad_field("messages", "must hold at least one message")
    conv = _Conversation(ctx)
    conv.add_system(body.get("system"), "system")
    for i, message in enumerate(raw):
        conv.add(i, message)
    tools, dropped = parse_tools(body.get("tools"))
    enable, budget = parse_thinking(body.get("thinking"))
    # `metadata`, `service_tier`, `container`, … and the anthropic-version/-beta headers are ignored
    return ChatRequest(
        messages=conv.result(),
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, dropped),
        params=sampling_from_body(body, ctx.card),
        max_tokens=field_of(body, "max_tokens", int),
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        stream=bool(field_of(body, "stream", bool, False)),
        enable_thinking=enable,
        thinking_budget=budget,
        model=field_of(body, "model", str, "") or ctx.model_id,
        output_format=parse_output_format(body),
        parallel_tool_calls=not (isinstance(body.get("tool_choice"), dict)
                                 and body["tool_choice"].get("disable_parallel_tool_use") is True),
    )


def parse_output_format(body: dict) -> dict | None:
    """Structured outputs: `output_config.format` (or the beta's top-level `output_format`), {"type":
    "json_schema", "schema": {...}}: the answer is JSON valid for the schema (chat/constrain.py)."""
    config = field_of(body, "output_config", dict, {})
    fmt, at = config.get("format"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, at = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_field(at, f"must be an object, not {json_type(fmt)}")
    return output_format(fmt.get("type"), fmt.get("schema"), f"{at}.type", f"{at}.schema", True)  # always strict


class _Conversation:
    """Builds the Hugging Face messages from Anthropic turns, merging turns of one role."""

    def __init__(self, ctx: ServerContext) -> None:
        self.raw_system = ctx.raw_system
        self.raw_user = ctx.raw_user
        self.system: list[str] = []
        self.messages: list[dict] = []
        self.tool_names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages

    def result(self) -> list[dict]:
        system = "\n".join(self.system)
        if not self.raw_system:
            system = clean_system(system)
        return ([{"role": "system", "content": system}] if system else []) + self.messages

    def add_system(self, value: Any, where: str) -> None:
        if value is None:
            return
        self.system.append(_text_of(value, where))

    def add(self, i: int, message: Any) -> None:
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_field(where, f"must be an object, not {json_type(message)}")
        role = message.get("role")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise bad_field(f"{where}.content", "must be a string or an array of content blocks")
        if role == "user":
            self._user(content, where)
        elif role == "assistant":
            self._assistant(content, where)
        elif role == "system":  # not in the public API, but Claude Code sends it (see the module doc)
            if not self.messages:
                self.add_system(content, f"{where}.content")
            else:
                text = _text_of(content, f"{where}.content")
                self._append({"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"})
        else:
            raise bad_field(f"{where}.role", f"must be 'user' or 'assistant', not {show_value(role)}")

    def _user(self, content: str | list, where: str) -> None:
        if isinstance(content, str):
            self._append({"role": "user", "content": self._user_text(content)})
            return
        texts: list[str] = []
        emitted = False

        def flush() -> None:
            nonlocal emitted
            if texts:
                self._append({"role": "user", "content": "\n".join(texts)})
                texts.clear()
                emitted = True

        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _block_type(block, at)
            if kind == "text":
                text = self._user_text(_str_field(block, "text", at))
                if text or self.raw_user:
                    texts.append(text)
            elif kind == "tool_result":
                flush()
                self._append(self._tool_result(block, at))
                emitted = True
            elif kind in ("image", "document"):
                raise HttpError(400, f"{TEXT_ONLY}: '{at}' is a {kind} block", "invalid_request_error")
            elif _is_server_block(kind):
                log.info("anthropic: dropped a %r block from history (a server tool that does not run here)", kind)
            else:
                raise bad_field(f"{at}.type", f"{show_value(kind)} is not a content block a user turn can hold")
        flush()
        if not emitted:
            self._append({"role": "user", "content": ""})

    def _user_text(self, text: str) -> str:
        return text if self.raw_user else strip_reminders(text)

    def _tool_result(self, block: dict, at: str) -> dict:
        tid = _str_field(block, "tool_use_id", at)
        text = self._user_text(_tool_result_text(block.get("content"), f"{at}.content"))
        if field_of(block, "is_error", bool, False, where=f"{at}."):
            text = TOOL_ERROR_PREFIX + text
        msg = {"role": "tool", "tool_call_id": call_id(tid), "content": text}
        if tid in self.tool_names:
            msg["name"] = self.tool_names[tid]
        return msg

    def _assistant(self, content: str | list, where: str) -> None:
        if isinstance(content, str):
            self._append({"role": "assistant", "content": content})
            return
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _block_type(block, at)
            if kind == "text":
                texts.append(_str_field(block, "text", at))
            elif kind == "thinking":
                reasoning.append(_str_field(block, "thinking", at))
            elif kind == "redacted_thinking":
                continue  # opaque to us; nothing a template could render
            elif kind == "tool_use":
                tid = _str_field(block, "id", at)
                name = _str_field(block, "name", at)
                args = field_of(block, "input", dict, {}, where=f"{at}.")
                self.tool_names[tid] = name
                calls.append({"id": call_id(tid), "type": "function", "function": {"name": name, "arguments": args}})
            elif kind in ("image", "document"):
                raise HttpError(400, f"{TEXT_ONLY}: '{at}' is a {kind} block", "invalid_request_error")
            elif _is_server_block(kind):
                log.info("anthropic: dropped a %r block from history (a server tool that does not run here)", kind)
            else:
                raise bad_field(f"{at}.type", f"{show_value(kind)} is not a content block an assistant turn can hold")
        msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        self._append(msg)

    def _append(self, msg: dict) -> None:
        """Add a message; a user/assistant turn right after one of the same role is merged into it."""
        last = self.messages[-1] if self.messages else None
        if last is None or msg["role"] not in ("user", "assistant") or last["role"] != msg["role"]:
            self.messages.append(msg)
            return
        last["content"] = "\n\n".join(t for t in (last["content"], msg["content"]) if t)
        if "reasoning_content" in msg:
            last["reasoning_content"] = "\n".join(t for t in (last.get("reasoning_content"), msg["reasoning_content"])
                                                  if t)
        if "tool_calls" in msg:
            last["tool_calls"] = [*last.get("tool_calls", []), *msg["tool_calls"]]


def _block_type(block: Any, at: str) -> str:
    if not isinstance(block, dict):
        raise bad_field(at, f"must be a content block object, not {json_type(block)}")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad_field(f"{at}.type", "is required (a string)")
    return kind


def _is_server_block(kind: str) -> bool:
    return kind in SERVER_BLOCKS or (kind.endswith("_tool_result") and kind != "tool_result")


def _str_field(block: dict, name: str, at: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise bad_field(f"{at}.{name}", "is required (a string)")
    return value


def _text_of(value: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (`cache_control` and other keys ignored)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(where, "must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind in ("image", "document"):
            raise HttpError(400, f"{TEXT_ONLY}: '{at}' is a {kind} block", "invalid_request_error")
        if kind != "text":
            raise bad_field(f"{at}.type", f"must be 'text', not {show_value(kind)}")
        texts.append(_str_field(block, "text", at))
    return "\n".join(texts)


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or an array of content blocks")
    texts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_str_field(block, "text", at))
        elif kind in ("image", "document"):
            raise HttpError(400, f"{TEXT_ONLY}: '{at}' is a {kind} block", "invalid_request_error")
        else:  # tool_reference, search_result, …: nothing a local template renders
            log.info("anthropic: dropped a %r block from a tool result", kind)
    return "\n".join(texts)


def parse_tools(value: Any) -> tuple[list[dict] | None, list[str]]:
    """Anthropic tools -> OpenAI-style function tools, plus the names of the dropped server tools."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise bad_field("tools", "must be an array")
    tools: list[dict] = []
    dropped: list[tuple[str, str]] = []  # (name, type)
    for k, tool in enumerate(value):
        at = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad_field(at, "must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            dropped.append((str(tool.get("name") or "?"), str(kind)))
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{at}.name", "is required (a non-empty string)")
        schema = field_of(tool, "input_schema", dict, _EMPTY_SCHEMA, where=f"{at}.")
        description = field_of(tool, "description", str, None, where=f"{at}.")
        fn: dict[str, Any] = {"name": name}
        if description:
            fn["description"] = description
        fn["parameters"] = schema
        tools.append({"type": "function", "function": fn})
    if dropped:
        log.info("anthropic: dropped tools that cannot run locally: %s",
                 ", ".join(f"{name} ({kind})" for name, kind in dropped))
    return tools or None, [name for name, _ in dropped]


def parse_tool_choice(value: Any, tools: list[dict] | None, dropped: list[str]) -> Any:
    """`{type: auto|any|tool|none, name}` -> ChatRequest.tool_choice ("any" means "required")."""
    if value is None:
        return "auto"
    if not isinstance(value, dict):
        raise bad_field("tool_choice", 'must be an object such as {"type": "auto"}')
    kind = value.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field("tool_choice.name", "is required when tool_choice.type is 'tool'")
        if name in dropped:
            log.info("anthropic: tool_choice names the dropped server tool %r; using auto", name)
            return "auto"
        if not any(t["function"]["name"] == name for t in tools or []):
            raise bad_field("tool_choice.name", f"names {show_value(name)}, which is not among the declared tools")
        return {"name": name}
    raise bad_field("tool_choice.type", f"must be auto, any, tool or none, not {show_value(kind)}")


def parse_thinking(value: Any) -> tuple[bool | None, int | None]:
    """`thinking` -> (enable_thinking, thinking_budget); adaptive leaves the template's default."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise bad_field("thinking", 'must be an object such as {"type": "enabled", "budget_tokens": 1024}')
    kind = value.get("type")
    if kind == "enabled":
        budget = field_of(value, "budget_tokens", int, where="thinking.")
        if budget is not None and budget < 1:
            raise bad_field("thinking.budget_tokens", "must be at least 1")
        return True, budget
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return None, None
    raise bad_field("thinking.type", f"must be enabled, disabled or adaptive, not {show_value(kind)}")


# ----- rendering (pure) --------------------------------------------------------------------


def usage_object(usage: Usage, *, final: bool = True) -> dict[str, int]:
    """Anthropic usage: `input_tokens` excludes the prompt tokens read from the prefix cache."""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens if final else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


CANCELLED = "the generation was cancelled before it finished (the server is shutting down); retry"


def stop_fields(finish: Finish) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a Finish that is not an error."""
    reason = STOP_REASONS.get(finish.reason, "end_turn")
    return reason, finish.stop_sequence if finish.reason == "stop_sequence" else None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        log.warning("anthropic: tool call arguments are not JSON: %.200r", arguments)
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(events: list[Event]) -> list[dict]:
    """The content array of a whole response: blocks in the order the model wrote them."""
    blocks: list[dict] = []
    for ev in events:
        if isinstance(ev, (TextDelta, ReasoningDelta)) and ev.text:
            kind, key = ("text", "text") if isinstance(ev, TextDelta) else ("thinking", "thinking")
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += ev.text
            else:
                blocks.append({"type": "text", "text": ev.text} if kind == "text"
                              else {"type": "thinking", "thinking": ev.text, "signature": ""})
        elif isinstance(ev, ToolCallEnd):
            blocks.append({"type": "tool_use", "id": tool_use_id(ev.call_id), "name": ev.name,
                           "input": _tool_input(ev.arguments)})
    return blocks


def message_body(msg_id: str, model: str, events: list[Event], finish: Finish, usage: Usage) -> dict:
    """The non-streaming response object."""
    reason, sequence = stop_fields(finish)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(events), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_object(usage)}


Frame = tuple[str, dict]
"""One SSE event: (event name, data object whose `type` is that name)."""


class StreamRenderer:
    """Events -> SSE frames; one content block open at a time, indices consecutive from 0.

    A text/thinking block stays open while deltas of its kind arrive; anything
    else closes it (a thinking block gets a `signature_delta` first). A tool
    call is one `tool_use` block from ToolCallStart to ToolCallEnd, all its
    argument pieces as `input_json_delta` inside it. Empty deltas are never sent.
    """

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id = msg_id
        self.model = model
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._index = -1  # index of the open (or last) block
        self._call: int | None = None  # pipeline index of the call in the open tool_use block
        self._sent_args = ""
        self.done = False

    def start(self, usage: Usage) -> list[Frame]:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage_object(usage, final=False)}
        return [("message_start", {"type": "message_start", "message": message}), self.ping()]

    @staticmethod
    def ping() -> Frame:
        return ("ping", {"type": "ping"})

    def push(self, ev: Event) -> list[Frame]:
        """Frames for one event (Finish is `finish`'s job: it needs the final usage)."""
        if isinstance(ev, TextDelta):
            return self._delta("text", {"type": "text_delta", "text": ev.text}) if ev.text else []
        if isinstance(ev, ReasoningDelta):
            return self._delta("thinking", {"type": "thinking_delta", "thinking": ev.text}) if ev.text else []
        if isinstance(ev, ToolCallStart):
            frames = self._close()
            self._call, self._sent_args = ev.index, ""
            block = {"type": "tool_use", "id": tool_use_id(ev.call_id), "name": ev.name, "input": {}}
            return frames + self._open_block("tool_use", block)
        if isinstance(ev, ToolCallArgsDelta):
            self._check_call(ev.index)
            if not ev.text:
                return []
            self._sent_args += ev.text
            return [self._delta_frame({"type": "input_json_delta", "partial_json": ev.text})]
        if isinstance(ev, ToolCallEnd):
            self._check_call(ev.index)
            frames = []
            if not self._sent_args and ev.arguments:  # arguments that came whole, never as pieces
                frames.append(self._delta_frame({"type": "input_json_delta", "partial_json": ev.arguments}))
            return frames + self._close()
        raise TypeError(f"StreamRenderer.push cannot render {ev!r}")

    def finish(self, fin: Finish, usage: Usage) -> list[Frame]:
        """Close the open block, then message_delta + message_stop (an `error` event for an engine failure)."""
        self.done = True
        if fin.reason == "error":
            return [self.error("generation failed on the server; see the server log")]
        if fin.reason == "cancelled":  # the server is shutting down: never a normal-looking end_turn
            return [("error", error_body("/v1/messages", 529, CANCELLED, "overloaded_error"))]
        reason, sequence = stop_fields(fin)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage_object(usage)}
        return self._close() + [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def error(self, message: str) -> Frame:
        """The `error` event for a failure after the stream started."""
        self.done = True
        return ("error", error_body("/v1/messages", 500, message, "api_error"))

    # -- the block state machine ---------------------------------------------------------

    def _delta(self, kind: str, delta: dict) -> list[Frame]:
        frames: list[Frame] = []
        if self._open != kind:
            frames += self._close()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            frames += self._open_block(kind, block)
        return frames + [self._delta_frame(delta)]

    def _open_block(self, kind: str, block: dict) -> list[Frame]:
        self._open = kind
        self._index += 1
        return [("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta_frame(self, delta: dict) -> Frame:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> list[Frame]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            frames.append(self._delta_frame({"type": "signature_delta", "signature": ""}))
        frames.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open, self._call = None, None
        return frames

    def _check_call(self, index: int) -> None:
        if self._open != "tool_use" or self._call != index:
            raise RuntimeError(f"tool call {index} event outside its tool_use block")


# ----- handlers ----------------------------------------------------------------------------


async def _start_run(ctx: ServerContext, req: ChatRequest, request: Request) -> GenerationRun:
    """GenerationRun.start, with the too-long-prompt error in Anthropic's wording (Claude Code compacts on it)."""
    try:
        return await GenerationRun.start(ctx, req, request.disconnected)
    except ContextOverflow as exc:
        raise HttpError(400, f"prompt is too long: {exc.n_prompt} tokens > {exc.n_ctx - 1} maximum",
                        "invalid_request_error") from None
    except HttpError as exc:
        if exc.status == 503:  # the queue is full: Anthropic's API says 529 overloaded_error
            raise HttpError(529, exc.message, "overloaded_error", headers=exc.headers) from None
        raise


def _log_usage(request: Request, run: GenerationRun, finish: Finish) -> None:
    request.log_fields.update(run.usage.log_fields(), finish=finish.reason)


async def _with_pings(events: AsyncIterator[Event]) -> AsyncIterator[Event | None]:
    """`events`, with a None each time PING_INTERVAL passes without one (the caller sends a ping)."""
    it = aiter(events)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=PING_INTERVAL)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                ev = task.result()
            except StopAsyncIteration:
                return
            yield ev
    finally:
        if pending is not None:  # cancelled mid-wait: stop the generator's step, then close it
            pending.cancel()
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()
        with contextlib.suppress(RuntimeError):
            await it.aclose()


async def _stream(request: Request, response: Response, run: GenerationRun, model: str) -> None:
    renderer = StreamRenderer(new_message_id(), model)

    async def send(frames: list[Frame]) -> None:
        for name, data in frames:
            await response.send_event(orjson.dumps(data), event=name)

    await response.start_stream()
    await send(renderer.start(run.usage))
    try:
        async with contextlib.aclosing(_with_pings(run.events())) as events:
            async for ev in events:
                if ev is None:
                    await send([renderer.ping()])
                elif isinstance(ev, Finish):
                    _log_usage(request, run, ev)
                    await send(renderer.finish(ev, run.usage))
                else:
                    await send(renderer.push(ev))
    except Exception:  # the status line is gone: report in-band, as the Anthropic API does
        log_failure(log, "anthropic: stream failed")
        if not renderer.done:
            await send([renderer.error("internal server error; see the server log")])
    await response.end()


def register(router: Router, ctx: ServerContext) -> None:
    """Add `POST /v1/messages` and `POST /v1/messages/count_tokens` to `router`."""

    async def messages(request: Request, response: Response) -> None:
        req = parse_request(ctx, request.json())
        run = await _start_run(ctx, req, request)
        if req.stream:
            await _stream(request, response, run, req.model)
            return
        events, finish = await run.collect()
        _log_usage(request, run, finish)
        if finish.reason == "error":
            raise HttpError(500, "generation failed on the server; see the server log", "api_error")
        if finish.reason == "cancelled":
            raise HttpError(529, CANCELLED, "overloaded_error", headers={"Retry-After": "2"})
        await response.send_json(200, message_body(new_message_id(), req.model, events, finish, run.usage))

    async def count_tokens(request: Request, response: Response) -> None:
        req = parse_request(ctx, request.json())
        _, builder = ctx.ready()

        def count() -> int:
            text, _ = render_chat(ctx, builder, req)
            return len(builder.tokenizer.encode(text, add_special=False))

        n = await asyncio.to_thread(count)  # off the loop; never queued behind generation
        request.log_fields["input_tokens"] = n
        await response.send_json(200, {"input_tokens": n})

    router.add("POST", "/v1/messages", messages)
    router.add("POST", "/v1/messages/count_tokens", count_tokens)
