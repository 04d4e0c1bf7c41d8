"""EventPipeline: stops -> reasoning -> tool calls, the same events however the text is split."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from lucebox.chat.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
)
from lucebox.chat.reasoning import ReasoningConfig
from lucebox.chat.stream import EventPipeline

TOOLS = [{"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
QWEN3 = ReasoningConfig()
QWEN3_PROMPTED = ReasoningConfig(start_in_reasoning=True)


def run(pieces: list[str], reason: str = "stop", *, stops=(), tools=TOOLS, reasoning=QWEN3):
    """Feed pieces like the scheduler does (stopping once `done`); return (events, pipeline)."""
    pipe = EventPipeline(stops=list(stops), tools=tools, reasoning=reasoning)
    events = []
    for piece in pieces:
        if pipe.done:
            break
        out = pipe.push(piece)
        assert out == merge_events(out), "one push returns merged events"
        events += out
    events += pipe.finish(reason)
    check_stream(events)
    return events, pipe


def check_stream(events: list) -> None:
    assert isinstance(events[-1], Finish)
    assert sum(isinstance(ev, Finish) for ev in events) == 1
    args: dict[int, str] = {}
    for ev in events:
        if isinstance(ev, (TextDelta, ReasoningDelta, ToolCallArgsDelta)):
            assert ev.text, "empty delta"
        if isinstance(ev, ToolCallArgsDelta):
            args[ev.index] = args.get(ev.index, "") + ev.text
        if isinstance(ev, ToolCallEnd):
            assert args.pop(ev.index, "") == ev.arguments
            json.loads(ev.arguments)


def norm(events: list) -> list:
    return [dataclasses.replace(ev, call_id="ID") if hasattr(ev, "call_id") else ev
            for ev in merge_events(events)]


def all_splits(text: str, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    for _ in range(25):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            pieces.append(text[i:i + k])
            i += k
        out.append(pieces)
    return out


def call(name: str, args: str, index: int = 0) -> list:
    return [ToolCallStart(index, "ID", name), ToolCallArgsDelta(index, args), ToolCallEnd(index, "ID", name, args)]


EXAMPLES = {
    "qwen3 think then tool call": (
        ("<think>\nThe user wants weather.\n</think>\n\nI'll check.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
        {}, "stop",
        [ReasoningDelta("The user wants weather."), TextDelta("I'll check."),
         *call("get_weather", '{"city": "Paris"}'), Finish("tool_calls")]),
    "prompted think, hermes call": (
        'Need a tool.</think>\n<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>',
        {"reasoning": QWEN3_PROMPTED}, "stop",
        [ReasoningDelta("Need a tool."), *call("get_weather", '{"days": 2}'), Finish("tool_calls")]),
    "call inside reasoning is not a call": (
        '<think>Maybe <tool_call>{"name": "get_weather"}</tool_call>?</think>No need.',
        {}, "stop",
        [ReasoningDelta('Maybe <tool_call>{"name": "get_weather"}</tool_call>?'), TextDelta("No need."),
         Finish("stop")]),
    "bare json call right after reasoning": (
        '<think>x</think>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        {}, "stop",
        [ReasoningDelta("x"), *call("get_weather", '{"city": "Oslo"}'), Finish("tool_calls")]),
    "stop sequence in the answer": (
        "<think>a</think>Answer: 4.\nUser: more",
        {"stops": ["\nUser:"]}, "stop",
        [ReasoningDelta("a"), TextDelta("Answer: 4."), Finish("stop_sequence", "\nUser:")]),
    "stop sequence inside reasoning ends everything": (
        "<think>I will STOP here</think>answer",
        {"stops": ["STOP"]}, "stop",
        [ReasoningDelta("I will"), Finish("stop_sequence", "STOP")]),
    "stop sequence cuts a tool call": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>END',
        {"stops": ["END"], "reasoning": None}, "stop",
        [*call("get_weather", '{"city": "Rome"}'), Finish("stop_sequence", "END")]),
    "length with a call": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>",
        {}, "length",
        [*call("get_weather", '{"city": "Lima"}'), Finish("length")]),
    "length inside reasoning": (
        "<think>long thoughts", {}, "length", [ReasoningDelta("long thoughts"), Finish("length")]),
    "no tools: markup is text": (
        '<tool_call>{"name": "get_weather"}</tool_call>', {"tools": None}, "stop",
        [TextDelta('<tool_call>{"name": "get_weather"}</tool_call>'), Finish("stop")]),
    "no reasoning config: tags are text": (
        "<think>hm</think>ok", {"reasoning": None}, "stop", [TextDelta("<think>hm</think>ok"), Finish("stop")]),
    "reasoning disabled drops an empty pair": (
        "<think>\n\n</think>\n\nHello", {"reasoning": ReasoningConfig(enabled=False)}, "stop",
        [TextDelta("Hello"), Finish("stop")]),
    "cancelled keeps what came": (
        "<think>a</think>partial <tool", {}, "cancelled",
        [ReasoningDelta("a"), TextDelta("partial <tool"), Finish("cancelled")]),
    "error": ("x", {}, "error", [TextDelta("x"), Finish("error")]),
    "empty output": ("", {}, "stop", [Finish("stop")]),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_split_every_way(name):
    text, kw, reason, want = EXAMPLES[name]
    for pieces in all_splits(text, seed=len(name)):
        events, _ = run(pieces, reason, **kw)
        assert norm(events) == want, pieces


def test_stop_split_across_pieces_never_leaks_and_sets_done():
    text = "Hello world<|END|>ignored"
    for pieces in all_splits(text):
        pipe = EventPipeline(stops=["<|END|>"], tools=None, reasoning=None)
        shown = ""
        for piece in pieces:
            for ev in pipe.push(piece):
                shown += ev.text
            if pipe.done:
                break
        assert pipe.done
        assert pipe.push("more") == []
        fin = pipe.finish("stop")
        assert fin == [Finish("stop_sequence", "<|END|>")]
        assert shown == "Hello world"


def test_finish_flushes_held_text_once():
    pipe = EventPipeline(stops=["</answer>"], tools=TOOLS, reasoning=QWEN3)
    assert pipe.push("Value </ans") == [TextDelta("Value")]
    assert pipe.finish("length") == [TextDelta(" </ans"), Finish("length")]
    with pytest.raises(RuntimeError):
        pipe.finish("stop")
    with pytest.raises(RuntimeError):
        pipe.push("x")


def test_bad_finish_reason_is_refused():
    pipe = EventPipeline(stops=[], tools=None, reasoning=None)
    with pytest.raises(ValueError, match="tool_calls"):
        pipe.finish("tool_calls")


def test_reasoning_state_is_exposed():
    pipe = EventPipeline(stops=[], tools=None, reasoning=QWEN3_PROMPTED)
    assert pipe.in_reasoning and not pipe.saw_reasoning
    pipe.push("thinking")
    assert pipe.saw_reasoning and pipe.in_reasoning
    pipe.push("</think>answer")
    assert not pipe.in_reasoning
    assert not EventPipeline(stops=[], tools=None, reasoning=None).saw_reasoning


def test_tool_call_count_and_several_calls():
    text = ("<think>plan</think>" + '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    events, pipe = run(list(text))
    assert pipe.num_tool_calls == 2
    assert norm(events) == [ReasoningDelta("plan"), *call("get_weather", '{"city": "A"}'),
                            *call("get_weather", '{"city": "B"}', 1), Finish("tool_calls")]


def test_random_outputs_are_split_invariant():
    fragments = ["<think>", "</think>", "\n", "text ", "<tool_call>", "</tool_call>", '{"name": "get_weather"}',
                 "<function=get_weather>", "</function>", "STOP", "ST", "<", "{", "call:get_weather{}"]
    rng = random.Random(77)
    for _ in range(200):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 10)))
        kw = {"stops": rng.choice([[], ["STOP"]]),
              "reasoning": rng.choice([None, QWEN3, QWEN3_PROMPTED, ReasoningConfig(enabled=False)])}
        want = norm(run([text], **kw)[0])
        for pieces in all_splits(text, seed=rng.randint(0, 1 << 30))[:6]:
            assert norm(run(pieces, **kw)[0]) == want, (text, kw, pieces)


def test_merge_events_joins_runs_and_drops_empty_deltas():
    from lucebox.chat.events import new_call_id

    events = [TextDelta("a"), TextDelta(""), TextDelta("b"), ReasoningDelta("r"), ToolCallArgsDelta(0, "x"),
              ToolCallArgsDelta(0, "y"), ToolCallArgsDelta(1, "z"), Finish("stop"), TextDelta("c")]
    assert merge_events(events) == [TextDelta("ab"), ReasoningDelta("r"), ToolCallArgsDelta(0, "xy"),
                                    ToolCallArgsDelta(1, "z"), Finish("stop"), TextDelta("c")]
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 29 and i.startswith("call_") and int(i[5:], 16) >= 0 for i in ids)
