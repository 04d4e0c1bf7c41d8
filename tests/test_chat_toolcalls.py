"""ToolCallParser: every recognised form, split at every position, and its failure rules."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucebox.chat.events import (
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
)
from lucebox.chat.toolcalls import ToolCallParser, convert_param, normalize_tools
from lucebox.chat.toolcalls.driver import TRANSITIONS, State
from lucebox.chat.toolcalls.gemma import GemmaCall
from lucebox.chat.toolcalls.hermes_json import JsonCall
from lucebox.chat.toolcalls.python_calls import PythonCalls
from lucebox.chat.toolcalls.qwen_xml import XmlCall
from lucebox.chat.toolcalls.reader import IllegalTransition, Reader
from lucebox.chat.toolcalls.regions import BareList, Wrapper
from lucebox.errors import LuceboxError

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "temp": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"type": "object"},
            "note": {"type": ["string", "null"]},
        },
    },
}
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}}
TOOLS = [WEATHER, WRITE]


def check_calls(events: list) -> None:
    """Structure every renderer relies on: Start, ArgsDelta*, End per index; args are valid JSON."""
    open_calls: dict[int, tuple[str, str, str]] = {}
    seen = set()
    for ev in events:
        if isinstance(ev, (TextDelta, ToolCallArgsDelta)):
            assert ev.text, "empty delta"
        if isinstance(ev, ToolCallStart):
            assert ev.index not in seen and ev.index == len(seen), "indices count up from 0"
            assert re.fullmatch(r"call_[0-9a-f]{24}", ev.call_id)
            seen.add(ev.index)
            open_calls[ev.index] = (ev.call_id, ev.name, "")
        elif isinstance(ev, ToolCallArgsDelta):
            cid, name, args = open_calls[ev.index]
            open_calls[ev.index] = (cid, name, args + ev.text)
        elif isinstance(ev, ToolCallEnd):
            cid, name, args = open_calls.pop(ev.index)
            assert (ev.call_id, ev.name) == (cid, name)
            assert args == ev.arguments, "ArgsDelta pieces must concatenate to the final arguments"
            assert isinstance(json.loads(ev.arguments), dict)
        else:
            assert isinstance(ev, TextDelta), ev
    assert not open_calls, "a call was never ended"


def normalized(events: list) -> list:
    return [dataclasses.replace(ev, call_id="ID") if hasattr(ev, "call_id") else ev for ev in merge_events(events)]


def parse(pieces: list[str], tools: list[dict] = TOOLS, **kw) -> list:
    p = ToolCallParser(tools, **kw)
    events = []
    for piece in pieces:
        events += p.push(piece)
    events += p.finish()
    check_calls(events)
    return normalized(events)


def all_splits(text: str, seed: int = 0, n_random: int = 25) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    for _ in range(n_random):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            pieces.append(text[i:i + k])
            i += k
        out.append(pieces)
    return out


def call(name: str, args: str, index: int = 0) -> list:
    return [ToolCallStart(index, "ID", name), ToolCallArgsDelta(index, args), ToolCallEnd(index, "ID", name, args)]


def T(text: str) -> TextDelta:
    return TextDelta(text)


QWEN_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")

CASES = {
    "xml wrapped, text before": (
        "Let me check the weather.\n\n" + QWEN_XML,
        [T("Let me check the weather."), *call("get_weather", '{"city": "Paris", "days": 3}')]),
    "xml without wrapper, text after": (
        "<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n</function>\nDone.",
        [*call("get_weather", '{"city": "San José"}'), T("Done.")]),
    "xml typed params by schema": (
        ("<function=get_weather>\n<parameter=days>\n 7 \n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=temp>\n-2.5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
        "<parameter=where>\n{'lat': 1}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
        "<parameter=extra>\n42\n</parameter>\n<parameter=other>\nfree text\n</parameter>\n</function>"),
        call("get_weather", '{"days": 7, "metric": true, "temp": -2.5, "tags": ["a", "b"], "where": {"lat": 1}, '
                            '"note": null, "extra": 42, "other": "free text"}')),
    "xml string keeps inner whitespace and numbers as text": (
        ("<function=write_file>\n<parameter=path>\n007\n</parameter>\n<parameter=content>\n"
        "def f():\n    return '<b>'\n\n</parameter>\n</function>"),
        call("write_file", '{"path": "007", "content": "def f():\\n    return \'<b>\'\\n"}')),
    "xml missing </parameter> and </function>": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</tool_call>",
        call("get_weather", '{"city": "Rome", "days": 2}')),
    "xml two functions, two wrappers": (
        QWEN_XML + "\n" + QWEN_XML.replace("Paris", "Oslo"),
        [*call("get_weather", '{"city": "Paris", "days": 3}'),
         *call("get_weather", '{"city": "Oslo", "days": 3}', 1)]),
    "xml no parameters": (
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        call("get_weather", "{}")),
    "hermes json": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        call("get_weather", '{"city": "Paris", "days": 3}')),
    "hermes json keeps the model's own formatting": (
        '<tool_call>{"name":"write_file","arguments":{ "path":"a\\u00e9.txt", "content":"x\\n\\"q\\"" }}</tool_call>',
        call("write_file", '{ "path":"a\\u00e9.txt", "content":"x\\n\\"q\\"" }')),
    "hermes parameters key, nested values": (
        ('<tool_call>{"name": "get_weather", "parameters": {"where": {"a": [1, 2.5e3, true, null]}, "tags": []}}'
        '</tool_call>'),
        call("get_weather", '{"where": {"a": [1, 2.5e3, true, null]}, "tags": []}')),
    "hermes arguments as a JSON string": (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        call("get_weather", '{"city": "Paris"}')),
    "hermes arguments before name": (
        '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        call("get_weather", '{"city": "Paris"}')),
    "hermes no arguments, extra key": (
        '<tool_call>{"name": "get_weather", "id": 5}</tool_call>',
        call("get_weather", "{}")),
    "hermes missing closing tag": (
        '<tool_call>{"name": "get_weather", "arguments": {}}',
        call("get_weather", "{}")),
    "bare json object at start": (
        '\n  {"name": "get_weather", "arguments": {"city": "Paris"}}',
        call("get_weather", '{"city": "Paris"}')),
    "bare json list at start": (
        '[{"name": "get_weather", "arguments": {"city": "A"}},\n {"name": "write_file", "arguments": {"path": "p"}}]',
        [*call("get_weather", '{"city": "A"}'), *call("write_file", '{"path": "p"}', 1)]),
    "bare json not at start is text": (
        'Here: {"name": "get_weather", "arguments": {"city": "Paris"}}',
        [T('Here: {"name": "get_weather", "arguments": {"city": "Paris"}}')]),
    "json answer that is no call": (
        '{"answer": 42, "name": "get_weather"}',
        [T('{"answer": 42, "name": "get_weather"}')]),
    "bare python list at start (Gemma 3 prompt format)": (
        '[get_weather(city="Paris", days=2), write_file(path="a]b")]\nDone.',
        [*call("get_weather", '{"city": "Paris", "days": 2}'), *call("write_file", '{"path": "a]b"}', 1),
         T("Done.")]),
    "bracket text at start is not held": (
        "[link](http://x) and [get_weather] and more",
        [T("[link](http://x) and [get_weather] and more")]),
    "python list of an undeclared function is text": (
        "[delete(x=1)]", [T("[delete(x=1)]")]),
    "gemma quoted values": (
        'call:get_weather{city:"Oslo",days:"3"}',
        call("get_weather", '{"city": "Oslo", "days": 3}')),
    "gemma stray bracket closes the call with what was read": (
        "call:get_weather{city:<escape>A<escape>,tags:[1}",
        [*call("get_weather", '{"city": "A"}'), T(",tags:[1}")]),
    "tool_code json": (
        'Sure.\n<tool_code>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_code>',
        [T("Sure."), *call("get_weather", '{"city": "Paris"}')]),
    "tool_code python": (
        '<tool_code>get_weather(city="Paris", days=2, metric=True)</tool_code>',
        call("get_weather", '{"city": "Paris", "days": 2, "metric": true}')),
    "tool_code python list": (
        "<tool_code>[get_weather(city='A'), write_file(path='b', content='c')]</tool_code>",
        [*call("get_weather", '{"city": "A"}'), *call("write_file", '{"path": "b", "content": "c"}', 1)]),
    "tool_code fence python": (
        '```tool_code\nget_weather(city="Paris")\n```\nLet me know.',
        [*call("get_weather", '{"city": "Paris"}'), T("Let me know.")]),
    "tool_code fence gemma": (
        "```tool_code\ncall:get_weather{city:<escape>Paris<escape>}\n```",
        call("get_weather", '{"city": "Paris"}')),
    "gemma call with escapes and typed values": (
        ("<start_function_call>call:get_weather{city:<escape>Paris, {FR}<escape>,days:4,metric:false,"
        "where:{lat:<escape>1<escape>,n:[1,2]}}<end_function_call>"),
        call("get_weather", '{"city": "Paris, {FR}", "days": 4, "metric": false, "where": {"lat": "1", "n": [1, 2]}}')),
    "gemma bare call, escape tokens skipped by the detokenizer": (
        "call:get_weather{city:Paris,days:2}",
        call("get_weather", '{"city": "Paris", "days": 2}')),
    "gemma 4 native call": (
        '<|tool_call>call:get_weather{city:<|"|>New, York<|"|>,where:{a:<|"|>}<|"|>}}<tool_call|>ok',
        [*call("get_weather", '{"city": "New, York", "where": {"a": "}"}}'), T("ok")]),
    "gemma two calls": (
        ("<start_function_call>call:get_weather{}<end_function_call>"
        "<start_function_call>call:write_file{path:<escape>a<escape>}<end_function_call>"),
        [*call("get_weather", "{}"), *call("write_file", '{"path": "a"}', 1)]),
    "word that ends in call: is text": (
        "recall:get_weather{} and call: now",
        [T("recall:get_weather{} and call: now")]),
    "undeclared tool, xml": (
        "<tool_call>\n<function=delete_all>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        [T("<tool_call>\n<function=delete_all>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>")]),
    "undeclared tool, hermes, then a good call": (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather"}</tool_call>',
        [T('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'), *call("get_weather", "{}")]),
    "undeclared tool, gemma": (
        "call:nope{a:1}", [T("call:nope{a:1}")]),
    "broken json before the name is text": (
        '<tool_call>{"name": get_weather}</tool_call> ok',
        [T('<tool_call>{"name": get_weather}</tool_call> ok')]),
    "python body that is no declared call": (
        "<tool_code>print('hi')</tool_code>", [T("<tool_code>print('hi')</tool_code>")]),
    "unclosed wrapper at finish is text": (
        "Text <tool_call>\n<funct", [T("Text <tool_call>\n<funct")]),
    "partial marker at the end is text": (
        "I like <tool", [T("I like <tool")]),
    "markup-like text": (
        "Use <b>bold</b>, <function>, {x} and ```python\nprint(1)\n```",
        [T("Use <b>bold</b>, <function>, {x} and ```python\nprint(1)\n```")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forms_split_at_every_position(name):
    text, want = CASES[name]
    for pieces in all_splits(text, seed=hash(name) & 0xFFFF):
        assert parse(pieces) == want, pieces


def test_parser_disabled_or_no_tools_gives_text():
    assert parse([QWEN_XML], enabled=False) == [T(QWEN_XML)]
    assert parse([QWEN_XML], tools=[]) == [T(QWEN_XML)]


def test_held_back_text_waits_for_the_decision():
    p = ToolCallParser(TOOLS)
    assert p.push("Hello <tool") == [T("Hello")]
    assert p.push("s are great") == [T(" <tools are great")]
    p = ToolCallParser(TOOLS)
    assert p.push("  ") == []
    assert p.push("{") == []  # could be a bare JSON call
    assert p.push('"answer": 1}') == [T('  {"answer": 1}')]


def test_xml_string_parameter_streams_while_it_is_written():
    p = ToolCallParser(TOOLS)
    head = "<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline two"
    events = p.push(head)
    args = "".join(ev.text for ev in events if isinstance(ev, ToolCallArgsDelta))
    assert isinstance(events[0], ToolCallStart) and events[0].name == "write_file"
    assert args == '{"content": "line one\\nline two'
    events = p.push("\n</parameter>\n</function>\n</tool_call>") + p.finish()
    end = events[-1]
    assert isinstance(end, ToolCallEnd) and end.arguments == '{"content": "line one\\nline two"}'


def test_json_arguments_stream_as_they_arrive():
    p = ToolCallParser(TOOLS)
    events = p.push('<tool_call>{"name": "write_file", "arguments": {"path": "a.txt", "content": "hello wo')
    assert [type(ev) for ev in events][:1] == [ToolCallStart]
    streamed = "".join(ev.text for ev in events if isinstance(ev, ToolCallArgsDelta))
    assert streamed == '{"path": "a.txt", "content": "hello wo'
    events = p.push('rld"}}</tool_call>') + p.finish()
    assert events[-1].arguments == '{"path": "a.txt", "content": "hello world"}'
    assert events[-1].arguments.startswith(streamed)


def test_streamed_prefix_is_always_a_prefix_of_the_final_arguments():
    texts = [text for text, want in CASES.values() if any(isinstance(ev, ToolCallEnd) for ev in want)]
    rng = random.Random(5)
    for text in texts:
        for pieces in all_splits(text, seed=rng.randint(0, 1 << 30), n_random=10):
            p = ToolCallParser(TOOLS)
            so_far: dict[int, str] = {}
            finals: dict[int, str] = {}
            snapshots: list[tuple[int, str]] = []
            for piece in [*pieces, None]:
                events = p.finish() if piece is None else p.push(piece)
                for ev in events:
                    if isinstance(ev, ToolCallArgsDelta):
                        so_far[ev.index] = so_far.get(ev.index, "") + ev.text
                        snapshots.append((ev.index, so_far[ev.index]))
                    elif isinstance(ev, ToolCallEnd):
                        finals[ev.index] = ev.arguments
            for index, prefix in snapshots:
                assert finals[index].startswith(prefix)


def test_committed_call_that_breaks_is_closed_and_the_rest_is_text():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": True}}</tool_call>'
    for pieces in all_splits(text):
        assert parse(pieces) == [*call("get_weather", '{"city": "Paris"}'),
                                 T(', "days": True}}</tool_call>')], pieces


def test_call_cut_off_at_finish_is_closed_with_valid_json():
    cases = {
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par': ('{"city": "Par"}', ""),
        '<tool_call>{"name": "get_weather", "arguments": {"tags": ["a", "b': ('{"tags": ["a", "b"]}', ""),
        '<tool_call>{"name": "get_weather", "arguments": {"days": 1': ("{}", '"days": 1'),
        '<tool_call>{"name": "get_weather", "arg': ("{}", '"arg'),
        "<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\nhalf\n":
            ('{"path": "a.txt", "content": "half"}', "\n"),
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3":
            ('{"city": "Paris"}', "<parameter=days>\n3"),
        "call:get_weather{city:<escape>Par": ("{}", "city:<escape>Par"),
    }
    for text, (args, rest) in cases.items():
        for pieces in all_splits(text, n_random=5):
            want = call("get_weather" if "weather" in text else "write_file", args)
            if rest.strip():
                want.append(T(rest.strip()))
            assert parse(pieces) == want, (text, pieces)


def test_text_between_calls_stays_text():
    text = ('First.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            "Then.\n<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\nEnd.\n")
    for pieces in all_splits(text, n_random=10):
        assert parse(pieces) == [T("First."), *call("get_weather", '{"city": "A"}'), T("Then."),
                                 *call("get_weather", '{"city": "B"}', 1), T("End.\n")]


def test_text_without_calls_is_returned_exactly():
    text = "  Some text\n\n with trailing space \n"
    assert parse([text]) == [T(text)]


def test_call_ids_are_fresh():
    p = ToolCallParser(TOOLS)
    events = p.push(QWEN_XML + QWEN_XML) + p.finish()
    ids = [ev.call_id for ev in events if isinstance(ev, ToolCallStart)]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert p.num_calls == 2


def test_convert_param_by_schema():
    assert convert_param(" 42 ", {"type": "integer"}) == 42
    assert convert_param("42", {"type": "string"}) == "42"
    assert convert_param("3.0", {"type": "number"}) == 3
    assert convert_param("1e3", {"type": "number"}) == 1000.0
    assert convert_param("nan", {"type": "number"}) == "nan"
    assert convert_param("FALSE", {"type": "boolean"}) is False
    assert convert_param("null", {"type": ["integer", "null"]}) is None
    assert convert_param("null", {"type": "string"}) == "null"
    assert convert_param("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert_param("{'a': (1)}", {"type": "object"}) == {"a": 1}
    assert convert_param("not json", {"type": "object"}) == "not json"
    assert convert_param("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 7
    assert convert_param("b", {"enum": ["a", "b"]}) == "b"
    assert convert_param("true", None) is True
    assert convert_param("free", None) == "free"


def test_normalize_tools_accepts_both_shapes_and_rejects_nameless():
    assert set(normalize_tools(TOOLS)) == {"get_weather", "write_file"}
    assert normalize_tools([{"name": "x"}]) == {"x": {}}
    with pytest.raises(LuceboxError, match=r"tools\[0\] has no name"):
        ToolCallParser([{"description": "no name"}])
    with pytest.raises(LuceboxError):
        normalize_tools(["get_weather"])


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=nope>", "<parameter=city>",
    "<parameter=days>", "</parameter>", "</function>", '{"name": "get_weather", "arguments": ', '{"city": "P"}',
    '"name"', '"arguments"', "{", "}", "[", "]", '"', ":", ",", "call:get_weather{", "call:", "<escape>",
    "<tool_code>", "</tool_code>", "```tool_code\n", "```", "get_weather(city='a')", "x", " ", "\n", "3", "<",
    "<start_function_call>", "<end_function_call>", "\\", "true", "<|tool_call>", '<|"|>', "[get_weather(", ")",
]


def test_fuzz_invariants():
    """Random markup soup: never crashes, calls well formed, split invariant, text kept when no call."""
    rng = random.Random(2024)
    for _ in range(600):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        want = parse([text])
        if not any(isinstance(ev, ToolCallStart) for ev in want):
            assert "".join(ev.text for ev in want) == text
        for pieces in all_splits(text, seed=rng.randint(0, 1 << 30), n_random=3)[:6]:
            assert parse(pieces) == want, (text, pieces)


def test_long_streamed_argument_is_linear_enough():
    content = "x = 1\n" * 5_000
    text = "<function=write_file>\n<parameter=content>\n" + content + "\n</parameter>\n</function>"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    events = parse(pieces)
    assert json.loads(events[-1].arguments) == {"content": content}
    jtext = '<tool_call>{"name": "write_file", "arguments": ' + json.dumps({"content": content}) + "}</tool_call>"
    events = parse([jtext[i:i + 3] for i in range(0, len(jtext), 3)])
    assert json.loads(events[-1].arguments) == {"content": content}


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "lit", "list", "obj"] if depth < 3 else ["str", "int", "lit"])
    if kind == "str":
        return "".join(rng.choice('ab "\\\n/é😀\t{}') for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return rng.choice([0.5, -1e-7, 3.25e10, 1.0])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def dumps_randomly(value, rng: random.Random) -> str:
    """JSON text of `value` with random spacing and escaping, like different models write it."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
    return text.replace(", ", rng.choice([",", ", ", " ,\n "])).replace(": ", rng.choice([":", ": ", " :  "]))


