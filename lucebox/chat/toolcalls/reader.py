"""What every call format's reader shares: the Reader base class, its state-table check, and text helpers.

A reader owns one marked region of the answer (a call, or a wrapper holding
calls) and turns it into ToolCallStart / ToolCallArgsDelta / ToolCallEnd
events through the driver (`driver.ToolCallParser`). Each reader class is a
small state machine: `INITIAL` names the states it may start in and
`TRANSITIONS` maps each state to the states it may go to next; every change
goes through `goto`, which raises IllegalTransition for any other.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from lucebox.chat.events import ToolCallArgsDelta, ToolCallEnd

if TYPE_CHECKING:
    from lucebox.chat.toolcalls.driver import ToolCallParser

WS = " \t\r\n"
MAX_NAME = 256  # longest function/parameter name we wait for before deciding it is not one
MAX_BUFFERED = 1 << 20  # a body we must see whole before deciding (Python-style calls)


class Fail(Exception):
    """Internal signal: the text under the reader is not (or no longer) a well-formed call."""


class IllegalTransition(RuntimeError):
    """A state change the table does not list: a parser bug, or the caller pushing after finish()."""


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WS:
        i += 1
    return i


class Tags:
    """A set of tags, to find how much of a text's end could still grow into one of them."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self.longest = max(len(t) for t in tags)
        self.firsts = tuple({t[0] for t in tags})

    def partial_suffix(self, text: str, ok: Any = None) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a tag.

        `ok(tag, start)` may veto a candidate. This runs on every piece, so the
        candidates (a tag's first character near the end) are found with str.find.
        """
        start = max(0, len(text) - self.longest + 1)
        cands = []
        for c in self.firsts:
            j = text.find(c, start)
            while j >= 0:
                cands.append(j)
                j = text.find(c, j + 1)
        for j in sorted(cands):
            tail = text[j:]
            for t in self.tags:
                if len(t) > len(tail) and t.startswith(tail) and (ok is None or ok(t, j)):
                    return len(text) - j
        return 0


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def loads(text: str) -> Any:
    """json.loads for text the validator passed; anything it still rejects is not a call."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise Fail from e



AGAIN = object()  # a reader state changed: run the next state at once


class Reader:
    """Reads one marked region (a call or a wrapper holding calls) from `raw`.

    `raw` is everything after `marker`; the parser appends new text to it.
    `step(final)` runs the method `_<state>` of the current state; it returns
    None (need more text), ("become", reader) or ("done", rest), where `rest`
    is the text after the region, which goes back to the text scanner; or it
    raises Fail, which `fail()` turns into ("rescan", None) when nothing was
    committed (the marker is text after all) or ("rest", text the committed
    calls do not hold).
    """

    INITIAL: ClassVar[tuple[str, ...]] = ("start",)
    TRANSITIONS: ClassVar[dict[str, tuple[str, ...]]] = {"start": ()}

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int = 0, close: str | None = None) -> None:
        self.p = parser
        self.marker = marker
        self.raw = raw
        self.i = i
        self.close = close
        self.emitted_any = False  # a call of this region was committed: no way back to plain text
        self.represented = 0      # raw[:represented] is held by committed calls
        self.call: tuple[int, str, str] | None = None  # open call: (index, call_id, name)
        self.args: list[str] = []  # pieces of arguments text emitted so far for the open call
        self.args_len = 0
        self.state = self.INITIAL[0]

    def goto(self, state: str) -> None:
        """Move to `state`, if this reader's table allows it from the current one."""
        if state not in self.TRANSITIONS[self.state]:
            raise IllegalTransition(f"{type(self).__name__}: no transition {self.state!r} -> {state!r}")
        self.state = state

    def step(self, final: bool) -> tuple[str, Any] | None:
        while True:
            r = getattr(self, "_" + self.state)(final)
            if r is not AGAIN:
                return r

    def need(self, final: bool) -> None:
        """Called when the reader waits for more text: at the end of output that is a failure."""
        if final:
            raise Fail

    # -- call bookkeeping shared by all forms --

    def start_call(self, name: str) -> None:
        self.call = self.p.begin_call(name)
        self.args, self.args_len = [], 0
        self.emitted_any = True

    def emit_args(self, text: str) -> None:
        if text:
            self.args.append(text)
            self.args_len += len(text)
            self.p.emit(ToolCallArgsDelta(self.call[0], text))

    def end_call(self) -> None:
        index, call_id, name = self.call
        self.p.emit(ToolCallEnd(index, call_id, name, "".join(self.args)))
        self.call = None
        self.represented = self.i

    def repair(self) -> tuple[str, int]:
        """For a committed call that broke: (text that closes its arguments, raw index it represents)."""
        return ("}" if self.args_len else "{}"), self.i

    def fail(self) -> tuple[str, Any]:
        if self.call is not None:
            closer, represented = self.repair()
            self.emit_args(closer)
            self.end_call()
            self.represented = represented
        if self.emitted_any:
            return "rest", self.raw[self.represented:]
        return "rescan", None

    def closing(self, final: bool) -> tuple[str, Any] | None:
        """After the last call of the region: consume the closing tag when it is there (lenient if not)."""
        if self.close is None:
            return "done", self.raw[self.i:]
        j = skip_ws(self.raw, self.i)
        if self.raw.startswith(self.close, j):
            return "done", self.raw[j + len(self.close):]
        if not final and self.close.startswith(self.raw[j:]):
            return None
        return "done", self.raw[self.i:]

