"""The streaming tool-call parser: feeds answer text through the call formats and emits events.

ToolCallParser is a small state machine over the answer text, and
`TRANSITIONS` below is the whole of it, in the manner of h11: a dict from
(state, event) to the next state, applied in one place (`_fire`), where a pair
the table does not list raises IllegalTransition. Inside a region each call
format's reader has its own table (reader.Reader.TRANSITIONS).

States:

- START: nothing but whitespace yet; a `{` or `[` here may open a bare call.
- TEXT: plain text, released as it is decided and watched for markers.
- REGION: a reader holds a marked region (regions.open_region).
- PASSTHROUGH: parsing is off (tool_choice "none", or no tools): all is text.
- DONE: finish() ran; pushing more is an error.

Events: "push" (text arrives), "text" (non-whitespace that opens no bare call
leaves START), "open" (a region starts), what the region's reader returns
(Reader.step): "become" (it hands over to the reader of the format it found),
"done" / "rest" (calls were emitted; what follows is text), "rescan" (not a
call after all: the marker is text), and "finish" (end of output).
"""

from __future__ import annotations

import enum

from lucebox.chat.events import Event, TextDelta, ToolCallStart, merge_events, new_call_id
from lucebox.chat.toolcalls.reader import Fail, IllegalTransition, Reader
from lucebox.chat.toolcalls.regions import ANSWER_OPENERS, MARKER_TAGS, MARKERS, open_region
from lucebox.chat.toolcalls.schema import normalize_tools


class State(enum.Enum):
    """Where the parser is in the answer text (see the module docstring)."""

    START = "start"
    TEXT = "text"
    REGION = "region"
    PASSTHROUGH = "passthrough"
    DONE = "done"


