"""The request in dialect-neutral form, and the 400 that names a bad field of it.

Each API dialect parses its JSON body into a `ChatRequest`; the chat layer
(chat/run.py) renders, checks and runs it. Both report a bad value the same
way: `bad_field`, a 400 naming the field, with the value shown by
`show_value`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.http import HttpError


@dataclass
class ChatRequest:
    """One request in dialect-neutral form."""

    messages: list[dict] = field(default_factory=list)  # Hugging Face chat-template messages
    prompt: str | list[int] | None = None  # legacy completions: raw text or ids, no template
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | {"name": ...}
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    thinking_budget: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    # The answer's format (chat/constrain.py): None (free text), {"type": "json_object"} or {"type": "json_schema",
    # "schema": {...}}; "param" names the request field, for errors.
    output_format: dict | None = None
    parallel_tool_calls: bool = True  # several calls in one answer (OpenAI parallel_tool_calls, Anthropic's
    # disable_parallel_tool_use)


def bad_field(name: str, problem: str, where: str = "") -> HttpError:
    return HttpError(400, f"'{where}{name}' {problem}", "invalid_request_error", param=f"{where}{name}")


def json_type(value: Any) -> str:
    """What a JSON value is, in words ("a string", "an array", ...), for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def show_value(value: Any) -> str:
    """A request value as the error message shows it: short, in JSON spelling, never a Python repr."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:g}"
    if isinstance(value, int):
        return str(value) if abs(value) < 10**30 else f"{float(value):g}"
    if isinstance(value, str):
        return json.dumps(value[:40] + ("..." if len(value) > 40 else ""), ensure_ascii=False)
    return json_type(value)


def output_format(kind: Any, schema: Any, type_param: str, schema_param: str, strict: Any = None) -> dict | None:
    """A dialect's answer format -> ChatRequest.output_format: "text" (free) | "json_object" | "json_schema"
    (with an object `schema`; `strict`: its objects take no unlisted keys); a 400 naming the field
    (`type_param`, `schema_param`) otherwise."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object", "param": type_param}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_field(schema_param, f"must be a JSON schema object, not {json_type(schema)}")
        return {"type": "json_schema", "schema": schema, "param": schema_param, "strict": strict is True}
    raise bad_field(type_param, f"must be text, json_object or json_schema, not {show_value(kind)}")
