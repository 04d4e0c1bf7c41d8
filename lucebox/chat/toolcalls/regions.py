"""Where a call region starts: the marker table, and the readers that only decide which format a region holds.

A region opens at a marker (`<tool_call>`, `<function=`, `call:`, …) or at a
`{` / `[` that opens the answer. `open_region` picks its first reader; a
wrapper (or a bare list) looks at the body's first characters and hands over
("become") to the reader of the call format it finds there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from lucebox.chat.toolcalls.gemma import GemmaCall
from lucebox.chat.toolcalls.hermes_json import JsonCall
from lucebox.chat.toolcalls.python_calls import PythonCalls
from lucebox.chat.toolcalls.qwen_xml import XmlCall
from lucebox.chat.toolcalls.reader import Fail, Reader, Tags, skip_ws

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser

# marker -> (closing tag, forms allowed inside); "<function=" and "call:" start a call directly.
WRAPPERS = {
    "<tool_call>": ("</tool_call>", ("xml", "json")),
    "<tool_code>": ("</tool_code>", ("json", "gemma", "python")),
    "```tool_code": ("```", ("json", "gemma", "python")),
    "<start_function_call>": ("<end_function_call>", ("gemma",)),
    "<|tool_call>": ("<tool_call|>", ("gemma",)),
}
MARKERS = tuple(WRAPPERS) + ("<function=", "call:")
MARKER_TAGS = Tags(MARKERS)
ANSWER_OPENERS = "{["  # a bare JSON call, a JSON list of calls or a Python list, only at the start of the answer


def open_region(parser: ToolCallParser, marker: str, raw: str) -> Reader:
    """The first reader of a region opened by `marker` (one of MARKERS or ANSWER_OPENERS); `raw` follows it."""
    if marker in WRAPPERS:
        close, forms = WRAPPERS[marker]
        return Wrapper(parser, marker, raw, close, forms)
    if marker == "<function=":
        return XmlCall(parser, marker, raw, 0, None)
    if marker == "call:":
        return GemmaCall(parser, marker, raw, 0, None)
    if marker == "{":
        return JsonCall(parser, marker, raw, 0, None, opened="{")
    if marker == "[":
        return BareList(parser, marker, raw)
    raise ValueError(f"no region opens with {marker!r}")


class Wrapper(Reader):
    """`<tool_call>`, `<tool_code>`, a ```tool_code fence or `<start_function_call>`: pick the body's form."""

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, close: str, forms: tuple[str, ...]) -> None:
        super().__init__(parser, marker, raw, 0, close)
        self.forms = forms

    def _start(self, final: bool) -> tuple[str, Any] | None:
        j = skip_ws(self.raw, 0)
        tail = self.raw[j:]
        p, close = self.p, self.close
        if "xml" in self.forms and tail.startswith("<function="):
            return "become", XmlCall(p, self.marker, self.raw, j + len("<function="), close)
        if "gemma" in self.forms and tail.startswith("call:"):
            return "become", GemmaCall(p, self.marker, self.raw, j + len("call:"), close)
        first = tail[:1]
        if first == "[":  # a JSON list of calls, or a Python list `[f(a=1), g()]`
            k = skip_ws(tail, 1)
            if k == len(tail):
                self.need(final)
                return None
            first = "{" if tail[k] == "{" else "p"
        if "json" in self.forms and first == "{":
            return "become", JsonCall(p, self.marker, self.raw, j, close)
        if not final and (not tail or any(pre.startswith(tail) for pre in ("<function=", "call:"))):
            return None
        if "python" in self.forms and tail and (first == "p" or first.isalpha() or first == "_"):
            return "become", PythonCalls(p, self.marker, self.raw, j, close)
        raise Fail



_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class BareList(Reader):
    """A `[` opening the answer: a JSON list of calls, or a Python list `[tool(…), …]` of declared tools."""

    def _start(self, final: bool) -> Any:
        j = skip_ws(self.raw, 0)
        if j == len(self.raw):
            self.need(final)
            return None
        if self.raw[j] == "{":
            return "become", JsonCall(self.p, self.marker, self.raw, 0, None, opened="[")
        m = _IDENT.match(self.raw, j)
        if not m or m.end() == len(self.raw):
            if m is None:
                raise Fail
            self.need(final)
            return None
        if self.raw[m.end()] != "(" or m.group() not in self.p.tools:
            raise Fail
        return "become", PythonCalls(self.p, self.marker, self.raw, 0, None)

