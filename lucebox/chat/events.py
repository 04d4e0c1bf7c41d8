"""Typed events of one generation, shared by every API dialect.

The event pipeline (chat/stream.py) turns the model's streamed text into these;
each dialect in api/ only decides how they look on the wire. For one tool call
the order is always ToolCallStart, zero or more ToolCallArgsDelta, ToolCallEnd,
all with the same `index`, and the ArgsDelta texts concatenate to exactly
`ToolCallEnd.arguments`. A stream ends with exactly one Finish.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "stop_sequence", "tool_calls", "cancelled", "error")


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the answer text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's reasoning (the text between the thinking tags)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: its name is known and the tool is declared."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    """A piece of the call's JSON arguments string."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """The call is complete; `arguments` is the whole, valid JSON object text."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The generation ended; `reason` is one of FINISH_REASONS."""

    reason: str
    stop_sequence: str | None = None


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Finish


def new_call_id() -> str:
    """A fresh tool-call id, `call_` + 24 lowercase hex digits."""
    return "call_" + secrets.token_hex(12)


def _run_key(ev: Event) -> tuple | None:
    """Events with the same key may be joined; None for events that never merge."""
    if isinstance(ev, TextDelta):
        return (TextDelta,)
    if isinstance(ev, ReasoningDelta):
        return (ReasoningDelta,)
    if isinstance(ev, ToolCallArgsDelta):
        return (ToolCallArgsDelta, ev.index)
    return None


def merge_events(events: list[Event]) -> list[Event]:
    """Join consecutive deltas of the same kind (and call index) and drop empty ones.

    Merging never changes meaning: a renderer that appends deltas sees the same text.
    """
    out: list[Event] = []
    parts: list[str] = []  # texts of the run of deltas that ends `out`
    for ev in events:
        key = _run_key(ev)
        if key is not None and not ev.text:
            continue
        if key is not None and out and parts and _run_key(out[-1]) == key:
            parts.append(ev.text)
            continue
        if len(parts) > 1:
            out[-1] = dataclasses.replace(out[-1], text="".join(parts))
        out.append(ev)
        parts = [ev.text] if key is not None else []
    if len(parts) > 1:
        out[-1] = dataclasses.replace(out[-1], text="".join(parts))
    return out