def strict_valid(text: str) -> bool:
    def no_constants(name):
        raise ValueError(name)
    try:
        json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False
    return text == text.strip()


def test_json_validator_agrees_with_json_loads_and_safe_prefixes_close():
    from lucebox.chat.toolcalls.json_scan import JsonScan

    rng = random.Random(31)
    for _ in range(400):
        text = dumps_randomly({"a": random_json(rng)}, rng)
        for k in range(1, len(text) + 1):  # every prefix: the safe cut plus its closer is valid JSON
            scan = JsonScan()
            used = scan.feed(text[:k])
            assert not scan.error and used == k
            assert scan.safe <= k
            assert strict_valid(text[:scan.safe] + scan.safe_closer), (text[:k], scan.safe, scan.safe_closer)
        assert scan.done
        # mutate: the validator accepts exactly what strict json.loads accepts
        i = rng.randrange(len(text))
        bad = rng.choice([text[:i] + text[i + 1:], text[:i] + rng.choice(',:"{}[]\\x1-eE.') + text[i:]])
        scan = JsonScan()
        used = scan.feed(bad)
        assert (scan.done and not scan.error and used == len(bad)) == strict_valid(bad), bad


def test_random_hermes_calls_round_trip_and_truncations_stay_valid():
    rng = random.Random(8)
    tools = [{"name": "f", "parameters": {}}]
    for _ in range(150):
        args = dumps_randomly({f"p{i}": random_json(rng) for i in range(rng.randint(0, 3))}, rng)
        text = '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        assert parse(pieces, tools=tools) == call("f", args)
        cut = rng.randint(len('<tool_call>{"name": "f", "arguments": '), len(text))
        parse([text[:cut]], tools=tools)  # check_calls: closed with valid JSON, pieces concatenate


