"""OpenAI Chat Completions (`POST /v1/chat/completions`) and legacy Completions (`POST /v1/completions`).

Three layers, each testable on its own:

- parsing: `parse_chat` / `parse_completion` turn a JSON body into a `ChatRequest`
  (400 naming the field for anything malformed, never a 500);
- rendering: `ChatRenderer` / `TextRenderer` turn the run's events (chat/events.py)
  into wire objects. They are pure: no I/O, so every event sequence can be unit-tested;
- handlers: `chat_completions` / `completions` start a `GenerationRun` and write the
  rendered objects, as one JSON body or as `data: {chunk}` SSE frames ending in `data: [DONE]`.

Streaming logprobs: the run reports a token's logprob after the events of that token
have been produced, so each chunk carries the logprobs that arrived since the previous
chunk (whatever is left goes with the finishing chunk). Concatenated over the stream
they are exactly the non-streaming list.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
import time
from contextlib import aclosing
from typing import Any

import orjson

from lucebox.api.common import (
    TEXT_ONLY,
    ServerContext,
    check_logit_bias,
    field_of,
    reject_n,
    require_object,
    sampling_from_body,
    stop_list,
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
from lucebox.chat.request import ChatRequest, bad_field, output_format, show_value
from lucebox.chat.run import GenerationRun, Usage
from lucebox.engine.runtime.sampler import TokenLogprobs
from lucebox.engine.tokenizer import Tokenizer
from lucebox.http import HttpError, Request, Response, Router, error_body
from lucebox.http.router import log_failure

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")
_MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url")
_EFFORTS = {"none": None, "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "x-high",
            "x-high": "x-high", "max": "max"}
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


# ----- parsing -------------------------------------------------------------------------------------------------


def parse_chat(body: Any, ctx: ServerContext) -> ChatRequest:
    """A Chat Completions body → ChatRequest; HttpError 400 naming the field on bad input.

    Fields the server cannot use but clients send anyway (user, metadata, store,
    service_tier, stream_options, prompt_cache_key, include,
    truncation, previous_response_id, ...) are ignored; `logit_bias` too, once checked. `response_format`
    json_object / json_schema holds the answer to JSON (chat/constrain.py).
    """
    body = require_object(body)
    reject_n(body)
    check_logit_bias(body.get("logit_bias"))
    messages = field_of(body, "messages", list)
    if not messages:
        raise bad_field("messages", "must be a non-empty array of messages")
    tools = parse_tools(body.get("tools"))
    want_logprobs = field_of(body, "logprobs", bool, False)
    top = field_of(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_field("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
    if top is not None and not want_logprobs:
        raise bad_field("top_logprobs", "needs 'logprobs': true")
    req = ChatRequest(
        messages=parse_messages(messages),
        tools=tools or None,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        params=sampling_from_body(body, ctx.card, logprobs=(top or 0) if want_logprobs else None),
        max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
        stop=stop_list(body.get("stop")),
        stream=field_of(body, "stream", bool, False),
        model=field_of(body, "model", str, "") or ctx.model_id,
        output_format=parse_response_format(body.get("response_format")),
        parallel_tool_calls=field_of(body, "parallel_tool_calls", bool, True),
    )
    _parse_reasoning(body, req)
    return req


def parse_response_format(value: Any) -> dict | None:
    """`response_format`: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}} (strict or not, the answer is held to the schema)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_field("response_format", "must be an object such as {\"type\": \"json_object\"}")
    spec = value.get("json_schema")
    if value.get("type") == "json_schema" and not isinstance(spec, dict):
        raise bad_field("response_format.json_schema", "must be an object with the schema")
    schema, strict = (spec.get("schema"), spec.get("strict")) if isinstance(spec, dict) else (None, None)
    return output_format(value.get("type"), schema, "response_format.type", "response_format.json_schema.schema",
                         strict)


