"""OpenAI Responses (`POST /v1/responses`): the dialect Codex CLI speaks.

Three parts, in this order:

1. Parsing: the JSON body -> `ParsedRequest` (a dialect-neutral `ChatRequest`
   plus what the response object echoes back). Input items become Hugging Face
   chat messages: `instructions` and every system/developer item merge into
   one leading system message; `function_call` / `custom_tool_call` items join
   the assistant message before them; their outputs become `role: tool`;
   `reasoning` items are dropped. Freeform `custom` tools (Codex's
   `apply_patch`) are offered to the model as functions with one string
   parameter `input`; hosted tool types (web_search, local_shell, ...) cannot
   run here and are dropped with a log line, never a 400.
2. Rendering: `ResponseRenderer`, a pure state machine from the engine's
   events (chat/events.py) to Responses stream events and the final response
   object. The non-streaming path feeds the same renderer, so both paths build
   identical objects.
3. Handlers: thin glue between HTTP, `GenerationRun` and the renderer. A
   stream always ends with exactly one of `response.completed`,
   `response.incomplete` or `response.failed`, unless the client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from lucebox.api.common import (
    TEXT_ONLY,
    ServerContext,
    field_of,
    reject_n,
    require_object,
    sampling_from_body,
    stop_list,
    type_field,
)
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
from lucebox.chat.run import GenerationRun, Usage
from lucebox.http import HttpError, Request, Response, Router
from lucebox.http.router import log_failure
from lucebox.model_cards import TIERS

log = logging.getLogger(__name__)

PATH = "/v1/responses"
PLAIN = {"type": "text"}  # the output format a request that names none gets

# ===================================================================================
# 1. Parsing
# ===================================================================================

STATEFUL = "this server is stateless and keeps no responses: send the whole conversation in 'input'"

# Tools the platform runs itself; a local server cannot, so they are dropped (logged).
_HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "local_shell", "shell", "apply_patch", "image_generation", "code_interpreter", "computer_use_preview",
    "computer", "mcp", "tool_search",
})
# Input items produced by hosted tools or server-side state; they carry nothing a template can render.
_HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call", "computer_call",
    "computer_call_output", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
    "mcp_call", "tool_search_call", "tool_search_output", "compaction", "compaction_summary",
})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image", "image_url", "file"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_EFFORT_ALIASES = {"minimal": "low", "xhigh": "x-high", "x_high": "x-high"}  # OpenAI names -> model-card tiers


@dataclass
class ParsedRequest:
    """A Responses request: the neutral ChatRequest plus what the response object echoes."""

    chat: ChatRequest
    echo: dict[str, Any]  # instructions, tools, tool_choice, reasoning, ... as the response object shows them
    custom_tools: frozenset[str] = frozenset()  # names whose calls are emitted as custom_tool_call items
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> namespace it was declared in


def parse_request(body: dict, ctx: ServerContext) -> ParsedRequest:
    """Validate a `/v1/responses` body; HttpError 400 naming the field on bad input."""
    require_object(body)
    if body.get("previous_response_id") is not None:
        raise bad_field("previous_response_id", f"is not supported: {STATEFUL}")
    if body.get("conversation") is not None:
        raise bad_field("conversation", f"is not supported: {STATEFUL}")
    if field_of(body, "background", bool, False):
        raise bad_field("background", f"= true is not supported: {STATEFUL}")
    reject_n(body)

    instructions = field_of(body, "instructions", str)
    messages = parse_input(body.get("input"), instructions)
    tools, custom, namespaces, echo_tools = parse_tools(body.get("tools"))
    tool_choice, tools = parse_tool_choice(body.get("tool_choice"), tools)

    max_output = field_of(body, "max_output_tokens", int)
    if max_output is not None and max_output < 1:
        raise bad_field("max_output_tokens", "must be at least 1")
    reasoning = field_of(body, "reasoning", dict, {})
    effort = effort_name = field_of(reasoning, "effort", str, where="reasoning.")
    summary = field_of(reasoning, "summary", str, where="reasoning.")

    chat = ChatRequest(
        messages=messages,
        tools=tools or None,
        tool_choice=tool_choice,
        params=sampling_from_body(body, ctx.card),
        max_tokens=max_output,
        stop=stop_list(body.get("stop")),
        stream=field_of(body, "stream", bool, False),
        model=field_of(body, "model", str, "") or ctx.model_id,
        output_format=parse_text_format(body.get("text")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
    )
    if effort is not None:
        effort = _EFFORT_ALIASES.get(effort, effort)
        if effort == "none":
            chat.enable_thinking = False
        elif effort not in TIERS:
            raise bad_field("effort", f"= {show_value(effort)} is not one of none, minimal, low, medium, high, xhigh",
                            "reasoning.")
        else:
            chat.reasoning_effort = effort
    # Ignored fields (store, metadata, truncation, user, ...) are only echoed, and only when well-formed.
    text = body.get("text")
    echo = {
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": chat.params.temperature,
        "top_p": chat.params.top_p,
        "max_output_tokens": max_output,
        "reasoning": {"effort": effort_name, "summary": summary},
        "metadata": body["metadata"] if isinstance(body.get("metadata"), dict) else {},
        "text": text if isinstance(text, dict) and isinstance(text.get("format"), dict) else {"format": PLAIN},
        "store": body.get("store") is not False,
        "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
        "service_tier": "default",
    }
    return ParsedRequest(chat, echo, frozenset(custom), namespaces)


def parse_text_format(text: Any) -> dict | None:
    """`text.format`: {"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict"}."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_field("text", f"must be an object, not {json_type(text)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_field("text.format", f"must be an object, not {json_type(fmt)}")
    return output_format(fmt.get("type"), fmt.get("schema"), "text.format.type", "text.format.schema",
                         fmt.get("strict"))


def parse_input(value: Any, instructions: str | None = None) -> list[dict]:
    """`input` (a string or a list of items) -> chat messages, system text first."""
    if value is None:
        raise bad_field("input", "is required")
    system: list[str] = [instructions] if instructions else []
    messages: list[dict] = []
    names: dict[str, str] = {}  # call_id -> tool name, for tool results
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _add_item(item, i, system, messages, names)
    else:
        raise bad_field("input", f"must be a string or an array of items, not {json_type(value)}")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _add_item(item: Any, i: int, system: list[str], messages: list[dict], names: dict[str, str]) -> None:
    where = f"input[{i}]."
    if isinstance(item, str):  # lenient: a bare string is a user message
        messages.append({"role": "user", "content": item})
        return
    if not isinstance(item, dict):
        raise bad_field(f"input[{i}]", f"must be an object, not {json_type(item)}")
    kind = type_field(item, where)
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = field_of(item, "role", str, where=where)
        if role not in _ROLES:
            raise bad_field("role", f"= {show_value(role)} must be one of user, assistant, system, developer", where)
        text = content_text(item.get("content"), f"input[{i}].content")
        if role in ("system", "developer"):
            if text:
                system.append(text)
        else:
            messages.append({"role": role, "content": text})
    elif kind in ("function_call", "custom_tool_call"):
        call_id = _required_str(item, "call_id", where)
        name = _required_str(item, "name", where)
        if kind == "function_call":
            arguments = field_of(item, "arguments", (str, dict), "", where=where) or "{}"
        else:
            arguments = {"input": field_of(item, "input", str, "", where=where)}
        names[call_id] = name
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one assistant turn holds its text and all its calls
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = _required_str(item, "call_id", where)
        output = item.get("output")
        text = "" if output is None else content_text(output, f"input[{i}].output")
        msg = {"role": "tool", "tool_call_id": call_id, "content": text}
        if call_id in names:
            msg["name"] = names[call_id]
        messages.append(msg)
    elif kind == "reasoning":
        return  # the model's earlier thinking: accepted, never rendered back (summary or not)
    elif kind == "item_reference":
        raise bad_field("type", f"= 'item_reference' is not supported: {STATEFUL}", where)
    elif kind in _HOSTED_ITEMS:
        log.info("responses: dropped input item %d of type %r (hosted tools do not run on this server)", i, kind)
    else:
        raise bad_field("type", f"= {show_value(kind)} is not a known input item type", where)


def _required_str(item: dict, name: str, where: str) -> str:
    value = field_of(item, name, str, where=where)
    if not value:
        raise bad_field(name, "is required", where)
    return value


def content_text(content: Any, name: str) -> str:
    """Message content (a string or a list of parts) -> one string; media parts -> 400 text only."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_field(name, f"must be a string or an array of content parts, not {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_field(f"{name}[{j}]", "must be an object")
        kind = type_field(part, f"{name}[{j}].")
        if kind in _TEXT_PARTS:
            texts.append(field_of(part, "text", str, "", where=f"{name}[{j}]."))
        elif kind == "refusal":
            texts.append(field_of(part, "refusal", str, "", where=f"{name}[{j}]."))
        elif kind in _MEDIA_PARTS:
            raise HttpError(400, f"'{name}[{j}]' is of type {show_value(kind)}: {TEXT_ONLY}", "invalid_request_error",
                            param=f"{name}[{j}]")
        else:
            raise bad_field(f"{name}[{j}].type", f"= {show_value(kind)} is not a known content part type")
    return "\n".join(texts)


def parse_tools(value: Any) -> tuple[list[dict], set[str], dict[str, str], list[dict]]:
    """`tools` -> (chat-template tools, custom tool names, namespace of each function, tools to echo)."""
    if value is None:
        return [], set(), {}, []
    if not isinstance(value, list):
        raise bad_field("tools", "must be an array")
    tools: list[dict] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    echo: list[dict] = []

    def add(tool: Any, where: str, namespace: str | None) -> None:
        if not isinstance(tool, dict):
            raise bad_field(where, "must be an object")
        kind = type_field(tool, where + ".")
        if kind == "function":
            name = _required_str(tool, "name", where + ".")
            params = field_of(tool, "parameters", dict, None, where=where + ".") or {"type": "object",
                                                                                     "properties": {}}
            fn = {"name": name, "description": field_of(tool, "description", str, "", where=where + "."),
                  "parameters": params}
            tools.append({"type": "function", "function": fn})
        elif kind == "custom":
            name = _required_str(tool, "name", where + ".")
            description = field_of(tool, "description", str, "", where=where + ".")
            fmt = field_of(tool, "format", dict, None, where=where + ".")
            tools.append({"type": "function", "function": custom_tool_function(name, description, fmt)})
            custom.add(name)
        elif kind == "namespace":  # a group of tools: offered flat, calls say which namespace they came from
            ns = _required_str(tool, "name", where + ".")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad_field("tools", "must be an array", where + ".")
            for k, sub in enumerate(inner):
                add(sub, f"{where}.tools[{k}]", ns)
            return
        else:
            log.info("responses: dropped tool %s of type %r (it cannot run on this server)", where, kind)
            return
        if namespace:
            namespaces[tools[-1]["function"]["name"]] = namespace

    for i, tool in enumerate(value):
        add(tool, f"tools[{i}]", None)
        if isinstance(tool, dict) and tool.get("type") in ("function", "custom", "namespace"):
            echo.append(tool)
    return tools, custom, namespaces, echo


def custom_tool_function(name: str, description: str, fmt: dict | None) -> dict:
    """A freeform `custom` tool as a function with one string parameter `input` (what templates can render)."""
    about = "The raw input for this tool, as plain text (not JSON)."
    if fmt and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        about += f" It must match this {fmt.get('syntax') or ''} grammar:\n{fmt['definition']}"
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": about}},
                           "required": ["input"]}}


def parse_tool_choice(value: Any, tools: list[dict]) -> tuple[Any, list[dict]]:
    """`tool_choice` -> (ChatRequest.tool_choice, the tools left on offer)."""
    if value is None or value in ("auto", "none", "required"):
        return value or "auto", tools
    if isinstance(value, dict):
        kind = type_field(value, "tool_choice.")
        if kind in ("function", "custom"):
            fn = value.get("function")  # the Chat Completions spelling, nested
            name = value.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
            if not isinstance(name, str) or not name:
                raise bad_field("tool_choice.name", "is required (a non-empty string)")
            return {"name": name}, tools
        if kind == "allowed_tools":
            mode = value.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise bad_field("tool_choice.mode", "must be auto or required")
            allowed = value.get("tools")
            if not isinstance(allowed, list):
                raise bad_field("tool_choice.tools", "must be an array")
            keep = set()
            for k, t in enumerate(allowed):  # hosted tools are listed by type alone, without a name
                if not isinstance(t, dict) or not isinstance(t.get("name", ""), str):
                    raise bad_field(f"tool_choice.tools[{k}]", 'must be an object whose "name" is a string')
                keep.add(t.get("name"))
            return mode, [t for t in tools if t["function"]["name"] in keep]
        if kind in _HOSTED_TOOLS:
            raise bad_field("tool_choice", f"forces the {show_value(kind)} tool, which cannot run on this server")
    raise bad_field("tool_choice", "must be auto, none, required, {type: function, name} or {type: custom, name}")


# ===================================================================================
# 2. Rendering (pure: no I/O)
# ===================================================================================


def new_id(prefix: str) -> str:
    """`prefix_` + 48 hex digits, the shape of OpenAI's ids."""
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_object(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _InputField:
    """Streams the decoded `input` string of a JSON object text (`{"input": "..."}`) as the text grows.

    A custom tool's arguments arrive as JSON pieces (`{"input": "*** Begin`,
    ` Patch\\n`, ...) but its `input` must stream as the plain string. If
    the object does not start with an `input` string, nothing streams and the
    call's done event gives the whole input (see `custom_input`).
    """

    _HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')
    _BODY = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')

    def __init__(self) -> None:
        self.raw = ""
        self.pos = -1  # where the undecoded part of the string value starts; -1 before the head is read
        self.state = "head"  # head -> body -> end; or off (not of the expected shape)
        self.sent = ""

    def push(self, piece: str) -> str:
        self.raw += piece
        if self.state == "head":
            m = self._HEAD.match(self.raw)
            if m is None:
                if not _may_become_head(self.raw):
                    self.state = "off"
                return ""
            self.state, self.pos = "body", m.end()
        if self.state != "body":
            return ""
        end = self._BODY.match(self.raw, self.pos).end()
        if end < len(self.raw) and self.raw[end] == '"':
            self.state = "end"
        elif end < len(self.raw) and self.raw[end] == "\\" and len(self.raw) - end >= 6:
            self.state = "off"  # an invalid escape: stop streaming, `done` decides
        seg = self.raw[self.pos:end]
        if self.state == "body" and _ends_in_high_surrogate(seg):  # wait for the low half of the pair
            seg, end = seg[:-6], end - 6
        if not seg:
            return ""
        text = json.loads(f'"{seg}"', strict=False)
        self.pos = end
        self.sent += text
        return text


def _ends_in_high_surrogate(seg: str) -> bool:
    """Whether a JSON string body ends in the escape `\\uD800`-`\\uDBFF` (not an escaped backslash + 'u...')."""
    if re.search(r"\\u[dD][89abAB][0-9a-fA-F]{2}$", seg) is None:
        return False
    slashes = len(seg) - 5 - len(seg[:-5].rstrip("\\"))
    return slashes % 2 == 1


def _may_become_head(raw: str) -> bool:
    """Whether `raw` could still grow into `{"input": "` (it is a prefix of that, give or take whitespace)."""
    m = re.fullmatch(r'\s*(?:\{\s*(?:"(?P<key>[^"]*)(?P<close>"\s*(?::\s*)?)?)?)?', raw)
    if m is None:
        return False
    key = m.group("key")
    return key is None or (key == "input" if m.group("close") else "input".startswith(key))


def custom_input(arguments: str) -> str:
    """The freeform input of a custom tool call from its JSON arguments (`{"input": "..."}`).

    Arguments of another shape are passed on whole, so nothing the model wrote is lost.
    """
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and "input" in args:
        value = args["input"]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return arguments


class ResponseRenderer:
    """Engine events -> Responses stream events (dicts with `type` and `sequence_number`) and the response.

    `start()` gives response.created + response.in_progress; `push(event)` the
    events one engine event causes (opening and closing output items as the
    kind of output changes); `finish(finish, usage)` closes the open item and
    gives the terminal event; `fail(message)` ends with response.failed
    instead. `response` is the response object as it stands.
    """

    def __init__(self, *, model: str, echo: dict[str, Any] | None = None, custom_tools: frozenset[str] = frozenset(),
                 namespaces: dict[str, str] | None = None, response_id: str | None = None,
                 created_at: int | None = None) -> None:
        self.custom_tools = custom_tools
        self.namespaces = namespaces or {}
        self.response: dict[str, Any] = {
            "id": response_id or new_id("resp"),
            "object": "response",
            "created_at": created_at if created_at is not None else int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": None,
            "model": model,
            "output": [],
            "output_text": "",
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "temperature": None,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": None,
            "truncation": "disabled",
            "usage": None,
            "metadata": {},
            **(echo or {}),
        }
        self.seq = 0
        self.done = False
        self._item: dict | None = None  # the open output item (also the last entry of response["output"])
        self._text = ""  # text of the open message / reasoning summary
        self._args: _InputField | None = None  # decoder of the open custom tool call's input

    # -- public --------------------------------------------------------------------------

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def push(self, ev: Event) -> list[dict]:
        if self.done:
            raise RuntimeError("ResponseRenderer.push after the terminal event")
        if isinstance(ev, TextDelta):
            return self._text_delta(ev.text, "message") if ev.text else []
        if isinstance(ev, ReasoningDelta):
            return self._text_delta(ev.text, "reasoning") if ev.text else []
        if isinstance(ev, ToolCallStart):
            return self._open_call(ev)
        if isinstance(ev, ToolCallArgsDelta):
            return self._args_delta(ev.text)
        if isinstance(ev, ToolCallEnd):
            return self._close_call(ev.arguments)
        if isinstance(ev, Finish):
            return self.finish(ev)
        raise TypeError(f"not a generation event: {ev!r}")

    def finish(self, finish: Finish, usage: Usage | None = None) -> list[dict]:
        """Close the open item and end with completed / incomplete / failed, by the finish reason."""
        if finish.reason == "error":
            return self.fail("the generation failed inside the engine; see the server log", usage)
        if finish.reason == "cancelled":
            return self.fail("the generation was cancelled (the server is shutting down)", usage)
        status = "incomplete" if finish.reason == "length" else "completed"
        out = self._close(status)
        self.response["status"] = status
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + self._terminal(f"response.{status}", usage)

    def render_all(self, events: list[Event], usage: Usage | None = None) -> dict:
        """Feed a whole finished generation (ending in Finish); the final response object (non-streaming)."""
        self.start()
        for ev in events:
            if isinstance(ev, Finish):
                self.finish(ev, usage)
            else:
                self.push(ev)
        return self.response

    def fail(self, message: str, usage: Usage | None = None, code: str = "server_error") -> list[dict]:
        """End with response.failed carrying `error` (an internal error mid-stream, say)."""
        if self.done:
            return []
        out = self._close("incomplete")
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message}
        return out + self._terminal("response.failed", usage)

    # -- items ---------------------------------------------------------------------------

    def _text_delta(self, text: str, kind: str) -> list[dict]:
        out: list[dict] = []
        if self._item is None or self._item["type"] != kind:
            out += self._close("completed")
            out += self._open_text_item(kind)
        self._text += text
        ref = self._ref()
        if kind == "message":
            out.append(self._event("response.output_text.delta", **ref, content_index=0, delta=text, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_summary_text.delta", **ref, summary_index=0, delta=text))
        return out

    def _open_text_item(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": []}
        out = self._open(item)
        ref = self._ref()
        if kind == "message":
            out.append(self._event("response.content_part.added", **ref, content_index=0, part=self._part("")))
        else:
            out.append(self._event("response.reasoning_summary_part.added", **ref, summary_index=0,
                                   part={"type": "summary_text", "text": ""}))
        return out

    def _open_call(self, ev: ToolCallStart) -> list[dict]:
        out = self._close("completed")
        if ev.name in self.custom_tools:
            item = {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": ev.call_id,
                    "name": ev.name, "input": ""}
            self._args = _InputField()
        else:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": ev.call_id,
                    "name": ev.name, "arguments": ""}
        if ev.name in self.namespaces:
            item["namespace"] = self.namespaces[ev.name]
        return out + self._open(item)

    def _args_delta(self, text: str) -> list[dict]:
        item = self._item
        if item is None or item["type"] not in ("function_call", "custom_tool_call") or not text:
            return []
        if item["type"] == "function_call":
            item["arguments"] += text
            return [self._event("response.function_call_arguments.delta", **self._ref(), delta=text)]
        assert self._args is not None
        piece = self._args.push(text)
        if not piece:
            return []
        item["input"] += piece
        return [self._event("response.custom_tool_call_input.delta", **self._ref(), delta=piece)]

    def _close_call(self, arguments: str) -> list[dict]:
        item = self._item
        if item is None or item["type"] not in ("function_call", "custom_tool_call"):
            return []
        if item["type"] == "function_call":
            item["arguments"] = arguments
        else:
            item["_final_input"] = custom_input(arguments)
        return self._close("completed")

    def _open(self, item: dict) -> list[dict]:
        self._item = item
        self._text = ""
        self.response["output"].append(item)
        return [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                            item=_copy(item))]

    def _close(self, status: str) -> list[dict]:
        """Finish the open item (if any): its done events, then response.output_item.done."""
        item = self._item
        if item is None:
            return []
        ref = self._ref()
        out: list[dict] = []
        kind = item["type"]
        if kind == "message":
            part = self._part(self._text)
            item["content"] = [part]
            item["status"] = status
            self.response["output_text"] += self._text
            out.append(self._event("response.output_text.done", **ref, content_index=0, text=self._text, logprobs=[]))
            out.append(self._event("response.content_part.done", **ref, content_index=0, part=_copy(part)))
        elif kind == "reasoning":
            part = {"type": "summary_text", "text": self._text}
            item["summary"] = [part]
            out.append(self._event("response.reasoning_summary_text.done", **ref, summary_index=0, text=self._text))
            out.append(self._event("response.reasoning_summary_part.done", **ref, summary_index=0, part=_copy(part)))
        elif kind == "function_call":
            item["status"] = status
            out.append(self._event("response.function_call_arguments.done", **ref, arguments=item["arguments"]))
        else:  # custom_tool_call: stream whatever of the final input the deltas did not carry
            final = item.pop("_final_input", item["input"])
            if final.startswith(item["input"]) and len(final) > len(item["input"]):
                out.append(self._event("response.custom_tool_call_input.delta", **ref,
                                       delta=final[len(item["input"]):]))
            item["input"] = final
            item["status"] = status
            out.append(self._event("response.custom_tool_call_input.done", **ref, input=final))
            self._args = None
        out.append(self._event("response.output_item.done", output_index=ref["output_index"], item=_copy(item)))
        self._item = None
        self._text = ""
        return out

    # -- helpers -------------------------------------------------------------------------

    def _terminal(self, kind: str, usage: Usage | None) -> list[dict]:
        if usage is not None:
            self.response["usage"] = usage_object(usage)
        if self.response["status"] == "completed":
            self.response["completed_at"] = int(time.time())
        self.done = True
        return [self._event(kind, response=self._snapshot())]

    def _ref(self) -> dict:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.response["output"]) - 1}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _snapshot(self) -> dict:
        return _copy(self.response)

    def _event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev


