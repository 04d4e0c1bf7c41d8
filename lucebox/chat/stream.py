"""The one event pipeline: streamed model text -> typed events, for every dialect.

    detokenizer pieces -> StopMatcher -> ReasoningSplitter -> ToolCallParser -> events

Stop strings are matched on the raw output (reasoning included, as llama.cpp
does); tool calls are looked for only in the answer, never in reasoning. The
pipeline is pure logic: the scheduler feeds it the detokenizer's pieces and a
dialect renders the events it returns.
"""

from __future__ import annotations

from lucebox.chat.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallStart,
    merge_events,
)
from lucebox.chat.reasoning import ReasoningConfig, ReasoningSplitter
from lucebox.chat.stops import StopMatcher
from lucebox.chat.toolcalls import ToolCallParser

_CALLER_REASONS = ("stop", "length", "cancelled", "error")


class EventPipeline:
    """Per-request state turning text pieces into events.

    `tools=None` (or empty) disables tool-call parsing: that is what
    tool_choice "none" asks for. `reasoning=None` means the model has no
    reasoning markup: all output is answer text.
    """

    def __init__(self, *, stops: list[str], tools: list[dict] | None,
                 reasoning: ReasoningConfig | None) -> None:
        self._stops = StopMatcher(stops)
        self._splitter = ReasoningSplitter.from_config(reasoning) if reasoning is not None else None
        self._parser = ToolCallParser(tools) if tools else None
        self.num_tool_calls = 0
        self._finished = False

    @property
    def done(self) -> bool:
        """True once a stop sequence matched: the caller stops generating and calls finish()."""
        return self._stops.done

    @property
    def saw_reasoning(self) -> bool:
        """Whether any reasoning text was emitted."""
        return self._splitter is not None and self._splitter.saw_reasoning

    @property
    def has_reasoning(self) -> bool:
        """Whether the model has reasoning markup (else all its output is answer text)."""
        return self._splitter is not None

    @property
    def in_reasoning(self) -> bool:
        """Whether the model is still inside its reasoning (for the thinking budget)."""
        return self._splitter is not None and self._splitter.in_reasoning

    def push(self, text: str) -> list[Event]:
        """Add a piece of output text; return the events it decides (maybe none)."""
        if self._finished:
            raise RuntimeError("EventPipeline.push after finish")
        if not text or self._stops.done:
            return []
        safe, _ = self._stops.push(text)
        return self._route(safe, final=False)

    def finish(self, reason: str) -> list[Event]:
        """End of generation: release everything held back, then exactly one Finish.

        `reason` is why the caller stopped: 'stop' (end of turn / EOS), 'length',
        'cancelled' or 'error'. The Finish carries 'cancelled' and 'error' as
        given; otherwise 'stop_sequence' (with the string) when a stop string
        matched, 'tool_calls' when a call was emitted and the model ended its
        turn, else the given reason.
        """
        if reason not in _CALLER_REASONS:
            raise ValueError(f"finish reason must be one of {_CALLER_REASONS}, not {reason!r}")
        if self._finished:
            raise RuntimeError("EventPipeline.finish called twice")
        self._finished = True
        events = self._route(self._stops.flush(), final=True)
        if reason in ("cancelled", "error"):
            fin = Finish(reason)
        elif self._stops.matched is not None:
            fin = Finish("stop_sequence", self._stops.matched)
        elif reason == "stop" and self.num_tool_calls:
            fin = Finish("tool_calls")
        else:
            fin = Finish(reason)
        events.append(fin)
        return events

    def _route(self, text: str, final: bool) -> list[Event]:
        if self._splitter is None:
            parts: list[TextDelta | ReasoningDelta] = [TextDelta(text)] if text else []
        else:
            parts = self._splitter.push(text) if text else []
            if final:
                parts += self._splitter.flush()
        out: list[Event] = []
        for ev in parts:
            if isinstance(ev, TextDelta) and self._parser is not None:
                out += self._parser.push(ev.text)
            else:
                out.append(ev)
        if final and self._parser is not None:
            out += self._parser.finish()
        self.num_tool_calls += sum(isinstance(ev, ToolCallStart) for ev in out)
        return merge_events(out)