# --------------------------------------------------------------------------- the state tables

READERS = [Wrapper, BareList, PythonCalls, XmlCall, JsonCall, GemmaCall]

# Texts that take the transitions the CASES above do not: two functions in one wrapper, a JSON call whose
# arguments are a string or come with another key first, a list of calls inside a wrapper, only whitespace.
TABLE_CORPUS = [text for text, _ in CASES.values()] + [
    " \n",
    "<tool_call>\n<function=get_weather>\n</function>\n<function=write_file>\n</function>\n</tool_call>",
    '<tool_call>{"id": 1, "name": "get_weather", "arguments": "{\\"city\\": \\"A\\"}"}</tool_call>',
    '<tool_call>[{"name": "get_weather"}, {"name": "write_file", "arguments": {}}]</tool_call>',
]


def reachable(start: set, edges: dict) -> set:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_driver_table_reaches_every_state_and_every_state_can_finish():
    edges: dict = {}
    for (state, _event), nxt in TRANSITIONS.items():
        edges.setdefault(state, set()).add(nxt)
    assert reachable({State.START, State.PASSTHROUGH}, edges) == set(State)
    for state in State:
        assert State.DONE in reachable({state}, edges), state
    assert {ToolCallParser(TOOLS).state, ToolCallParser(TOOLS, enabled=False).state} == {State.START,
                                                                                         State.PASSTHROUGH}