def _copy(obj: dict) -> dict:
    """A deep copy of JSON data (events must not change when the renderer mutates its state later)."""
    return orjson.loads(orjson.dumps(obj))


# ===================================================================================
# 3. Handlers
# ===================================================================================


def register(router: Router, ctx: ServerContext) -> None:
    """Serve `POST /v1/responses`."""

    async def create(request: Request, response: Response) -> None:
        parsed = parse_request(require_object(request.json()), ctx)
        run = await GenerationRun.start(ctx, parsed.chat, request.disconnected)
        renderer = ResponseRenderer(model=parsed.chat.model, echo=parsed.echo, custom_tools=parsed.custom_tools,
                                    namespaces=parsed.namespaces)
        if parsed.chat.stream:
            await _stream(request, response, run, renderer)
        else:
            await _complete(request, response, run, renderer)
        request.log_fields.update(run.usage.log_fields(), outcome=renderer.response["status"])

    router.add("POST", PATH, create)


async def _complete(request: Request, response: Response, run: GenerationRun, renderer: ResponseRenderer) -> None:
    events, finish = await run.collect()
    if finish.reason == "error":
        raise HttpError(500, "the generation failed inside the engine; see the server log", "server_error")
    if finish.reason == "cancelled" and not request.disconnected.is_set():
        raise HttpError(503, "the generation was cancelled (the server is shutting down); retry later",
                        "overloaded_error", headers={"Retry-After": "2"})
    # if the client already left, the write is dropped silently
    await response.send_json(200, renderer.render_all([*events, finish], run.usage))


async def _stream(request: Request, response: Response, run: GenerationRun, renderer: ResponseRenderer) -> None:
    await response.start_stream()
    await _send(response, renderer.start())
    try:
        async with contextlib.aclosing(run.events()) as events:  # closing it cancels the generation
            async for ev in events:
                if request.disconnected.is_set():
                    return  # nobody is listening; the engine aborts the generation
                frames = renderer.finish(ev, run.usage) if isinstance(ev, Finish) else renderer.push(ev)
                await _send(response, frames)
    except asyncio.CancelledError:  # the server is shutting down: still tell the client how it ended
        if not renderer.done and not request.disconnected.is_set():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(_send(response, renderer.fail("the server is shutting down")), 1.0)
        raise
    except Exception:
        log_failure(log, "responses: generation failed mid-stream")
        if not renderer.done and not request.disconnected.is_set():
            await _send(response, renderer.fail("internal server error; see the server log", run.usage))
        return
    if not renderer.done and not request.disconnected.is_set():  # cannot happen: events end with Finish
        await _send(response, renderer.fail("the generation ended without a finish", run.usage))


async def _send(response: Response, frames: list[dict]) -> None:
    for frame in frames:
        await response.send_event(orjson.dumps(frame), event=frame["type"])
