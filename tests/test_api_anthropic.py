"""Anthropic Messages: parsing, the pure SSE renderer, and end to end with the real `anthropic` SDK.

The renderer tests feed hand-made event lists (what the event pipeline emits)
and check every frame against the invariants Claude Code depends on. The
end-to-end tests run the real SmolLM2 model behind the real server: with its
own template, and with the Qwen3 template (which renders tools) for tool use.
The model is tiny, so they check protocol structure, not what it says.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import httpx2 as httpx
import pytest

from lucebox.api import anthropic as api
from lucebox.api.common import TEXT_ONLY, ServerContext
from lucebox.chat.events import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from lucebox.chat.run import Usage
from lucebox.chat.template import ChatTemplate
from lucebox.http import HttpError

QWEN3_TEMPLATE = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
BILLING = "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=7f3e9;"
IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."
TODO_NAG = ("<system-reminder>\nThis is a reminder that your todo list is currently empty. DO NOT mention this to the "
            "user explicitly because they are already aware.\n</system-reminder>")
MALWARE_NAG = ("\n\n<system-reminder>\nWhenever you read a file, you should consider whether it would be considered "
               "malware. You CAN and SHOULD provide analysis of malware, what it is doing. But you MUST refuse to "
               "improve or augment the code.\n</system-reminder>\n")
CLAUDE_MD = "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\n" \
            "Always use tabs.\n</system-reminder>"
WEATHER = {"name": "get_weather", "description": "Get the weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY_BODY = {"temperature": 0.0}
GREEDY = {"extra_body": GREEDY_BODY}  # this SDK version has no `temperature` argument


def ctx(raw_system: bool = False, raw_user: bool = False) -> ServerContext:
    return ServerContext(model_id="test-model", n_ctx=4096, raw_system=raw_system, raw_user=raw_user)


def parse(body: dict, **flags: bool):
    return api.parse_request(ctx(**flags), body)


def user(content) -> dict:
    return {"role": "user", "content": content}


# ----- SSE invariants ----------------------------------------------------------------------


def check_stream(frames: list[tuple[str, dict]]) -> None:
    """What every Anthropic stream must satisfy (Claude Code breaks on each of these)."""
    assert frames[0][0] == "message_start"
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["id"].startswith("msg_")
    assert set(start["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                   "cache_creation_input_tokens"}
    assert start["usage"]["output_tokens"] == 0
    assert frames[1][0] == "ping"
    next_index, open_index, kind, last_delta = 0, None, None, None
    for name, data in frames:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None, "a block started while another is open"
            assert data["index"] == next_index, "block indices must be consecutive from 0"
            open_index, kind, last_delta = next_index, data["content_block"]["type"], None
            next_index += 1
            block = data["content_block"]
            assert block == {"text": {"type": "text", "text": ""},
                             "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                             "tool_use": {"type": "tool_use", "id": block.get("id"), "name": block.get("name"),
                                          "input": {}}}[kind]
            if kind == "tool_use":
                assert block["id"].startswith("toolu_") and block["name"]
        elif name == "content_block_delta":
            assert data["index"] == open_index, "delta outside its block"
            delta = data["delta"]
            allowed = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                       "tool_use": {"input_json_delta"}}[kind]
            assert delta["type"] in allowed, f"{delta['type']} inside a {kind} block"
            if delta["type"] != "signature_delta":
                assert delta[{"text_delta": "text", "thinking_delta": "thinking",
                              "input_json_delta": "partial_json"}[delta["type"]]], "empty delta"
            last_delta = delta["type"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            if kind == "thinking":
                assert last_delta == "signature_delta", "signature_delta must come before a thinking block stops"
            open_index = None
    names = [n for n, _ in frames if n != "ping"]
    if names[-1] == "message_stop":
        assert names[-2] == "message_delta" and open_index is None
        assert names.count("message_delta") == 1
    else:
        assert names[-1] == "error"


def render(events: list, usage: Usage | None = None) -> list[tuple[str, dict]]:
    usage = usage or Usage(prompt_tokens=10, completion_tokens=5)
    r = api.StreamRenderer("msg_test", "m")
    frames = r.start(usage)
    for ev in events:
        frames += r.finish(ev, usage) if isinstance(ev, Finish) else r.push(ev)
    check_stream(frames)
    return frames


def blocks_of(frames: list[tuple[str, dict]]) -> list[dict]:
    """Accumulate frames into content blocks, as a client does."""
    blocks: list[dict] = []
    for name, data in frames:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"], _json=""))
        elif name == "content_block_delta":
            b, d = blocks[data["index"]], data["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] += d["signature"]
            else:
                b["_json"] += d["partial_json"]
    for b in blocks:
        raw = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = json.loads(raw) if raw else {}
    return blocks


def names(frames) -> list[str]:
    return [n for n, _ in frames]


# ----- renderer (pure) -----------------------------------------------------------------------


def test_text_stream_is_one_block_and_matches_the_json_body() -> None:
    events = [TextDelta("Hel"), TextDelta(""), TextDelta("lo"), Finish("stop")]
    frames = render(events, Usage(prompt_tokens=12, completion_tokens=3))
    assert names(frames) == ["message_start", "ping", "content_block_start", "content_block_delta",
                             "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 12, "output_tokens": 3, "cache_read_input_tokens": 0,
                              "cache_creation_input_tokens": 0}
    body = api.message_body("msg_x", "m", events[:-1], events[-1], Usage(prompt_tokens=12, completion_tokens=3))
    assert body["content"] == blocks_of(frames) == [{"type": "text", "text": "Hello"}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None


def test_thinking_then_text_has_signature_delta_before_the_thinking_block_stops() -> None:
    events = [ReasoningDelta("Let me "), ReasoningDelta("think."), TextDelta("Answer."), Finish("stop")]
    frames = render(events)
    assert names(frames)[2:9] == ["content_block_start", "content_block_delta", "content_block_delta",
                                  "content_block_delta", "content_block_stop", "content_block_start",
                                  "content_block_delta"]
    assert frames[5][1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert [f[1]["index"] for f in frames if f[0].startswith("content_block")] == [0, 0, 0, 0, 0, 1, 1, 1]
    expected = [{"type": "thinking", "thinking": "Let me think.", "signature": ""}, {"type": "text", "text": "Answer."}]
    assert blocks_of(frames) == expected
    assert api.message_body("msg_x", "m", events[:-1], events[-1], Usage())["content"] == expected


def test_thinking_that_runs_into_the_length_limit_still_gets_its_signature() -> None:
    frames = render([ReasoningDelta("hmm"), Finish("length")])
    assert names(frames)[-5:] == ["content_block_delta", "content_block_delta", "content_block_stop",
                                  "message_delta", "message_stop"]
    assert frames[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_tool_call_pieces_stream_in_one_block() -> None:
    pieces = ['{"city": "', 'Par', 'is"', '}']
    args = "".join(pieces)
    events = [TextDelta("Checking."), ToolCallStart(0, "call_abc123", "get_weather"),
              *[ToolCallArgsDelta(0, p) for p in pieces], ToolCallArgsDelta(0, ""),
              ToolCallEnd(0, "call_abc123", "get_weather", args), Finish("tool_calls")]
    frames = render(events)
    starts = [d for n, d in frames if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert starts[1]["content_block"]["id"] == "toolu_abc123"
    json_pieces = [d["delta"]["partial_json"] for n, d in frames if n == "content_block_delta" and d["index"] == 1]
    assert json_pieces == pieces
    assert frames[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    body = api.message_body("msg_x", "m", events[:-1], events[-1], Usage())
    assert body["content"] == blocks_of(frames)
    assert body["content"][1] == {"type": "tool_use", "id": "toolu_abc123", "name": "get_weather",
                                  "input": {"city": "Paris"}}


def test_two_tool_calls_are_two_blocks() -> None:
    events = [ToolCallStart(0, "call_a", "get_weather"), ToolCallArgsDelta(0, '{"city": "Oslo"}'),
              ToolCallEnd(0, "call_a", "get_weather", '{"city": "Oslo"}'),
              ToolCallStart(1, "call_b", "get_time"), ToolCallEnd(1, "call_b", "get_time", '{"tz": "UTC"}'),
              Finish("tool_calls")]
    frames = render(events)
    blocks = blocks_of(frames)
    assert [(b["id"], b["input"]) for b in blocks] == [("toolu_a", {"city": "Oslo"}), ("toolu_b", {"tz": "UTC"})]
    # the second call's arguments came whole with its end: sent as one piece
    assert sum(1 for n, d in frames if n == "content_block_delta" and d["index"] == 1) == 1
    assert api.message_body("msg_x", "m", events[:-1], events[-1], Usage())["content"] == blocks


def test_max_tokens_and_stop_sequence() -> None:
    frames = render([TextDelta("abc"), Finish("length")])
    assert frames[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    frames = render([TextDelta("1, 2, "), Finish("stop_sequence", "3")])
    assert frames[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "3"}
    body = api.message_body("msg_x", "m", [TextDelta("1, 2, ")], Finish("stop_sequence", "3"), Usage())
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "3")


def test_error_mid_stream_is_an_error_event() -> None:
    frames = render([TextDelta("partial"), Finish("error")])
    assert names(frames)[-1] == "error" and "message_stop" not in names(frames)
    err = frames[-1][1]
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and err["error"]["message"]
    assert api.StreamRenderer("msg_x", "m").error("boom") == (
        "error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})


def test_empty_stream_has_no_blocks() -> None:
    frames = render([TextDelta(""), Finish("stop")])
    assert names(frames) == ["message_start", "ping", "message_delta", "message_stop"]


def test_usage_counts_cached_prompt_tokens_as_cache_reads() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=64)
    assert api.usage_object(usage) == {"input_tokens": 36, "output_tokens": 7, "cache_read_input_tokens": 64,
                                       "cache_creation_input_tokens": 0}
    frames = render([TextDelta("x"), Finish("stop")], usage)
    assert frames[0][1]["message"]["usage"]["output_tokens"] == 0
    assert frames[-2][1]["usage"]["cache_read_input_tokens"] == 64


def test_tool_event_outside_its_block_is_a_bug() -> None:
    r = api.StreamRenderer("msg_x", "m")
    r.start(Usage())
    with pytest.raises(RuntimeError):
        r.push(ToolCallArgsDelta(0, "{}"))


def test_tool_ids_round_trip() -> None:
    assert api.tool_use_id("call_0123456789abcdef01234567") == "toolu_0123456789abcdef01234567"
    assert api.call_id("toolu_0123456789abcdef01234567") == "call_0123456789abcdef01234567"
    assert api.call_id("toolu_01AbC") == "call_01AbC"
    assert api.call_id("other-id") == "other-id"


# ----- parsing (pure) ------------------------------------------------------------------------


def test_system_blocks_billing_header_and_identity_are_stripped() -> None:
    body = {"system": [{"type": "text", "text": BILLING}, {"type": "text", "text": IDENTITY,
                                                           "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "\nYou are an interactive CLI tool.\nBe brief."}],
            "messages": [user("hi")]}
    req = parse(body)
    assert req.messages[0] == {"role": "system", "content": "You are an interactive CLI tool.\nBe brief."}
    raw = parse(body, raw_system=True)
    assert raw.messages[0]["content"] == f"{BILLING}\n{IDENTITY}\n\nYou are an interactive CLI tool.\nBe brief."
    assert parse({"system": BILLING + "\nBe kind.", "messages": [user("hi")]}).messages[0]["content"] == "Be kind."
    only_noise = parse({"system": [{"type": "text", "text": BILLING}], "messages": [user("hi")]})
    assert only_noise.messages == [{"role": "user", "content": "hi"}]
    # a billing header that is not at the start of a line is ordinary text
    assert "x-anthropic-billing-header:" in parse({"system": "see x-anthropic-billing-header: docs",
                                                   "messages": [user("hi")]}).messages[0]["content"]


def test_every_block_kind() -> None:
    body = {"messages": [
        user([{"type": "text", "text": "Weather in Paris and Oslo?", "cache_control": {"type": "ephemeral"}}]),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "sig=="},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_aaa", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_bbb", "name": "get_weather", "input": {"city": "Oslo"}}]},
        user([{"type": "tool_result", "tool_use_id": "toolu_aaa", "content": "18C"},
              {"type": "tool_result", "tool_use_id": "toolu_bbb", "is_error": True,
               "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "retry later"}]},
              {"type": "text", "text": "Thanks."}]),
    ]}
    req = parse(body)
    assert req.messages == [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "call_aaa", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_bbb", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_aaa", "content": "18C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_bbb", "content": "Error: timeout\nretry later", "name": "get_weather"},
        {"role": "user", "content": "Thanks."},
    ]
    # and the Qwen3 template renders it: calls, results (the error one flagged), the echoed reasoning
    text = ChatTemplate(QWEN3_TEMPLATE.read_text()).render(req.messages, tools=None)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nError: timeout\nretry later\n</tool_response>" in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_thinking_echoed_back_reaches_the_template() -> None:
    req = parse({"messages": [user("2+2?"), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Add them.", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+2"}}]},
        user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}])]})
    text = ChatTemplate(QWEN3_TEMPLATE.read_text()).render(req.messages)
    assert "<think>\nAdd them.\n</think>" in text


@pytest.mark.parametrize("content", [
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
    [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}],
    [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
])
def test_images_and_documents_are_refused(content) -> None:
    with pytest.raises(HttpError) as exc:
        parse({"messages": [user(content)]})
    assert exc.value.status == 400 and TEXT_ONLY in exc.value.message


def test_server_tools_and_server_blocks_are_dropped(caplog) -> None:
    body = {"tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                      {"type": "bash_20250124", "name": "bash"},
                      {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                      {"type": "custom", "name": "lookup", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "web_search"},
            "messages": [user("hi"), {"role": "assistant", "content": [
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                {"type": "text", "text": "Found it."}]}, user("ok")]}
    with caplog.at_level("INFO", logger="lucebox.api.anthropic"):
        req = parse(body)
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "lookup"]
    assert req.tools[0] == {"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}
    assert req.tool_choice == "auto"  # it named a dropped server tool
    assert req.messages[1] == {"role": "assistant", "content": "Found it."}
    dropped = [r.getMessage() for r in caplog.records if "cannot run locally" in r.getMessage()]
    assert len(dropped) == 1 and "web_search (web_search_20250305)" in dropped[0]


@pytest.mark.parametrize("choice, expected", [
    (None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"name": "get_weather"}),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
])
def test_tool_choice(choice, expected) -> None:
    assert parse({"tools": [WEATHER], "tool_choice": choice, "messages": [user("hi")]}).tool_choice == expected


def test_thinking_and_sampling_fields() -> None:
    req = parse({"messages": [user("hi")], "thinking": {"type": "enabled", "budget_tokens": 2048},
                 "max_tokens": 77, "stop_sequences": ["\n\nHuman:", ""], "temperature": 0.5, "top_p": 0.8,
                 "top_k": 20, "metadata": {"user_id": "u"}, "stream": True, "model": "claude-sonnet-4-5"})
    assert (req.enable_thinking, req.thinking_budget) == (True, 2048)
    assert (req.max_tokens, req.stop, req.stream, req.model) == (77, ["\n\nHuman:"], True, "claude-sonnet-4-5")
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (0.5, 0.8, 20)
    assert parse({"messages": [user("hi")], "thinking": {"type": "disabled"}}).enable_thinking is False
    adaptive = parse({"messages": [user("hi")], "thinking": {"type": "adaptive"}})
    assert (adaptive.enable_thinking, adaptive.thinking_budget) == (None, None)
    missing = parse({"messages": [user("hi")]})
    assert (missing.max_tokens, missing.model, missing.enable_thinking) == (None, "test-model", None)


@pytest.mark.parametrize("body, field", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [user([{"text": "no type"}])]}, "messages[0].content[0].type"),
    ({"messages": [user([{"type": "video"}])]}, "messages[0].content[0].type"),
    ({"messages": [user([{"type": "tool_result", "content": "x"}])]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [user([{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}])]},
     "messages[0].content[0].is_error"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages[0].content[0].input"),
    ({"messages": [user("hi")], "system": 5}, "system"),
    ({"messages": [user("hi")], "tools": [{"description": "no name"}]}, "tools[0].name"),
    ({"messages": [user("hi")], "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"messages": [user("hi")], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": [user("hi")], "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"messages": [user("hi")], "thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
    ({"messages": [user("hi")], "max_tokens": "10"}, "max_tokens"),
    ({"messages": [user("hi")], "stop_sequences": [1]}, "stop_sequences"),
])
def test_bad_input_names_the_field(body, field) -> None:
    with pytest.raises(HttpError) as exc:
        parse(body)
    assert exc.value.status == 400 and f"'{field}'" in exc.value.message


def test_boilerplate_reminders_are_stripped_unless_raw_user() -> None:
    body = {"messages": [user([{"type": "text", "text": CLAUDE_MD}, {"type": "text", "text": TODO_NAG},
                               {"type": "text", "text": "Fix the bug."}]),
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_r", "name": "Read",
                                                            "input": {"file_path": "a.py"}}]},
                         user([{"type": "tool_result", "tool_use_id": "toolu_r",
                                "content": "1\tprint('hi')" + MALWARE_NAG}])]}
    req = parse(body)
    assert req.messages[0]["content"] == CLAUDE_MD + "\nFix the bug."
    assert req.messages[2]["content"] == "1\tprint('hi')"
    raw = parse(body, raw_user=True)
    assert raw.messages[0]["content"] == "\n".join([CLAUDE_MD, TODO_NAG, "Fix the bug."])
    assert raw.messages[2]["content"] == "1\tprint('hi')" + MALWARE_NAG
    # a user turn that held nothing but a nag stays a (now empty) turn, so the roles keep alternating
    assert parse({"messages": [user(TODO_NAG)]}).messages == [{"role": "user", "content": ""}]


def test_system_messages_inside_messages_are_folded() -> None:
    req = parse({"system": "Main.", "messages": [
        {"role": "system", "content": "Lead note."}, user("hi"),
        {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /w"}]},
        {"role": "assistant", "content": "hello"}, user("bye"), user([{"type": "text", "text": "really"}])]})
    assert req.messages == [
        {"role": "system", "content": "Main.\nLead note."},
        {"role": "user", "content": "hi\n\n<system-reminder>\n# Environment\ncwd: /w\n</system-reminder>"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye\n\nreally"},
    ]


# ----- end to end: the SmolLM2 server ----------------------------------------------------------


@pytest.fixture(scope="module")
def client(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key="x", max_retries=0)


def sse(raw: bytes) -> list[tuple[str, dict]]:
    frames = []
    for chunk in raw.decode("utf-8").split("\n\n"):
        if not chunk.strip():
            continue
        event, data = None, []
        for line in chunk.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        frames.append((event, json.loads("\n".join(data))))
    return frames


def post_stream(url: str, body: dict) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    with httpx.stream("POST", url + "/v1/messages?beta=true", json={**body, "stream": True}, timeout=60,
                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
                      ) as resp:
        raw = resp.read()
    return resp, sse(raw)


HAIKU = [user("Write a short poem about the sea.")]


def test_create_non_stream(client, live_server) -> None:
    msg = client.messages.create(model="claude-test", max_tokens=12, messages=HAIKU, **GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-test"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 12
    assert msg.usage.cache_read_input_tokens is not None and msg.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model="claude-test", messages=HAIKU)
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    # the raw body carries exactly the documented fields
    raw = httpx.post(live_server.url + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": HAIKU}).json()
    assert set(raw) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert set(raw["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                 "cache_creation_input_tokens"}


def test_stream_with_the_sdk_and_on_the_wire(client, live_server) -> None:
    with client.messages.stream(model="claude-test", max_tokens=12, messages=HAIKU, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    plain = client.messages.create(model="claude-test", max_tokens=12, messages=HAIKU, **GREEDY)
    assert plain.content[0].text == text and plain.stop_reason == final.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model="m", messages=HAIKU).input_tokens
    resp, frames = post_stream(live_server.url, {"model": "m", "max_tokens": 12, "messages": HAIKU, **GREEDY_BODY})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    check_stream(frames)
    assert "".join(d["delta"]["text"] for n, d in frames if n == "content_block_delta") == text


def test_a_too_long_stop_sequence_is_a_400_in_anthropic_shape(client) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               stop_sequences=["x" * 100_000])
    assert e.value.body["type"] == "error" and "stop_sequences" in e.value.body["error"]["message"]


def test_stop_sequence(client) -> None:
    free = client.messages.create(model="m", max_tokens=16, messages=HAIKU, **GREEDY).content[0].text
    words = re.findall(r"[A-Za-z]{3,}", free)
    assert len(words) >= 2, free
    stop = words[1]
    msg = client.messages.create(model="m", max_tokens=16, messages=HAIKU, stop_sequences=["@@never@@", stop],
                                 **GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    text = msg.content[0].text if msg.content else ""
    assert stop not in text and free.startswith(text)
    with client.messages.stream(model="m", max_tokens=16, messages=HAIKU, stop_sequences=[stop], **GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens(client) -> None:
    msg = client.messages.create(model="m", max_tokens=3, messages=HAIKU, **GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    with client.messages.stream(model="m", max_tokens=3, messages=HAIKU, **GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3


def test_max_tokens_missing_uses_the_default(live_server) -> None:
    resp = httpx.post(live_server.url + "/v1/messages",
                      json={"model": "m", "messages": [user("Say hi.")], "stop_sequences": [".", " "], **GREEDY_BODY},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["stop_reason"] in ("end_turn", "stop_sequence", "max_tokens")


def test_image_is_refused_in_anthropic_error_shape(client) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=4, messages=[user([image, {"type": "text", "text": "?"}])])
    assert exc.value.status_code == 400
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    assert TEXT_ONLY in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=[user([image])])


def test_prompt_too_long_uses_anthropic_wording(client, live_server) -> None:
    n_ctx = live_server.ctx.n_ctx
    long = [user("lorem ipsum " * n_ctx)]
    n = client.messages.count_tokens(model="m", messages=long).input_tokens
    assert n > n_ctx
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=4, messages=long)
    assert exc.value.body["error"]["message"] == f"prompt is too long: {n} tokens > {n_ctx - 1} maximum"


def test_count_tokens_follows_the_system_prompt_clean_up(client, live_server) -> None:
    def count(system) -> int:
        return client.messages.count_tokens(model="m", system=system, messages=HAIKU).input_tokens

    main = [{"type": "text", "text": "You are a poet.", "cache_control": {"type": "ephemeral"}}]
    clean = count(main)
    assert count([{"type": "text", "text": BILLING}, *main]) == clean
    assert count([{"type": "text", "text": BILLING.replace("7f3e9", "0c1d2")}, *main]) == clean
    assert count([{"type": "text", "text": IDENTITY}, *main]) == clean
    live_server.ctx.raw_system = True
    try:
        assert count([{"type": "text", "text": BILLING}, *main]) > clean
    finally:
        live_server.ctx.raw_system = False


def test_count_tokens_is_not_queued_behind_generation(client, live_server) -> None:
    body = {"model": "m", "max_tokens": 24, "messages": [user("Count from 1 to 100.")], **GREEDY_BODY, "stream": True}
    answered_at = None
    deltas_after = 0
    with httpx.stream("POST", live_server.url + "/v1/messages", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line == "event: content_block_delta":
                if answered_at is None:
                    t = time.monotonic()
                    assert client.messages.count_tokens(model="m", messages=HAIKU).input_tokens > 0
                    answered_at = time.monotonic() - t
                else:
                    deltas_after += 1
    assert answered_at is not None and answered_at < 2.0
    assert deltas_after > 0, "count_tokens should answer while the generation is still running"


def test_pings_while_waiting_for_the_first_token(client, live_server, monkeypatch) -> None:
    monkeypatch.setattr(api, "PING_INTERVAL", 0.005)
    long = [user("Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 40)]
    _, frames = post_stream(live_server.url, {"model": "m", "max_tokens": 2, "messages": long, **GREEDY_BODY})
    check_stream(frames)
    first_block = names(frames).index("content_block_start")
    assert names(frames)[2:first_block].count("ping") >= 1, "no ping during the prefill"
    # pings between deltas too: the SDK must still assemble the message
    with client.messages.stream(model="m", max_tokens=6, messages=HAIKU, **GREEDY) as s:
        final = s.get_final_message()
    plain = client.messages.create(model="m", max_tokens=6, messages=HAIKU, **GREEDY)
    assert final.content[0].text == plain.content[0].text and final.usage.output_tokens == 6


def _wait_aborted(live_server, before: int) -> None:
    eng = live_server.ctx.engine
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if eng.num_disconnects > before and eng.engine.blocks_in_use == 0 and not eng.num_running:
            return
        time.sleep(0.05)
    raise AssertionError(f"generation not aborted: disconnects {eng.num_disconnects} (was {before}), "
                         f"kv blocks used {eng.engine.blocks_in_use}")


def _raw_request(live_server, body: dict) -> socket.socket:
    url = urlsplit(live_server.url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_generation(live_server, stream) -> None:
    before = live_server.ctx.engine.num_disconnects
    body = {"model": "m", "max_tokens": 500, "messages": [user("Count from 1 to 300, separated by commas.")],
            "stream": stream, **GREEDY_BODY}
    sock = _raw_request(live_server, body)
    if stream:
        buf = b""
        while b"content_block_delta" not in buf:
            chunk = sock.recv(65536)
            assert chunk, buf
            buf += chunk
    else:
        time.sleep(0.5)
    sock.close()
    _wait_aborted(live_server, before)


# ----- end to end: tools, with the Qwen3 template ----------------------------------------------


@pytest.fixture(scope="module")
def qwen3_server(smollm2_path):
    from tests.live_server import start_server

    server = start_server(smollm2_path, chat_template_file=QWEN3_TEMPLATE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3(qwen3_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen3_server.url, api_key="x", max_retries=0)


ASK = [user("What is the weather in Paris?")]
FORCE = {"type": "tool", "name": "get_weather"}


def test_tool_use_round_trip(qwen3) -> None:
    msg = qwen3.messages.create(model="m", max_tokens=24, tools=[WEATHER], tool_choice=FORCE, messages=ASK, **GREEDY)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls, msg.content
    call = calls[0]
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert call.name == "get_weather" and re.fullmatch(r"toolu_[0-9a-f]{24}", call.id)
    assert isinstance(call.input, dict)
    assert msg.stop_reason in ("tool_use", "max_tokens")
    # send the call back with its result, then once more as an error: both render and run
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]}]
    counts = []
    for is_error in (False, True):
        result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny", "is_error": is_error}
        turn = [*history, user([result])]
        reply = qwen3.messages.create(model="m", max_tokens=4, tools=[WEATHER], messages=turn, **GREEDY)
        assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
        counts.append(qwen3.messages.count_tokens(model="m", tools=[WEATHER], messages=turn).input_tokens)
        assert counts[-1] == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counts[1] > counts[0], "the error flag reaches the prompt"


def test_tool_use_stream_is_one_block_per_call(qwen3, qwen3_server) -> None:
    with qwen3.messages.stream(model="m", max_tokens=24, tools=[WEATHER], tool_choice=FORCE, messages=ASK,
                               **GREEDY) as s:
        final = s.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    body = {"model": "m", "max_tokens": 24, "tools": [WEATHER], "tool_choice": FORCE, "messages": ASK, **GREEDY_BODY}
    _, frames = post_stream(qwen3_server.url, body)
    check_stream(frames)
    starts = [d["content_block"] for n, d in frames if n == "content_block_start"]
    assert sum(b["type"] == "tool_use" for b in starts) == len(calls)
    pieces = [d["delta"]["partial_json"] for n, d in frames
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta" and d["index"] == 0]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == calls[0].input
    count = qwen3.messages.count_tokens(model="m", tools=[WEATHER], tool_choice=FORCE, messages=ASK).input_tokens
    assert count == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_claude_code_shaped_request(qwen3, qwen3_server) -> None:
    system = [{"type": "text", "text": BILLING}, {"type": "text", "text": IDENTITY,
                                                  "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "\nYou are an interactive CLI tool that helps users with software tasks.",
               "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Bash", "description": "Run a shell command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"], "additionalProperties": False,
                               "$schema": "http://json-schema.org/draft-07/schema#"}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}]
    messages = [
        user([{"type": "text", "text": CLAUDE_MD}, {"type": "text", "text": TODO_NAG},
              {"type": "text", "text": "List the files here.", "cache_control": {"type": "ephemeral"}}]),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use ls.", "signature": ""},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
            {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "Bash", "input": {"command": "ls"}}]},
        user([{"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
               "content": [{"type": "text", "text": "README.md\nsetup.py"}]}]),
        {"role": "system", "content": "<total_tokens>1200 tokens left</total_tokens>"},
    ]
    with qwen3.messages.stream(model="claude-sonnet-4-6", max_tokens=12, system=system, tools=tools,
                               messages=messages, metadata={"user_id": "user_abc_account_x_session_y"},
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 1.0},
                               extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
                               extra_query={"beta": "true"}) as s:
        final = s.get_final_message()
    assert final.model == "claude-sonnet-4-6"
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.output_tokens > 0
    counted = qwen3.messages.count_tokens(model="m", system=system, tools=tools, messages=messages,
                                          thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    assert counted == final.usage.input_tokens + final.usage.cache_read_input_tokens
    nonce = [{"type": "text", "text": BILLING.replace("cch=7f3e9", "cch=00000")}, *system[1:]]
    assert qwen3.messages.count_tokens(model="m", system=nonce, tools=tools, messages=messages,
                                       thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens == counted


def test_concurrent_streams_do_not_mix(qwen3, qwen3_server) -> None:
    results: dict[int, list] = {}

    def run(i: int) -> None:
        _, frames = post_stream(qwen3_server.url, {"model": "m", "max_tokens": 8, "messages": [user(f"Say {i}.")],
                                                   **GREEDY_BODY})
        results[i] = frames

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2]
    for frames in results.values():
        check_stream(frames)