@pytest.mark.parametrize("cls", READERS, ids=lambda c: c.__name__)
def test_reader_table_is_closed_and_every_state_is_reachable(cls):
    table = cls.TRANSITIONS
    assert set(cls.INITIAL) <= set(table)
    assert all(set(nxt) <= set(table) for nxt in table.values()), "a transition to a state with no entry"
    assert reachable(set(cls.INITIAL), table) == set(table)
    for state in table:
        assert callable(getattr(cls, "_" + state, None)), f"{cls.__name__} has no method for state {state!r}"


def test_illegal_transitions_raise():
    p = ToolCallParser(TOOLS)
    p.push("Hi <tool_call>")
    assert p.state is State.REGION
    p.finish()
    assert p.finish() == [] and p.state is State.DONE  # finishing twice is allowed by the table
    with pytest.raises(IllegalTransition, match="DONE on 'push'"):
        p.push("more")
    off = ToolCallParser(TOOLS, enabled=False)
    off.finish()
    with pytest.raises(RuntimeError):  # what callers catch (as before the table): IllegalTransition is one
        off.push("x")
    open_region = ToolCallParser(TOOLS)
    open_region.push("<tool_call>")
    with pytest.raises(IllegalTransition, match="REGION on 'finish'"):  # finish() must decide every region first
        open_region._fire("finish")
    reader = XmlCall(ToolCallParser(TOOLS), "<function=", "get_weather>", 0, None)
    with pytest.raises(IllegalTransition, match="'name' -> 'value'"):
        reader.goto("value")
    assert reader.state == "name"
    reader.goto("params")
    assert reader.state == "params"


