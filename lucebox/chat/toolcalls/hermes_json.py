"""JSON calls: Hermes `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, and bare JSON calls.

A bare JSON call object (or a JSON list of them) counts only when it opens the
answer. `"parameters"` is accepted for `"arguments"`, and arguments given as a
JSON string are decoded. The arguments stream as the model's own text, cut
only where json_scan says the prefix can still be closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lucebox.chat.toolcalls.json_scan import JsonScan
from lucebox.chat.toolcalls.reader import AGAIN, Fail, Reader, loads, skip_ws

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser


class JsonCall(Reader):
    """`{"name": …, "arguments": {…}}` or a list of them; raw[i] is the `{` or `[`.

    With `opened`, the marker itself was the opening bracket (a bare call at the
    start of the answer) and raw starts after it.
    """

    INITIAL = ("open", "member", "elem")
    TRANSITIONS = {
        "open": ("elem", "member"),       # `[` opens a list of calls, `{` one call
        "elem": ("member",),              # a list element's `{`
        "member": ("key",),               # a member's opening quote
        "key": ("colon",),
        "colon": ("value",),
        "value": ("name", "args", "args_string", "skip"),  # by the key: name, arguments (object or string), other
        "name": ("after",),
        "args": ("after",),
        "args_string": ("after",),
        "skip": ("after",),
        "after": ("member", "next", "end"),  # `,` another member; `}` ends the call (in a list, or not)
        "next": ("elem", "end"),          # `,` another call of the list; `]` ends it
        "end": (),                        # the region's closing tag (Reader.closing)
    }

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None,
                 opened: str | None = None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.in_list = opened == "["
        self.state = {"{": "member", "[": "elem"}.get(opened or "", "open")
        self.scan: JsonScan | None = None
        self._new_object()

    def _new_object(self) -> None:
        self.name: str | None = None
        self.key = ""
        self.args_seen = False
        self.args_text: str | None = None  # arguments read before the name was known
        self.args_start = -1
        self.streaming = False

    def _char(self, final: bool) -> str | None:
        self.i = skip_ws(self.raw, self.i)
        if self.i < len(self.raw):
            return self.raw[self.i]
        self.need(final)
        return None

    def _scan_value(self, final: bool) -> str | None:
        """Continue reading the JSON value at `self.vstart`; its raw text once complete."""
        if self.scan is None:
            self.scan, self.vstart, self.fed = JsonScan(), self.i, self.i
        self.fed += self.scan.feed(self.raw[self.fed:])
        if self.scan.error:
            raise Fail
        if not self.scan.done:
            self.need(final)
            return None
        self.scan = None
        self.i = self.fed
        return self.raw[self.vstart:self.fed]

    def _open(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        self.i += 1
        if c == "[" and not self.in_list:
            self.in_list = True
            self.goto("elem")
        elif c == "{":
            self.goto("member")
        else:
            raise Fail
        return AGAIN

    def _elem(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != "{":
            raise Fail
        self.i += 1
        self._new_object()
        self.goto("member")
        return AGAIN

    def _member(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != '"':
            raise Fail
        self.goto("key")
        return AGAIN

    def _key(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        self.key = loads(text)
        if self.call is None and self.key not in ("name", "arguments", "parameters"):
            raise Fail  # not a call object (or not one we can read)
        self.goto("colon")
        return AGAIN

    def _colon(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != ":":
            raise Fail
        self.i += 1
        self.goto("value")
        return AGAIN

    def _value(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if self.key == "name" and self.name is None:
            if c != '"':
                raise Fail
            self.goto("name")
        elif self.key in ("arguments", "parameters") and not self.args_seen:
            if c == "{":
                self.args_start = self.i
                self.streaming = self.call is not None
                self.goto("args")
            elif c == '"':
                self.goto("args_string")
            else:
                raise Fail
        else:
            self.goto("skip")
        return AGAIN

    def _name(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        name = loads(text)
        if name not in self.p.tools:
            raise Fail
        self.name = name
        self.start_call(name)
        if self.args_text is not None:
            self.emit_args(self.args_text)
        self.goto("after")
        return AGAIN

    def _args(self, final: bool) -> Any:
        text = self._scan_value(final)
        if self.streaming:  # emit up to the last point where the text so far can be closed
            safe = len(text) if text is not None else self.scan.safe
            self.emit_args(self.raw[self.args_start + self.args_len:self.args_start + safe])
        if text is None:
            return None
        self.args_seen = True
        if not self.streaming:
            self.args_text = text
        self.goto("after")
        return AGAIN

    def _args_string(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        inner = loads(text).strip()
        if not isinstance(loads(inner), dict):
            raise Fail
        self.args_seen = True
        if self.call is not None:
            self.emit_args(inner)
        else:
            self.args_text = inner
        self.goto("after")
        return AGAIN

    def _skip(self, final: bool) -> Any:
        if self._scan_value(final) is None:
            return None
        self.goto("after")
        return AGAIN

    def _after(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        self.i += 1
        if c == ",":
            self.goto("member")
            return AGAIN
        if c != "}" or self.call is None:
            self.i -= 1
            raise Fail
        if not self.args_seen:
            self.emit_args("{}")
        self.end_call()
        self.goto("next" if self.in_list else "end")
        return AGAIN

    def _next(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c == ",":
            self.i += 1
            self.goto("elem")
            return AGAIN
        if c != "]":
            raise Fail
        self.i += 1
        self.represented = self.i
        self.goto("end")
        return AGAIN

    def _end(self, final: bool) -> Any:
        return self.closing(final)

    def repair(self) -> tuple[str, int]:
        if self.state == "args" and self.streaming and self.scan is not None:
            safe = self.args_start + self.scan.safe
            return self.raw[self.args_start + self.args_len:safe] + self.scan.safe_closer, safe
        return ("" if self.args_len else "{}"), self.i

