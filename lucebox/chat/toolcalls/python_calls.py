"""Python-style calls: `get_weather(city="Paris")` in `<tool_code>` or a ```tool_code fence, and Gemma 3's list.

Google's Gemma function-calling guide has the model write calls as Python,
one per line or as a list, inside `<tool_code>`; Gemma 3's documented prompt
format is a bare list `[get_weather(city="Paris"), …]` opening the answer.
Keyword arguments with literal values only; the calls are emitted whole once
the body has been read.
"""

from __future__ import annotations

import ast
import json
from typing import TYPE_CHECKING, Any

from lucebox.chat.toolcalls.reader import MAX_BUFFERED, Fail, Reader, dumps

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser


def _python_calls(body: str, tools: dict[str, dict]) -> list[tuple[str, dict]] | None:
    """Calls written as Python, `f(a=1)` one per line or `[f(a=1), g()]`; keyword literals only.

    None when `body` is not valid Python (it may be incomplete); Fail when it is
    valid Python but not only calls of declared tools.
    """
    try:
        tree = ast.parse(body.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes: list[ast.expr] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise Fail
        value = stmt.value
        nodes.extend(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            raise Fail
        if node.func.id not in tools:
            raise Fail
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise Fail
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
                raise Fail from e
        try:
            json.dumps(args)
        except (TypeError, ValueError) as e:
            raise Fail from e  # sets, bytes, complex numbers: not JSON
        calls.append((node.func.id, args))
    if not calls:
        raise Fail
    return calls


class PythonCalls(Reader):
    """Python-style calls, read whole and then emitted.

    Inside `<tool_code>` or a ```tool_code fence the body ends at the closing tag.
    Without a closing tag (`close=None`) the body is Gemma 3's documented list
    `[get_weather(city="Paris"), …]` at the start of the answer; raw starts after
    its `[` and it ends at the first `]` that completes valid Python.
    """

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.scan_from = i

    def _start(self, final: bool) -> Any:
        end = self.close or "]"
        while True:
            k = self.raw.find(end, self.scan_from)
            if k < 0:
                if len(self.raw) - self.i > MAX_BUFFERED:
                    raise Fail
                self.need(final)
                self.scan_from = max(self.i, len(self.raw) - len(end) + 1)
                return None
            self.scan_from = k + 1
            if self.close:
                calls = _python_calls(self.raw[self.i:k], self.p.tools)
                if calls is None:
                    raise Fail
                break
            calls = _python_calls("[" + self.raw[self.i:k + 1], self.p.tools)
            if calls is not None:
                break
        self.i = k + len(end)
        for name, args in calls:
            self.start_call(name)
            self.emit_args(dumps(args))
            self.end_call()
        return "done", self.raw[self.i:]