def test_corpus_takes_every_transition_of_every_table(monkeypatch):
    """Every (state, event) of the driver's table and every edge of every reader's table happens in real text."""
    taken: set = set()
    edges: set = set()
    fire, goto = ToolCallParser._fire, Reader.goto

    def record_fire(self, event):
        taken.add((self.state, event))
        fire(self, event)

    def record_goto(self, state):
        edges.add((type(self), self.state, state))
        goto(self, state)

    monkeypatch.setattr(ToolCallParser, "_fire", record_fire)
    monkeypatch.setattr(Reader, "goto", record_goto)
    for text in TABLE_CORPUS:
        for pieces in ([text], list(text)):
            for enabled in (True, False):
                p = ToolCallParser(TOOLS, enabled=enabled)
                for piece in pieces:
                    p.push(piece)
                p.finish()
                p.finish()
    assert set(TRANSITIONS) - taken == set()
    want = {(cls, a, b) for cls in READERS for a, nxt in cls.TRANSITIONS.items() for b in nxt}
    assert want - edges == set()


@st.composite
def soup_and_chunks(draw):
    """Markup soup from FRAGMENTS and the CASES texts, and a random chunking of it."""
    parts = draw(st.lists(st.sampled_from(FRAGMENTS + [text for text, _ in CASES.values()]), max_size=8))
    text = "".join(parts)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(soup_and_chunks())
def test_any_chunking_gives_the_events_of_one_feed(case):
    text, pieces = case
    assert "".join(pieces) == text
    assert parse(pieces) == parse([text])
