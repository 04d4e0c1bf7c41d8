"""Gemma calls: `call:NAME{key:value,…}`, bare or in FunctionGemma / Gemma 4 wrappers.

FunctionGemma wraps the call in `<start_function_call>` … `<end_function_call>`
and delimits strings with `<escape>`; Gemma 4 writes
`<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>`. Values are converted
with the tool's schema; one arguments piece is emitted per finished parameter.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from lucebox.chat.toolcalls.reader import AGAIN, MAX_NAME, Fail, Reader, dumps, skip_ws
from lucebox.chat.toolcalls.schema import best_effort, convert_param, param_schema

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser


_GEMMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_ESCAPES = ("<escape>", '<|"|>')  # string delimiters: FunctionGemma, Gemma 4


def _escape_at(s: str, i: int) -> str | None:
    """The string delimiter starting at s[i], if any."""
    for d in _ESCAPES:
        if s.startswith(d, i):
            return d
    return None


def _gemma_value_end(raw: str, j: int) -> int | None:
    """End index of the Gemma value starting at raw[j], or None if it is not complete yet."""
    d = _escape_at(raw, j)
    if d:
        k = raw.find(d, j + len(d))
        return None if k < 0 else k + len(d)
    if raw[j] in "{[":
        depth, k = 0, j
        while k < len(raw):
            d = _escape_at(raw, k)
            if d:
                e = raw.find(d, k + len(d))
                if e < 0:
                    return None
                k = e + len(d)
                continue
            c = raw[k]
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return k + 1
            k += 1
        return None
    ends = [k for k in (raw.find(",", j), raw.find("}", j)) if k >= 0]
    return min(ends) if ends else None


def _gemma_parse(text: str) -> Any:
    """Parse one complete Gemma value: an escaped string, {k:v,…}, […] or a bare token."""
    try:
        return _gemma_parse_at(text.strip(), 0)[0]
    except RecursionError as e:  # the model nested deeper than the parser follows: not a call
        raise Fail from e


def _gemma_parse_at(s: str, i: int) -> tuple[Any, int]:
    i = skip_ws(s, i)
    d = _escape_at(s, i)
    if d:
        k = s.find(d, i + len(d))
        if k < 0:
            raise Fail
        return s[i + len(d):k], k + len(d)
    if i < len(s) and s[i] in "{[":
        close = "}" if s[i] == "{" else "]"
        obj: Any = {} if close == "}" else []
        i = skip_ws(s, i + 1)
        while i < len(s) and s[i] != close:
            if close == "}":
                colon = s.find(":", i)
                if colon < 0:
                    raise Fail
                key = s[i:colon].strip().strip('"')
                value, i = _gemma_parse_at(s, colon + 1)
                obj[key] = value
            else:
                value, j = _gemma_parse_at(s, i)
                if j == i:
                    raise Fail  # a stray closing bracket: no progress possible
                i = j
                obj.append(value)
            i = skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i = skip_ws(s, i + 1)
        if i >= len(s):
            raise Fail
        return obj, i + 1
    k = i
    while k < len(s) and s[k] not in ",}]":
        k += 1
    return best_effort(s[i:k].strip()), k


class GemmaCall(Reader):
    """`NAME{key:value,…}` (raw starts after `call:`); strings between `<escape>` (or `<|"|>`) delimiters."""

    INITIAL = ("name",)
    TRANSITIONS = {
        "name": ("member",),   # NAME{ of a declared tool
        "member": ("end",),    # `}` after the last key:value
        "end": (),             # the region's closing tag (Reader.closing)
    }

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.nparams = 0

    def _name(self, final: bool) -> Any:
        m = _GEMMA_NAME.match(self.raw, self.i)
        if not m or m.end() == len(self.raw):
            if (m and len(m.group()) > MAX_NAME) or (not m and self.i < len(self.raw)):
                raise Fail
            self.need(final)
            return None
        if self.raw[m.end()] != "{" or m.group() not in self.p.tools:
            raise Fail
        self.start_call(m.group())
        self.i = m.end() + 1
        self.goto("member")
        return AGAIN

    def _member(self, final: bool) -> Any:
        raw = self.raw
        i = skip_ws(raw, self.i)
        if i >= len(raw):
            self.need(final)
            return None
        if raw[i] == "}":
            self.i = i + 1
            self.emit_args("}" if self.nparams else "{}")
            self.end_call()
            self.goto("end")
            return AGAIN
        if self.nparams and raw[i] == ",":
            i = skip_ws(raw, i + 1)
        colon = raw.find(":", i)
        if colon < 0 or any(c in raw[i:colon] for c in "{},<"):
            if colon >= 0 or len(raw) - i > MAX_NAME or any(c in raw[i:] for c in "{}<"):
                raise Fail
            self.need(final)
            return None
        key = raw[i:colon].strip().strip('"')
        j = skip_ws(raw, colon + 1)
        end = _gemma_value_end(raw, j) if j < len(raw) else None
        if end is None:
            self.need(final)
            return None
        text = raw[j:end]
        schema = param_schema(self.p.tools[self.call[2]], key)
        d = _escape_at(text, 0)
        if d or text[:1] not in ("{", "["):
            inner = text[len(d):-len(d)] if d else text.strip()
            if inner[:1] == '"':  # a JSON-quoted value (the <escape> tokens were not shown)
                try:
                    inner = str(json.loads(inner))
                except ValueError:
                    pass
            value = convert_param(inner, schema)
        else:
            value = _gemma_parse(text)
        self.emit_args(("{" if self.nparams == 0 else ", ") + dumps(key) + ": " + dumps(value))
        self.nparams += 1
        self.i = end
        return AGAIN

    def _end(self, final: bool) -> Any:
        return self.closing(final)