def parse_completion(body: Any, ctx: ServerContext) -> ChatRequest:
    """A legacy Completions body → ChatRequest with `prompt` set (no chat template)."""
    body = require_object(body)
    reject_n(body)
    check_logit_bias(body.get("logit_bias"))
    best_of = field_of(body, "best_of", int, 1)
    if best_of != 1:
        raise bad_field("best_of", f"= {best_of} is not supported: this server returns one choice per request")
    if field_of(body, "echo", bool, False):
        raise bad_field("echo", "is not supported: the completion never repeats the prompt")
    field_of(body, "suffix", str)  # accepted for its type, not used: no fill-in-the-middle template
    logprobs = field_of(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_field("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
    return ChatRequest(
        prompt=parse_prompt(body.get("prompt")),
        params=sampling_from_body(body, ctx.card, logprobs=logprobs),
        max_tokens=_max_tokens(body, "max_tokens"),
        stop=stop_list(body.get("stop")),
        stream=field_of(body, "stream", bool, False),
        model=field_of(body, "model", str, "") or ctx.model_id,
    )


def parse_prompt(value: Any) -> str | list[int]:
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad_field("prompt", f"holds {len(value)} prompts; this server takes one prompt per request")
    if value is None:
        raise bad_field("prompt", "is required")
    raise bad_field("prompt", "must be a string or a non-empty array of token ids")


def parse_messages(messages: list) -> list[dict]:
    """OpenAI messages → Hugging Face chat-template messages (see common.py)."""
    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call_id → function name, for tool results that omit it
    for i, raw in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(raw, dict):
            raise bad_field(f"messages[{i}]", "must be an object")
        role = field_of(raw, "role", str, where=where)
        if role not in _ROLES:
            raise bad_field("role", f"must be one of {', '.join(_ROLES)}, not {show_value(role)}", where)
        msg: dict[str, Any] = {"role": _ROLES[role], "content": content_text(raw.get("content"), where + "content")}
        if role == "assistant":
            reasoning = field_of(raw, "reasoning_content", str, where=where)
            if not reasoning and isinstance(raw.get("reasoning"), str):  # another server's spelling
                reasoning = raw["reasoning"]
            if reasoning:
                msg["reasoning_content"] = reasoning
            calls = parse_tool_calls(raw.get("tool_calls"), where + "tool_calls")
            if calls:
                msg["tool_calls"] = calls
                call_names.update((c["id"], c["function"]["name"]) for c in calls)
        elif role == "tool":
            call_id = field_of(raw, "tool_call_id", str, where=where)
            if call_id is None:
                raise bad_field("tool_call_id", "is required on a tool message", where)
            msg["tool_call_id"] = call_id
            name = field_of(raw, "name", str, where=where) or call_names.get(call_id)
            if name:
                msg["name"] = name
        elif role == "function":  # the pre-tools spelling of a tool result
            msg["name"] = field_of(raw, "name", str, "", where=where)
        out.append(msg)
    return out


def content_text(value: Any, where: str) -> str:
    """Message content (a string, null, or an array of parts) → text; media parts → 400 text only."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(where, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_field(f"{where}[{j}]", "must be a content part object")
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            raise bad_field(f"{where}[{j}]", f"is an {kind} part: {TEXT_ONLY}")
        if kind not in _TEXT_PARTS:
            raise bad_field(f"{where}[{j}].type", f"must be 'text', not {show_value(kind)}")
        text = part.get(kind if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_field(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def parse_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (arguments as a JSON string or an object)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_field(where, "must be an array")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]."
        if not isinstance(call, dict):
            raise bad_field(f"{where}[{j}]", "must be an object")
        fn = field_of(call, "function", dict, where=at)
        if fn is None:
            raise bad_field("function", "is required", at)
        name = field_of(fn, "name", str, where=at + "function.")
        if not name:
            raise bad_field("function.name", "is required", at)
        arguments = field_of(fn, "arguments", (str, dict), "{}", where=at + "function.")
        call_id = field_of(call, "id", str, where=at) or f"call_{j}"
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def parse_tools(value: Any) -> list[dict]:
    """`tools`: only `{"type": "function", "function": {name, description?, parameters?}}`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_field("tools", "must be an array")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]."
        if not isinstance(tool, dict):
            raise bad_field(f"tools[{i}]", "must be an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise bad_field("type", f"must be 'function', not {show_value(kind)}", where)
        fn = field_of(tool, "function", dict, where=where)
        if fn is None:
            raise bad_field("function", "is required", where)
        name = field_of(fn, "name", str, where=where + "function.")
        if not name:
            raise bad_field("function.name", "is required", where)
        spec: dict[str, Any] = {"name": name}
        description = field_of(fn, "description", str, where=where + "function.")
        if description:
            spec["description"] = description
        spec["parameters"] = field_of(fn, "parameters", dict, {"type": "object", "properties": {}},
                                      where=where + "function.")
        tools.append({"type": "function", "function": spec})
    return tools


def parse_tool_choice(value: Any, tools: list[dict]) -> Any:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name"}} → ChatRequest.tool_choice."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad_field("tool_choice", f"must be 'auto', 'none', 'required' or a function, not {show_value(value)}")
        if value == "required" and not tools:
            raise bad_field("tool_choice", "is 'required' but no tools are declared")
        return value
    if not isinstance(value, dict):
        raise bad_field("tool_choice", "must be a string or an object")
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else value.get("name")  # the Responses spelling, flat
    if value.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise bad_field("tool_choice", 'must look like {"type": "function", "function": {"name": "..."}}')
    if not any(t["function"]["name"] == name for t in tools):
        raise bad_field("tool_choice", f"names {show_value(name)}, which is not among the declared tools")
    return {"name": name}


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = field_of(body, name, int)
        if value is not None:
            if value < 1:
                raise bad_field(name, "must be at least 1")
            return value
    return None


def _parse_reasoning(body: dict, req: ChatRequest) -> None:
    """`reasoning_effort`, `reasoning: {effort}` and `chat_template_kwargs` (incl. enable_thinking)."""
    effort, name = field_of(body, "reasoning_effort", str), "reasoning_effort"
    reasoning = field_of(body, "reasoning", dict)
    if effort is None and reasoning is not None:
        effort, name = field_of(reasoning, "effort", str, where="reasoning."), "reasoning.effort"
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad_field(name, f"must be one of {', '.join(_EFFORTS)}, not {show_value(effort)}")
        req.reasoning_effort = _EFFORTS[effort]
        if effort == "none":
            req.enable_thinking = False
    kwargs = dict(field_of(body, "chat_template_kwargs", dict, {}))
    if effort in ("low", "medium", "high"):
        kwargs.setdefault("reasoning_effort", effort)  # templates with effort levels read it (gpt-oss)
    for key in _RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad_field(f"chat_template_kwargs.{key}", "is set by the server and cannot be overridden")
    if "enable_thinking" in kwargs:
        enable = kwargs.pop("enable_thinking")
        if not isinstance(enable, bool):
            raise bad_field("chat_template_kwargs.enable_thinking", "must be a boolean")
        req.enable_thinking = enable
    req.template_kwargs = kwargs


# ----- rendering (pure) ------------------------------------------------------------------------------------------

# Finish reasons the OpenAI wire format knows; cancelled and error become error objects instead.
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def finish_reason(fin: Finish) -> str:
    """The OpenAI finish_reason for a Finish (a matched stop string is "stop", as OpenAI reports it)."""
    return _FINISH.get(fin.reason, "stop")


def finish_error(fin: Finish) -> HttpError | None:
    """The error to report instead of a result when the generation did not finish normally."""
    if fin.reason == "cancelled":
        return HttpError(503, "the generation was cancelled before it finished (server shutting down?); retry",
                         "overloaded_error", headers={"Retry-After": "1"})
    if fin.reason == "error":
        return HttpError(500, "the generation failed inside the engine; see the server log", "server_error")
    return None


def usage_dict(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


DONE = "[DONE]"
"""The last SSE frame of every OpenAI stream."""


class Renderer:
    """Events of one request → OpenAI wire objects. Pure: no I/O, so every event sequence can be unit-tested.

    `frames(ev, usage)` is everything the stream sends for one event; `response(...)`
    is the whole non-streaming body. Subclasses say what a chunk looks like.
    """

    path = "/v1/chat/completions"  # the dialect of the error objects sent inside a stream
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, logprobs: LogprobFormatter | None = None, *, completion_id: str | None = None,
                 created: int | None = None) -> None:
        self.id = completion_id or self.id_prefix + secrets.token_hex(12)
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.lp = logprobs

    def start(self) -> list[dict | str]:
        """The frames sent before any event."""
        return []

    def chunk(self, ev: Event, logprobs: list[TokenLogprobs] | None = None) -> dict | None:
        """The chunk for one event, None when it has nothing to say (ToolCallEnd, an empty delta)."""
        raise NotImplementedError

    def finish(self, fin: Finish, logprobs: list[TokenLogprobs] | None = None) -> dict:
        """The last chunk, carrying finish_reason."""
        raise NotImplementedError

    def usage(self, usage: Usage) -> dict:
        """The usage chunk, `choices: []` (always sent: stream_options is ignored)."""
        raise NotImplementedError

    def response(self, events: list[Event], fin: Finish, usage: Usage,
                 logprobs: list[TokenLogprobs] | None = None) -> dict:
        """The whole non-streaming body."""
        raise NotImplementedError

    def frames(self, ev: Event, usage: Usage, logprobs: list[TokenLogprobs] | None = None) -> list[dict | str]:
        """Everything to send for one event; at the Finish: the last chunk, the usage chunk, [DONE]."""
        if not isinstance(ev, Finish):
            chunk = self.chunk(ev, logprobs)
            return [chunk] if chunk is not None else []
        error = finish_error(ev)
        if error is not None:
            return self.error(error)
        return [self.finish(ev, logprobs), self.usage(usage), DONE]

    def error(self, error: HttpError) -> list[dict | str]:
        """An error after the stream started: the OpenAI error object as a data frame, then [DONE]."""
        return [error_body(self.path, error.status, error.message, error.type), DONE]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class ChatRenderer(Renderer):
    """`chat.completion` and `chat.completion.chunk` objects."""

    def __init__(self, model: str, logprobs: LogprobFormatter | None = None, **kw: Any) -> None:
        super().__init__(model, logprobs, **kw)
        self._indexes: dict[int, int] = {}  # event call index → OpenAI tool_calls index

    def _chunk(self, delta: dict, finish: str | None = None, logprobs: list[TokenLogprobs] | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def start(self) -> list[dict | str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def chunk(self, ev: Event, logprobs: list[TokenLogprobs] | None = None) -> dict | None:
        if isinstance(ev, TextDelta) and ev.text:
            return self._chunk({"content": ev.text}, logprobs=logprobs)
        if isinstance(ev, ReasoningDelta) and ev.text:
            return self._chunk({"reasoning_content": ev.text}, logprobs=logprobs)
        if isinstance(ev, ToolCallStart):
            call = {"index": self._index(ev.index), "id": ev.call_id, "type": "function",
                    "function": {"name": ev.name, "arguments": ""}}
            return self._chunk({"tool_calls": [call]}, logprobs=logprobs)
        if isinstance(ev, ToolCallArgsDelta) and ev.text:
            # continuation: index and the piece only; id, type and name are left out, never null
            call = {"index": self._index(ev.index), "function": {"arguments": ev.text}}
            return self._chunk({"tool_calls": [call]}, logprobs=logprobs)
        return None

    def finish(self, fin: Finish, logprobs: list[TokenLogprobs] | None = None) -> dict:
        return self._chunk({}, finish_reason(fin), logprobs)

    def usage(self, usage: Usage) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage_dict(usage),
                "timings": usage.timings}

    def response(self, events: list[Event], fin: Finish, usage: Usage,
                 logprobs: list[TokenLogprobs] | None = None) -> dict:
        text = "".join(ev.text for ev in events if isinstance(ev, TextDelta))
        reasoning = "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta))
        calls = [{"id": ev.call_id, "type": "function", "function": {"name": ev.name, "arguments": ev.arguments}}
                 for ev in events if isinstance(ev, ToolCallEnd)]
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not text else text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason(fin)}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage_dict(usage),
                "timings": usage.timings}

    def _index(self, event_index: int) -> int:
        return self._indexes.setdefault(event_index, len(self._indexes))

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        if self.lp is None or entries is None:
            return None
        return {"content": self.lp.chat(entries)}


class TextRenderer(Renderer):
    """Legacy `text_completion` objects (streamed or whole)."""

    path = "/v1/completions"
    id_prefix = "cmpl-"

    def __init__(self, model: str, logprobs: LogprobFormatter | None = None, **kw: Any) -> None:
        super().__init__(model, logprobs, **kw)
        self._offset = 0  # text_offset of the next logprob token, counted across chunks

    def _object(self, text: str, finish: str | None, logprobs: list[TokenLogprobs] | None) -> dict:
        choice = {"text": text, "index": 0, "logprobs": self._logprobs(logprobs), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def chunk(self, ev: Event, logprobs: list[TokenLogprobs] | None = None) -> dict | None:
        if isinstance(ev, TextDelta) and ev.text:
            return self._object(ev.text, None, logprobs)
        return None  # no tools and no reasoning without a chat template

    def finish(self, fin: Finish, logprobs: list[TokenLogprobs] | None = None) -> dict:
        return self._object("", finish_reason(fin), logprobs)

    def usage(self, usage: Usage) -> dict:
        return {**self._head("text_completion"), "choices": [], "usage": usage_dict(usage), "timings": usage.timings}

    def response(self, events: list[Event], fin: Finish, usage: Usage,
                 logprobs: list[TokenLogprobs] | None = None) -> dict:
        text = "".join(ev.text for ev in events if isinstance(ev, TextDelta))
        return {**self._object(text, finish_reason(fin), logprobs), "usage": usage_dict(usage),
                "timings": usage.timings}

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        if self.lp is None or entries is None:
            return None
        out = self.lp.legacy(entries, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out


# ----- logprobs ---------------------------------------------------------------------------------------------------


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary spells each byte with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class LogprobFormatter:
    """TokenLogprobs → OpenAI logprob objects; token text and UTF-8 bytes come from the tokenizer.

    End-of-turn tokens are left out (OpenAI never reports the stop token). A
    token that is only part of a UTF-8 character (byte-level BPE, byte fallback)
    reports its raw bytes, so clients can join `bytes` into the exact text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, i: int) -> tuple[str, list[int]]:
        hit = self._cache.get(i)
        if hit is None:
            text = self.tok.decode([i])
            raw = text.encode("utf-8")
            if "\ufffd" in text:
                spelled = self.tok.id_to_token(i) or ""
                byte = _BYTE_TOKEN.fullmatch(spelled)
                decoder = _byte_decoder()
                if byte:
                    raw = bytes([int(byte.group(1), 16)])
                elif spelled and all(c in decoder for c in spelled):
                    raw = bytes(decoder[c] for c in spelled)
            hit = self._cache[i] = (text, list(raw))
        return hit

    def _kept(self, entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
        return [e for e in entries if e.token_id not in self.tok.eos_ids]

    def chat(self, entries: list[TokenLogprobs]) -> list[dict]:
        out = []
        for e in self._kept(entries):
            text, raw = self.token(e.token_id)
            top = [{"token": self.token(t)[0], "logprob": lp, "bytes": self.token(t)[1]} for t, lp in e.top]
            out.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
        return out

    def legacy(self, entries: list[TokenLogprobs], offset: int = 0) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for e in self._kept(entries):
            text = self.token(e.token_id)[0]
            tokens.append(text)
            values.append(e.logprob)
            tops.append({self.token(t)[0]: lp for t, lp in e.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# ----- handlers ---------------------------------------------------------------------------------------------------


def register(router: Router, ctx: ServerContext) -> None:
    async def chat(request: Request, response: Response) -> None:
        await chat_completions(ctx, request, response)

    async def legacy(request: Request, response: Response) -> None:
        await completions(ctx, request, response)

    router.add("POST", "/v1/chat/completions", chat)
    router.add("POST", "/v1/completions", legacy)


async def chat_completions(ctx: ServerContext, request: Request, response: Response) -> None:
    req = parse_chat(request.json(), ctx)
    await _serve(ctx, request, response, req, ChatRenderer)


async def completions(ctx: ServerContext, request: Request, response: Response) -> None:
    req = parse_completion(request.json(), ctx)
    await _serve(ctx, request, response, req, TextRenderer)


async def _serve(ctx: ServerContext, request: Request, response: Response, req: ChatRequest,
                 make_renderer: type[Renderer]) -> None:
    """Run one generation and write it in the renderer's shape, streamed or whole."""
    run = await GenerationRun.start(ctx, req, request.disconnected)
    lp = LogprobFormatter(ctx.ready()[1].tokenizer) if req.params.logprobs is not None else None
    renderer = make_renderer(req.model, lp)
    if not req.stream:
        events, fin = await run.collect()
        _log(request, run, fin)
        error = finish_error(fin)
        if error is not None:
            raise error
        await response.send_json(200, renderer.response(events, fin, run.usage, run.logprobs if lp else None))
        return

    await response.start_stream()
    sent = 0  # run.logprobs entries already sent

    def new_logprobs(ev: Event) -> list[TokenLogprobs] | None:
        nonlocal sent
        if lp is None or not isinstance(ev, (TextDelta, ReasoningDelta, Finish)):
            return None
        fresh = run.logprobs[sent:]
        sent += len(fresh)
        return fresh

    try:
        await _send_frames(response, renderer.start())
        async with aclosing(run.events()) as events:
            async for ev in events:
                if isinstance(ev, Finish):
                    _log(request, run, ev)
                await _send_frames(response, renderer.frames(ev, run.usage, new_logprobs(ev)))
    except Exception:  # a bug after the stream started: the status line is gone, say it in the stream
        log_failure(log, "generation failed mid-stream: %s %s", request.method, request.path)
        await _send_frames(response, renderer.error(HttpError(500, "Internal server error; see the server log.",
                                                              "server_error")))
    await response.end()


async def _send_frames(response: Response, frames: list[dict | str]) -> None:
    for frame in frames:
        await response.send_event(frame if isinstance(frame, str) else orjson.dumps(frame))


def _log(request: Request, run: GenerationRun, fin: Finish) -> None:
    request.log_fields.update(run.usage.log_fields(), finish=fin.reason)