TRANSITIONS: dict[tuple[State, str], State] = {
    (State.START, "push"): State.START,
    (State.START, "text"): State.TEXT,
    (State.START, "open"): State.REGION,  # `{` or `[` opens the answer
    (State.START, "finish"): State.DONE,
    (State.TEXT, "push"): State.TEXT,
    (State.TEXT, "open"): State.REGION,  # a marker
    (State.TEXT, "finish"): State.DONE,
    (State.REGION, "push"): State.REGION,
    (State.REGION, "become"): State.REGION,
    (State.REGION, "done"): State.TEXT,
    (State.REGION, "rest"): State.TEXT,
    (State.REGION, "rescan"): State.TEXT,
    # No (REGION, "finish"): at the end of output every reader decides (it fails rather than waits) first.
    (State.PASSTHROUGH, "push"): State.PASSTHROUGH,
    (State.PASSTHROUGH, "finish"): State.DONE,
    (State.DONE, "finish"): State.DONE,  # finishing twice is harmless; pushing after finish is not
}
_MOVES: dict[State, dict[str, State]] = {s: {e: n for (f, e), n in TRANSITIONS.items() if f is s} for s in State}
"""TRANSITIONS by state: `_fire` runs on every push, and a str key hashes faster than a (State, str) one."""


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class ToolCallParser:
    """Incremental tool-call recognition over answer text (never over reasoning).

    `push(text)` and `finish()` return events: TextDelta for plain text and
    ToolCallStart / ToolCallArgsDelta / ToolCallEnd for calls. With
    `enabled=False` (tool_choice "none") everything is text.
    """

    def __init__(self, tools: list[dict], *, enabled: bool = True) -> None:
        self.tools = normalize_tools(tools)  # name -> JSON schema of its parameters
        self.enabled = enabled and bool(self.tools)
        self.state = State.START if self.enabled else State.PASSTHROUGH
        self._moves = _MOVES[self.state]
        self.num_calls = 0
        self._out: list[Event] = []
        self._buf = ""
        self._reader: Reader | None = None  # set exactly while the state is REGION
        self._pending_ws = ""     # trailing whitespace of the text, held in case a call follows
        self._after_call = False  # the last thing was a call: following whitespace is dropped
        self._prev = ""           # last text character released (word boundary for `call:`)

    def push(self, text: str) -> list[Event]:
        """Add a piece of answer text; return the events it decides."""
        self._fire("push")
        if self.state is State.PASSTHROUGH:
            return [TextDelta(text)] if text else []
        self._buf += text
        self._run(final=False)
        out, self._out = self._out, []
        return merge_events(out)

    def finish(self) -> list[Event]:
        """End of output: decide everything held back."""
        if self.state in (State.PASSTHROUGH, State.DONE):
            self._fire("finish")
            return []
        self._run(final=True)
        self._fire("finish")
        if self._pending_ws:
            self._out.append(TextDelta(self._pending_ws))
            self._pending_ws = ""
        out, self._out = self._out, []
        return merge_events(out)

    def _fire(self, event: str) -> None:
        """The one place the parser's state changes: to what TRANSITIONS says, or IllegalTransition."""
        nxt = self._moves.get(event)
        if nxt is None:
            raise IllegalTransition(f"ToolCallParser: no transition from {self.state.name} on {event!r}")
        if nxt is not self.state:
            self.state, self._moves = nxt, _MOVES[nxt]

    # -- what readers call --

    def begin_call(self, name: str) -> tuple[int, str, str]:
        """Commit a call of declared tool `name`: emit ToolCallStart; returns (index, call_id, name)."""
        index, call_id = self.num_calls, new_call_id()
        self.num_calls += 1
        self._pending_ws = ""
        self._out.append(ToolCallStart(index, call_id, name))
        return index, call_id, name

    def emit(self, event: Event) -> None:
        """Queue an event for the caller of the current push/finish."""
        self._out.append(event)

    # -- driving the readers --

    def _run(self, final: bool) -> None:
        while True:
            reader = self._reader
            if reader is None:
                if not self._scan_text(final):
                    return
                continue
            # Append without copying the whole region each time: with the attribute
            # cleared, `raw` holds the only reference and CPython grows it in place.
            raw, reader.raw = reader.raw, ""
            raw += self._buf
            reader.raw, self._buf = raw, ""
            try:
                result = reader.step(final)
            except Fail:
                result = reader.fail()
            if result is None:
                if not final:
                    return
                result = reader.fail()  # readers fail rather than wait at the end; be safe regardless
            kind, value = result
            self._fire(kind)
            if kind == "become":
                self._reader = value
                continue
            self._reader = None
            if kind == "rescan":  # not a call after all: the marker is text, the rest is read again
                self._emit_text(reader.marker)
                self._buf = reader.raw
            else:  # "done" or "rest": calls were emitted; what follows is text again
                self._after_call = True
                self._prev = ""
                self._buf = value

    def _open(self, marker: str, raw: str) -> None:
        self._reader = open_region(self, marker, raw)
        self._buf = ""
        self._fire("open")

    def _scan_text(self, final: bool) -> bool:
        """Text mode: release text, start a reader at a marker. Returns whether a reader started."""
        buf = self._buf
        if not buf:
            return False
        if self.state is State.START:
            body = buf.lstrip()
            if not body:
                if final:
                    self._emit_text(buf)
                    self._buf = ""
                return False
            if body[0] in ANSWER_OPENERS:
                self._pending_ws += buf[:len(buf) - len(body)]
                self._open(body[0], body[1:])
                return True
            self._fire("text")
        pos, marker = self._find_marker(buf)
        if marker:
            self._emit_text(buf[:pos])
            self._open(marker, buf[pos + len(marker):])
            return True
        hold = 0 if final else self._hold_len(buf)
        self._emit_text(buf[:len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _boundary(self, buf: str, pos: int) -> bool:
        before = buf[pos - 1] if pos > 0 else self._prev
        return not (before and _word_char(before))

    def _find_marker(self, buf: str) -> tuple[int, str]:
        best, best_marker = -1, ""
        for marker in MARKERS:
            pos = buf.find(marker)
            while marker == "call:" and pos >= 0 and not self._boundary(buf, pos):
                pos = buf.find(marker, pos + 1)
            if pos >= 0 and (best < 0 or pos < best):
                best, best_marker = pos, marker
        return best, best_marker

    def _hold_len(self, buf: str) -> int:
        return MARKER_TAGS.partial_suffix(buf, lambda marker, at: marker != "call:" or self._boundary(buf, at))

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        self._prev = text[-1]
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        self._out.append(TextDelta(self._pending_ws + body))
        self._pending_ws = text[len(body):]
