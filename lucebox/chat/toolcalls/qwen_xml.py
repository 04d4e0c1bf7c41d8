"""Qwen3 / Qwen3-Coder XML calls: `<function=NAME>` then `<parameter=KEY>VALUE</parameter>`… `</function>`.

Written with or without a `<tool_call>` wrapper. Values are converted with the
tool's schema (schema.convert_param); a string parameter streams its text
while the model writes it, every other parameter is emitted once finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lucebox.chat.toolcalls.reader import AGAIN, MAX_NAME, Fail, Reader, Tags, dumps, skip_ws
from lucebox.chat.toolcalls.schema import convert_param, is_plain_string, param_schema

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser


class XmlCall(Reader):
    """`NAME>` then `<parameter=KEY>VALUE</parameter>`… `</function>` (raw starts after `<function=`)."""

    INITIAL = ("name",)
    TRANSITIONS = {
        "name": ("params",),              # the function name is read and declared
        "params": ("value", "after"),     # `<parameter=KEY>` opens a value; `</function>` ends the call
        "value": ("params",),             # the value's terminator is seen
        "after": ("name",),               # another `<function=` inside the same wrapper
    }
    _TERMS = ("</parameter>", "<parameter=", "</function>")

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.terms = self._TERMS + ((close,) if close else ())
        self.term_tags = Tags(self.terms)
        self.nparams = 0
        self.streamed: int | None = None  # raw index up to which a string value has been streamed

    def _read_name(self, at: int, final: bool) -> tuple[str, int] | None:
        """`NAME>` at raw[at]: (name, index after `>`), None to wait; Fail if it is no name."""
        j = self.raw.find(">", at)
        if j < 0:
            tail = self.raw[at:]
            if len(tail) > MAX_NAME or "\n" in tail or "<" in tail:
                raise Fail
            self.need(final)
            return None
        name = self.raw[at:j].strip()
        if not name or "\n" in name or "<" in name:
            raise Fail
        return name, j + 1

    def _name(self, final: bool) -> Any:
        got = self._read_name(self.i, final)
        if got is None:
            return None
        name, self.i = got
        if name not in self.p.tools:
            raise Fail
        self.start_call(name)
        self.nparams = 0
        self.goto("params")
        return AGAIN

    def _params(self, final: bool) -> Any:
        raw = self.raw
        self.i = i = skip_ws(raw, self.i)
        if raw.startswith("<parameter=", i):
            got = self._read_name(i + len("<parameter="), final)
            if got is None:
                return None
            self.key, self.i = got
            self.param_start = i
            self.schema = param_schema(self.p.tools[self.call[2]], self.key)
            self.vstart = self.scan_from = self.i
            self.streamed = None
            if is_plain_string(self.schema):
                self.emit_args(self._member_prefix() + '"')
                self.streamed = self.vstart
            self.goto("value")
            return AGAIN
        if raw.startswith("</function>", i):
            self.i = i + len("</function>")
            self._finish_call()
            self.goto("after")
            return AGAIN
        if self.close and raw.startswith(self.close, i):  # `</function>` missing: the wrapper ends the call
            self.i = i + len(self.close)
            self._finish_call()
            return "done", raw[self.i:]
        tail = raw[i:]
        if not final and any(t.startswith(tail) for t in ("<parameter=", "</function>", self.close or "")):
            return None
        raise Fail

    def _value(self, final: bool) -> Any:
        raw = self.raw
        k, term = -1, ""
        for t in self.terms:
            j = raw.find(t, self.scan_from)
            if j >= 0 and (k < 0 or j < k):
                k, term = j, t
        if k < 0:
            self.need(final)
            self.scan_from = max(self.vstart, len(raw) - self.term_tags.longest + 1)
            if self.streamed is not None:
                self._stream(len(raw) - self.term_tags.partial_suffix(raw), hold_newline=True)
            return None
        start = self.vstart + 1 if raw.startswith("\n", self.vstart) else self.vstart
        end = k - 1 if k - 1 >= start and raw[k - 1] == "\n" else k
        if self.streamed is not None:
            self._stream(end, hold_newline=False)
            self.emit_args('"')
        else:
            value = convert_param(raw[start:end], self.schema)
            self.emit_args(self._member_prefix() + dumps(value))
        self.nparams += 1
        self.streamed = None
        self.i = k + len(term) if term == "</parameter>" else k
        self.goto("params")
        return AGAIN

    def _stream(self, upto: int, hold_newline: bool) -> None:
        """Emit the string value's text up to `upto` (JSON-escaped, so pieces concatenate).

        The newline right after `<parameter=K>` is not part of the value; one right
        before `</parameter>` is not either, so a trailing newline waits.
        """
        raw = self.raw
        if self.streamed == self.vstart:
            if len(raw) == self.vstart:
                return
            if raw[self.vstart] == "\n":
                self.streamed += 1
        if hold_newline and upto > self.streamed and raw[upto - 1] == "\n":
            upto -= 1
        if upto > self.streamed:
            self.emit_args(dumps(raw[self.streamed:upto])[1:-1])
            self.streamed = upto

    def _after(self, final: bool) -> Any:
        if self.close is None:
            return "done", self.raw[self.i:]
        j = skip_ws(self.raw, self.i)
        if self.raw.startswith("<function=", j):  # several functions in one wrapper
            self.i = j + len("<function=")
            self.goto("name")
            return AGAIN
        if not final and "<function=".startswith(self.raw[j:]):
            return None
        return self.closing(final)

    def _member_prefix(self) -> str:
        return ("{" if self.nparams == 0 else ", ") + dumps(self.key) + ": "

    def _finish_call(self) -> None:
        self.emit_args("}" if self.nparams else "{}")
        self.end_call()

    def repair(self) -> tuple[str, int]:
        if self.state == "value" and self.streamed is not None:
            return '"}', self.streamed
        at = self.param_start if self.state == "value" else self.i
        return ("}" if self.nparams else "{}"), at

