"""OpenAI Responses (`/v1/responses`, what Codex speaks): parsing, the pure event renderer, and end to end.

1. Renderer: hand-made engine event sequences through `ResponseRenderer`,
   every produced event validated against the openai SDK's own types.
2. Parsing: every input item kind and the spec's "Breaks Codex" list, each
   checked to parse and to render through a real chat template.
3. End to end: the real `openai` SDK against the real server (SmolLM2 on CPU),
   with a real Codex system prompt; tools through the Qwen3 template.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import httpx2
import openai
import orjson
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from lucebox.api.common import TEXT_ONLY, ServerContext
from lucebox.api.openai_responses import (
    ResponseRenderer,
    _InputField,
    custom_input,
    parse_request,
)
from lucebox.chat.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from lucebox.chat.run import Usage, render_chat
from lucebox.chat.template import ChatTemplate
from lucebox.data import DATA_DIR
from lucebox.http import HttpError

ROOT = Path(__file__).resolve().parents[1]
QWEN3_TEMPLATE = ROOT / "tests/data/templates/Qwen-Qwen3-0.6B.jinja"
CODEX_PROMPT = DATA_DIR / "agent_prompts/codex_gpt5_codex.md"
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch. FREEFORM: no JSON.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'}}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "image_generation"}, {"type": "mcp", "server_label": "x", "server_url": "http://x"}]


# ===================================================================================
# 1. The renderer
# ===================================================================================


def render(events, usage=None, **kw):
    """All frames of one stream, and the renderer (for its final response)."""
    r = ResponseRenderer(model="test-model", **kw)
    frames = r.start()
    for ev in events:
        frames += r.finish(ev, usage) if isinstance(ev, Finish) else r.push(ev)
    return frames, r


def check_stream(frames: list[dict]) -> dict:
    """The invariants every stream must hold; returns the terminal event's response."""
    seqs = [f["sequence_number"] for f in frames]
    assert seqs == list(range(len(frames))), "sequence_number must start at 0 and grow by one"
    for f in frames:
        assert isinstance(f["type"], str)
        STREAM_EVENT.validate_python(f)  # the SDK's own types, strictly: every required field present
    assert [f["type"] for f in frames[:2]] == ["response.created", "response.in_progress"]
    for f in frames[:2]:
        assert f["response"]["status"] == "in_progress" and f["response"]["output"] == []
    terminals = [f for f in frames if f["type"] in TERMINAL]
    assert len(terminals) == 1 and terminals[0] is frames[-1], "exactly one terminal event, last"
    final = frames[-1]["response"]
    Response.model_validate(final)
    output = final["output"]

    added = {f["output_index"]: f["item"] for f in frames if f["type"] == "response.output_item.added"}
    done = {f["output_index"]: f["item"] for f in frames if f["type"] == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(output)))
    for idx, item in enumerate(output):
        assert added[idx]["id"] == done[idx]["id"] == item["id"]
        assert done[idx] == item, "output_item.done must equal the final response's item"
        mine = [f for f in frames if f.get("output_index") == idx and "item_id" in f]
        assert all(f["item_id"] == item["id"] for f in mine)
        first = frames.index(next(f for f in frames if f.get("output_index") == idx))
        last = max(i for i, f in enumerate(frames) if f.get("output_index") == idx)
        assert frames[first]["type"] == "response.output_item.added"
        assert frames[last]["type"] == "response.output_item.done"
        between = {f.get("output_index") for f in frames[first:last + 1]}
        assert between == {idx}, "items do not interleave"

        kinds = [f["type"] for f in mine]
        if item["type"] == "message":
            assert kinds[0] == "response.content_part.added" and kinds[-1] == "response.content_part.done"
            assert all(f["content_index"] == 0 for f in mine)
            deltas = "".join(f["delta"] for f in mine if f["type"] == "response.output_text.delta")
            text_done = next(f for f in mine if f["type"] == "response.output_text.done")["text"]
            assert deltas == text_done == item["content"][0]["text"]
            assert item["content"][0] == {"type": "output_text", "text": text_done, "annotations": [], "logprobs": []}
        elif item["type"] == "reasoning":
            assert kinds[0] == "response.reasoning_summary_part.added"
            assert kinds[-1] == "response.reasoning_summary_part.done"
            deltas = "".join(f["delta"] for f in mine if f["type"] == "response.reasoning_summary_text.delta")
            assert item["summary"] == [{"type": "summary_text", "text": deltas}]
        elif item["type"] == "function_call":
            deltas = "".join(f["delta"] for f in mine if f["type"] == "response.function_call_arguments.delta")
            assert kinds[-1] == "response.function_call_arguments.done"
            assert deltas == mine[-1]["arguments"] == item["arguments"]
        elif item["type"] == "custom_tool_call":
            deltas = "".join(f["delta"] for f in mine if f["type"] == "response.custom_tool_call_input.delta")
            assert kinds[-1] == "response.custom_tool_call_input.done"
            assert deltas == mine[-1]["input"] == item["input"]
        else:
            raise AssertionError(f"unexpected item type {item['type']}")
    texts = [item["content"][0]["text"] for item in output if item["type"] == "message"]
    assert final["output_text"] == "".join(texts)
    return final


def call(index, name, pieces, call_id=None):
    call_id = call_id or new_call_id()
    return [ToolCallStart(index, call_id, name), *(ToolCallArgsDelta(index, p) for p in pieces),
            ToolCallEnd(index, call_id, name, "".join(pieces))]


def test_text_only():
    events = [TextDelta("Hel"), TextDelta(""), TextDelta("lo"), Finish("stop")]
    frames, r = render(events, Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4), response_id="resp_abc",
                       created_at=123)
    final = check_stream(frames)
    assert [f["type"] for f in frames] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert final["id"] == "resp_abc" and final["object"] == "response" and final["created_at"] == 123
    assert final["status"] == "completed" and final["error"] is None and final["incomplete_details"] is None
    assert final["model"] == "test-model"
    assert final["output_text"] == "Hello"
    msg = final["output"][0]
    assert msg["id"].startswith("msg_") and msg["role"] == "assistant" and msg["status"] == "completed"
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 13}
    assert r.response == final


def test_reasoning_then_text():
    frames, _ = render([ReasoningDelta("Let me "), ReasoningDelta("think."), TextDelta("Answer: 4"),
                        Finish("stop")], Usage(5, 9, 0, 4))
    final = check_stream(frames)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["id"].startswith("rs_")
    assert final["output"][0]["summary"] == [{"type": "summary_text", "text": "Let me think."}]
    assert final["output_text"] == "Answer: 4"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    kinds = [f["type"] for f in frames]
    assert kinds.index("response.reasoning_summary_part.done") < kinds.index("response.content_part.added")


def test_function_call_with_streamed_arguments():
    events = [TextDelta("Checking."), *call(0, "get_weather", ['{"city": ', '"Par', 'is"}'], "call_1"),
              Finish("tool_calls")]
    frames, _ = render(events)
    final = check_stream(frames)
    assert final["status"] == "completed"
    msg, fc = final["output"]
    assert msg["content"][0]["text"] == "Checking."
    assert fc["type"] == "function_call" and fc["id"].startswith("fc_") and fc["call_id"] == "call_1"
    assert fc["name"] == "get_weather" and json.loads(fc["arguments"]) == {"city": "Paris"}
    assert fc["status"] == "completed"
    pieces = [f["delta"] for f in frames if f["type"] == "response.function_call_arguments.delta"]
    assert pieces == ['{"city": ', '"Par', 'is"}']


def test_custom_tool_call_streams_the_decoded_input():
    patch = '*** Begin Patch\n*** Update File: a.py\n-print("x")\n+print("é 😀")\n*** End Patch'
    args = json.dumps({"input": patch})  # ASCII escapes, incl. a surrogate pair for the emoji
    pieces = [args[i:i + 3] for i in range(0, len(args), 3)]
    frames, _ = render([*call(0, "apply_patch", pieces), Finish("tool_calls")],
                       custom_tools=frozenset({"apply_patch"}))
    final = check_stream(frames)
    (item,) = final["output"]
    assert item["type"] == "custom_tool_call" and item["id"].startswith("ctc_") and item["input"] == patch
    assert "arguments" not in item
    kinds = {f["type"] for f in frames}
    assert "response.function_call_arguments.delta" not in kinds
    deltas = [f["delta"] for f in frames if f["type"] == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 10, "the input streams while it is written, not in one piece at the end"


def test_custom_tool_call_with_arguments_of_another_shape_keeps_them_whole():
    frames, _ = render([*call(0, "apply_patch", ['{"patch": ', '"x"}']), Finish("tool_calls")],
                       custom_tools=frozenset({"apply_patch"}))
    final = check_stream(frames)
    assert final["output"][0]["input"] == '{"patch": "x"}'


@pytest.mark.parametrize("step", [1, 2, 5])
def test_input_field_decoder(step):
    for value in ["plain", "a\\b\"c\nd\te", "é 😀 \\u0041", "x\\", ""]:
        for ensure_ascii in (True, False):
            text = json.dumps({"input": value}, ensure_ascii=ensure_ascii)
            f, out = _InputField(), ""
            for i in range(0, len(text), step):
                out += f.push(text[i:i + step])
            assert out == value and f.state == "end"
    f = _InputField()
    assert f.push('{"type": "x", "input": "y"}') == "" and f.state == "off"


def test_custom_input():
    assert custom_input('{"input": "a\\nb"}') == "a\nb"
    assert custom_input('{"input": {"k": 1}}') == '{"k": 1}'
    assert custom_input('{"other": "x"}') == '{"other": "x"}'
    assert custom_input("not json") == "not json"


def test_two_calls():
    events = [*call(0, "get_weather", ['{"city": "Paris"}']), *call(1, "get_weather", ['{"city": ', '"Rome"}']),
              Finish("tool_calls")]
    frames, _ = render(events)
    final = check_stream(frames)
    a, b = final["output"]
    assert (a["type"], b["type"]) == ("function_call", "function_call")
    assert a["id"] != b["id"] and a["call_id"] != b["call_id"]
    assert json.loads(b["arguments"]) == {"city": "Rome"}


def test_namespace_is_set_on_calls_of_namespaced_functions():
    frames, _ = render([*call(0, "lookup", ["{}"]), Finish("tool_calls")], namespaces={"lookup": "docs"})
    assert check_stream(frames)["output"][0]["namespace"] == "docs"


def test_length_gives_incomplete():
    frames, _ = render([ReasoningDelta("hmm"), TextDelta("The answer is"), Finish("length")], Usage(3, 8))
    final = check_stream(frames)
    assert frames[-1]["type"] == "response.incomplete"
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][-1]["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 8


@pytest.mark.parametrize("reason", ["error", "cancelled"])
def test_error_gives_failed(reason):
    frames, _ = render([TextDelta("partial"), Finish(reason)])
    final = check_stream(frames)
    assert frames[-1]["type"] == "response.failed"
    assert final["status"] == "failed" and final["error"]["code"] == "server_error" and final["error"]["message"]
    assert final["output"][0]["content"][0]["text"] == "partial"


def test_fail_inside_a_call_closes_it_and_ends_with_failed():
    r = ResponseRenderer(model="m")
    frames = r.start() + r.push(ToolCallStart(0, "call_9", "f")) + r.push(ToolCallArgsDelta(0, '{"a": '))
    frames += r.fail("internal server error")
    final = check_stream(frames)
    assert final["output"][0]["status"] == "incomplete" and final["error"]["message"] == "internal server error"
    assert r.fail("again") == []  # one terminal event, ever
    with pytest.raises(RuntimeError):
        r.push(TextDelta("late"))


@pytest.mark.parametrize("reason", ["stop", "stop_sequence", "tool_calls"])
def test_normal_finishes_complete(reason):
    frames, _ = render([TextDelta("ok"), Finish(reason, "END" if reason == "stop_sequence" else None)])
    assert check_stream(frames)["status"] == "completed"


def test_empty_generation_completes_with_no_output():
    frames, _ = render([TextDelta(""), ReasoningDelta(""), Finish("stop")])
    final = check_stream(frames)
    assert final["output"] == [] and final["output_text"] == ""


def test_text_call_text_gives_three_items_in_order():
    events = [TextDelta("a"), *call(0, "f", ["{}"]), TextDelta("b"), Finish("stop")]
    frames, _ = render(events)
    final = check_stream(frames)
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "message"]
    assert final["output_text"] == "ab"


def test_non_streaming_render_equals_stream_final():
    events = [ReasoningDelta("r"), TextDelta("t"), *call(0, "f", ['{"x": 1}'], "call_x"), Finish("tool_calls")]
    frames, _ = render(events, Usage(1, 2), response_id="resp_1", created_at=1)
    whole = ResponseRenderer(model="test-model", response_id="resp_1", created_at=1).render_all(events, Usage(1, 2))
    streamed = frames[-1]["response"]
    strip = lambda resp: [{k: v for k, v in item.items() if k != "id"} for item in resp["output"]]  # noqa: E731
    assert strip(whole) == strip(streamed)
    assert whole["usage"] == streamed["usage"] and whole["status"] == streamed["status"]


def test_events_are_snapshots():
    r = ResponseRenderer(model="m")
    created = r.start()[0]
    r.push(TextDelta("x"))
    r.finish(Finish("stop"))
    assert created["response"]["output"] == [] and created["response"]["status"] == "in_progress"


# ===================================================================================
# 2. Parsing
# ===================================================================================

CTX = ServerContext(model_id="local-model", n_ctx=8192)


def parse(body):
    return parse_request({"model": "m", **body}, CTX)


def qwen3_render(parsed) -> str:
    """The prompt a real template renders (so a parse that a template would refuse fails here too)."""
    template = ChatTemplate(QWEN3_TEMPLATE.read_text())
    return template.render(parsed.chat.messages, tools=parsed.chat.tools, add_generation_prompt=True)


def bad(body, *needles):
    with pytest.raises(HttpError) as exc:
        parse(body)
    assert exc.value.status == 400
    for needle in needles:
        assert needle in exc.value.message
    return exc.value


def test_string_input_and_instructions():
    p = parse({"input": "Hello", "instructions": "Be brief."})
    assert p.chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert p.echo["instructions"] == "Be brief." and p.chat.model == "m" and not p.chat.stream


def test_developer_and_several_system_items_merge_into_one_system_message():
    p = parse({"instructions": "I", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D1"}]},
        {"type": "message", "role": "user", "content": "U"},
        {"type": "message", "role": "system", "content": "S"},
        {"role": "developer", "content": "D2"},
    ]})
    assert p.chat.messages == [{"role": "system", "content": "I\n\nD1\n\nS\n\nD2"}, {"role": "user", "content": "U"}]
    qwen3_render(p)


def test_content_parts_and_empty_content():
    p = parse({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []},
                                                             {"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": []},
        {"role": "user", "content": [{"type": "input_text", "text": ""}]},
        {"role": "developer", "content": []},
    ]})
    assert p.chat.messages == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c\nno"},
                               {"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                               {"role": "user", "content": ""}]
    qwen3_render(p)


@pytest.mark.parametrize("part", [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                                  {"type": "input_file", "file_id": "file_1"}])
def test_images_and_files_are_refused(part):
    err = bad({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, part]}]}, TEXT_ONLY,
              "input[0].content[1]")
    assert err.param == "input[0].content[1]"
    bad({"input": [{"type": "function_call_output", "call_id": "c", "output": [part]}]}, TEXT_ONLY)


def test_function_calls_and_outputs():
    p = parse({"tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "two calls"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "21C"}]},
    ]})
    user, assistant, tool_a, tool_b = p.chat.messages
    assert assistant["role"] == "assistant" and assistant["content"] == "Checking."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_a", "call_b"], "consecutive calls share one turn"
    assert assistant["tool_calls"][0] == {"id": "call_a", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert tool_a == {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "18C"}
    assert tool_b["content"] == "21C" and tool_b["tool_call_id"] == "call_b"
    prompt = qwen3_render(p)
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert "<tool_response>\n21C\n</tool_response>" in prompt
    assert "two calls" not in prompt, "reasoning items are dropped from the prompt"


def test_a_call_without_assistant_text_opens_an_assistant_turn():
    p = parse({"input": [{"role": "user", "content": "x"},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                         {"type": "function_call", "call_id": "c2", "name": "f", "arguments": ""}]})
    roles = [m["role"] for m in p.chat.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert p.chat.messages[3]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_custom_tool_calls_and_outputs():
    p = parse({"tools": [APPLY_PATCH], "input": [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": "*** Begin Patch\n..."},
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"},
    ]})
    _, assistant, tool = p.chat.messages
    assert assistant["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                      "arguments": {"input": "*** Begin Patch\n..."}}
    assert tool == {"role": "tool", "tool_call_id": "call_p", "name": "apply_patch", "content": "Done!"}
    assert "Done!" in qwen3_render(p)


def test_reasoning_items_with_or_without_summary_are_dropped():
    p = parse({"input": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "reasoning", "id": "rs_2"},
        {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": None, "content": None},
        {"role": "user", "content": "hi"},
    ]})
    assert p.chat.messages == [{"role": "user", "content": "hi"}]


def test_assistant_items_without_status_or_type_are_messages():
    p = parse({"input": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                         {"type": "message", "role": "assistant", "id": "msg_1", "content": "again"}]})
    assert [m["role"] for m in p.chat.messages] == ["user", "assistant", "assistant"]


def test_hosted_items_are_dropped(caplog):
    with caplog.at_level(logging.INFO, logger="lucebox.api.openai_responses"):
        p = parse({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"},
                             {"role": "user", "content": "hi"}]})
    assert p.chat.messages == [{"role": "user", "content": "hi"}]
    assert "web_search_call" in caplog.text


def test_tools_function_custom_and_hosted(caplog):
    with caplog.at_level(logging.INFO, logger="lucebox.api.openai_responses"):
        p = parse({"input": "x", "tools": [WEATHER, APPLY_PATCH, *HOSTED]})
    names = [t["function"]["name"] for t in p.chat.tools]
    assert names == ["get_weather", "apply_patch"]
    assert p.chat.tools[0] == {"type": "function", "function": {"name": "get_weather",
                                                                "description": WEATHER["description"],
                                                                "parameters": WEATHER["parameters"]}}
    patch_fn = p.chat.tools[1]["function"]
    assert patch_fn["parameters"]["properties"]["input"]["type"] == "string"
    assert patch_fn["parameters"]["required"] == ["input"]
    assert "*** Begin Patch" in patch_fn["parameters"]["properties"]["input"]["description"], "grammar is shown"
    assert p.custom_tools == {"apply_patch"}
    assert [t["type"] for t in p.echo["tools"]] == ["function", "custom"]
    dropped = [r for r in caplog.records if "dropped tool" in r.getMessage()]
    assert len(dropped) == len(HOSTED)
    for tool in HOSTED:
        assert any(repr(tool["type"]) in r.getMessage() for r in dropped)
    assert "apply_patch" in qwen3_render(p)


def test_namespace_tools_are_offered_flat():
    p = parse({"input": "x", "tools": [{"type": "namespace", "name": "docs", "description": "d",
                                        "tools": [{"type": "function", "name": "lookup", "parameters": None}]}]})
    assert p.chat.tools[0]["function"]["name"] == "lookup" and p.namespaces == {"lookup": "docs"}


@pytest.mark.parametrize(("choice", "expected"), [
    (None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"name": "get_weather"}),
    ({"type": "custom", "name": "apply_patch"}, {"name": "apply_patch"}),
])
def test_tool_choice(choice, expected):
    p = parse({"input": "x", "tools": [WEATHER, APPLY_PATCH], "tool_choice": choice})
    assert p.chat.tool_choice == expected


def test_tool_choice_allowed_tools_narrows_the_offer():
    p = parse({"input": "x", "tools": [WEATHER, APPLY_PATCH], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}})
    assert p.chat.tool_choice == "required" and [t["function"]["name"] for t in p.chat.tools] == ["get_weather"]


def test_bad_tool_choices():
    bad({"input": "x", "tool_choice": "sometimes"}, "tool_choice")
    bad({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name")
    bad({"input": "x", "tool_choice": {"type": "web_search"}}, "web_search", "cannot run")


def test_generation_fields():
    p = parse({"input": "x", "max_output_tokens": 17, "temperature": 0.5, "top_p": 0.9, "stream": True,
               "reasoning": {"effort": "xhigh", "summary": "auto"}})
    assert p.chat.max_tokens == 17 and p.chat.params.temperature == 0.5 and p.chat.params.top_p == 0.9
    assert p.chat.stream and p.chat.reasoning_effort == "x-high"
    assert p.echo["reasoning"] == {"effort": "xhigh", "summary": "auto"} and p.echo["max_output_tokens"] == 17
    assert parse({"input": "x", "reasoning": {"effort": "minimal"}}).chat.reasoning_effort == "low"
    off = parse({"input": "x", "reasoning": {"effort": "none"}}).chat
    assert off.enable_thinking is False and off.reasoning_effort is None
    assert parse({"input": "x", "reasoning": None}).chat.reasoning_effort is None


def test_ignored_fields_are_accepted():
    p = parse({"input": "x", "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": False,
               "prompt_cache_key": "abc", "include": ["reasoning.encrypted_content"], "truncation": "auto",
               "service_tier": "auto", "user": "u", "text": {"format": {"type": "text"}, "verbosity": "low"},
               "stream_options": {"include_obfuscation": False}, "client_metadata": {"x": 1}})
    assert p.echo["store"] is False and p.echo["parallel_tool_calls"] is False and p.echo["metadata"] == {"k": "v"}


@pytest.mark.parametrize(("body", "needles"), [
    ({"input": "x", "previous_response_id": "resp_1"}, ("previous_response_id", "stateless")),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, ("item_reference", "stateless")),
    ({"input": "x", "background": True}, ("background",)),
    ({}, ("'input' is required",)),
    ({"input": 3}, ("'input' must be",)),
    ({"input": [{"type": "telepathy"}]}, ("input[0].type", "telepathy")),
    ({"input": [{"role": "robot", "content": "x"}]}, ("input[0].role",)),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, ("input[0].call_id",)),
    ({"input": [{"role": "user", "content": [{"type": "input_video"}]}]}, ("input[0].content[0].type",)),
    ({"input": "x", "max_output_tokens": 0}, ("max_output_tokens",)),
    ({"input": "x", "max_output_tokens": "9"}, ("max_output_tokens",)),
    ({"input": "x", "temperature": "hot"}, ("temperature",)),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, ("reasoning.effort",)),
    ({"input": "x", "tools": {"type": "function"}}, ("tools",)),
    ({"input": "x", "tools": [{"type": "function"}]}, ("tools[0].name",)),
    ({"input": "x", "instructions": ["a"]}, ("instructions",)),
    ({"input": "x", "n": 2}, ("'n'",)),
])
def test_bad_input_names_the_problem(body, needles):
    bad(body, *needles)


def codex_body(instructions: str, *, stream: bool = True) -> dict:
    """A request shaped like the ones Codex CLI sends (history included)."""
    return {
        "model": "gpt-5-codex", "instructions": instructions, "stream": stream, "store": False,
        "parallel_tool_calls": False, "tool_choice": "auto", "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1f2-session", "reasoning": {"effort": "medium", "summary": "auto"},
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
                   "strict": False, "parameters": {"type": "object", "properties": {
                       "command": {"type": "array", "items": {"type": "string"}},
                       "workdir": {"type": "string"}}, "required": ["command"], "additionalProperties": False}},
                  APPLY_PATCH, {"type": "web_search"}, {"type": "local_shell"}],
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
            {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_ls"},
            {"type": "function_call_output", "call_id": "call_ls", "output": "README.md\nsetup.py"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks, say ok"}]},
        ],
    }


def test_a_codex_request_parses_and_renders():
    p = parse_request(codex_body("You are Codex."), CTX)
    roles = [m["role"] for m in p.chat.messages]
    assert roles == ["system", "user", "user", "assistant", "tool", "assistant", "user"]
    assert p.chat.messages[0]["content"].startswith("You are Codex.\n\n<permissions instructions>")
    assert p.custom_tools == {"apply_patch"} and p.chat.stream
    prompt = qwen3_render(p)
    assert "README.md" in prompt and '"name": "shell"' in prompt


# ===================================================================================
# 3. End to end: the openai SDK against the real server
# ===================================================================================


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codex_prompt(live_server) -> str:
    if not CODEX_PROMPT.exists():
        pytest.skip(f"{CODEX_PROMPT} is not available")
    text = CODEX_PROMPT.read_text()
    n = len(live_server.ctx.prompt.tokenizer.encode(text, add_special=False))
    assert n < live_server.ctx.n_ctx - 512, "the Codex prompt must fit the context with room for the answer"
    return text


@pytest.fixture(scope="module")
def tool_server(smollm2_path):
    """The same model behind the Qwen3 template, which renders tools."""
    from tests.live_server import start_server

    server = start_server(smollm2_path, chat_template_file=QWEN3_TEMPLATE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return openai.OpenAI(base_url=tool_server.base_url, api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(server, body: dict) -> int:
    """What the server must count as input: the request rendered and tokenized independently of the run."""
    parsed = parse_request(body, server.ctx)
    text, _ = render_chat(server.ctx, server.ctx.prompt, parsed.chat)
    return len(server.ctx.prompt.tokenizer.encode(text, add_special=False))


def test_sdk_non_stream_with_codex_instructions(live_server, client, codex_prompt):
    r = client.responses.create(model="codex-local", instructions=codex_prompt, input="Say hello.",
                                max_output_tokens=8, store=False, reasoning={"effort": "medium", "summary": "auto"})
    assert isinstance(r, Response)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "codex-local"
    assert r.status in ("completed", "incomplete") and r.output and r.output[-1].type == "message"
    assert r.output_text and r.output_text == r.output[-1].content[0].text
    expected = prompt_tokens(live_server, {"instructions": codex_prompt, "input": "Say hello."})
    assert r.usage.input_tokens == expected > 1000
    assert 1 <= r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == codex_prompt


def test_sdk_max_output_tokens_gives_incomplete(client):
    r = client.responses.create(model="m", input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.max_output_tokens == 5

    events = list(client.responses.create(model="m", input="Write a long story about a dragon.",
                                          max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 5


def test_sdk_stream_typed_events(live_server, client):
    events = list(client.responses.create(model="m", instructions="You are a terse assistant.", input="Say hello.",
                                          max_output_tokens=12, stream=True))
    frames = [e.model_dump(mode="json", exclude_unset=True) for e in events]
    final = check_stream(frames)
    assert type(events[0]).__name__ == "ResponseCreatedEvent" and events[0].response.id == final["id"]
    assert any(type(e).__name__ == "ResponseTextDeltaEvent" for e in events)
    expected = prompt_tokens(live_server, {"instructions": "You are a terse assistant.", "input": "Say hello."})
    assert final["usage"]["input_tokens"] == expected
    assert 1 <= final["usage"]["output_tokens"] <= 12


def test_sdk_stream_helper_reaches_completed(client):
    if not hasattr(client.responses, "stream"):
        pytest.skip("this openai SDK has no responses.stream helper")
    # `stop` is not a Responses field; this server honours it, so the answer ends with a completed response.
    # Greedy (temperature 0): the default model answers "1. Red\n2. Blue\n3. Green", so the stop always fires.
    with client.responses.stream(model="m", input="Name three colors.", max_output_tokens=64, temperature=0,
                                 extra_body={"stop": ["Blue"]}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.status == "completed" and "Red" in final.output_text and "Blue" not in final.output_text


def test_sse_framing_on_the_wire(live_server):
    body = {"model": "m", "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx2.stream("POST", live_server.base_url + "/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    parsed = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = orjson.loads(data_line[len("data: "):])
        assert data["type"] == event_line[len("event: "):]
        parsed.append(data)
    check_stream(parsed)


def test_sdk_errors_are_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input="x", previous_response_id="resp_123")
    assert "stateless" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}])
    assert TEXT_ONLY in str(exc.value)


def test_codex_shaped_stream_is_accepted(live_server, codex_prompt):
    body = codex_body(codex_prompt)
    body["max_output_tokens"] = 6
    with httpx2.stream("POST", live_server.base_url + "/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    frames = [orjson.loads(line[6:]) for line in lines]
    final = check_stream(frames)
    assert final["usage"]["input_tokens"] == prompt_tokens(live_server, body)
    assert [t["type"] for t in final["tools"]] == ["function", "custom"]


def test_function_tool_round_trip(tool_server, tool_client):
    question = "What is the weather in Paris?"
    r1 = tool_client.responses.create(model="m", input=question, tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=24)
    calls = [item for item in r1.output if item.type == "function_call"]
    assert calls, f"the forced call must come back as a function_call item: {r1.output}"
    fc = calls[0]
    assert type(fc).__name__ == "ResponseFunctionToolCall" and fc.name == "get_weather"
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed"
    assert isinstance(json.loads(fc.arguments), dict)

    turn2 = [{"role": "user", "content": question},
             *[item.model_dump(exclude_none=True) for item in r1.output],
             {"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny, 24 degrees."}]
    r2 = tool_client.responses.create(model="m", input=turn2, tools=[WEATHER], max_output_tokens=8)
    assert r2.status in ("completed", "incomplete") and r2.output
    body = {"input": turn2, "tools": [WEATHER]}
    parsed = parse_request(body, tool_server.ctx)
    text, _ = render_chat(tool_server.ctx, tool_server.ctx.prompt, parsed.chat)
    assert "<tool_response>\nSunny, 24 degrees.\n</tool_response>" in text
    replayed = json.dumps(json.loads(fc.arguments), ensure_ascii=False)  # how the template's tojson writes it
    assert f'"name": "get_weather", "arguments": {replayed}' in text
    assert r2.usage.input_tokens == prompt_tokens(tool_server, body)


def test_custom_tool_is_accepted_and_its_call_is_a_custom_tool_call(tool_client):
    r = tool_client.responses.create(model="m", input="Hi", tools=[WEATHER, APPLY_PATCH, *HOSTED],
                                     max_output_tokens=4)
    assert r.status in ("completed", "incomplete")
    assert [t.type for t in r.tools] == ["function", "custom"]

    events = list(tool_client.responses.create(
        model="m", input="Rename x to y in a.py", tools=[WEATHER, APPLY_PATCH],
        tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=24, stream=True))
    final = check_stream([e.model_dump(mode="json", exclude_unset=True) for e in events])
    items = [i for i in final["output"] if i["type"] == "custom_tool_call"]
    assert items and items[0]["name"] == "apply_patch" and items[0]["call_id"].startswith("call_")
    assert not any(i["type"] == "function_call" and i["name"] == "apply_patch" for i in final["output"])
    kinds = {type(e).__name__ for e in events}
    assert "ResponseOutputItemDoneEvent" in kinds and "ResponseCustomToolCallInputDoneEvent" in kinds


def test_disconnect_mid_stream_aborts_the_generation(live_server):
    engine = live_server.ctx.engine
    before = engine.num_disconnects
    body = orjson.dumps({"model": "m", "input": "Write a very long story about the sea.", "max_output_tokens": 400,
                         "stream": True})
    host, port = live_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    seen = b""
    while b"response.output_text.delta" not in seen:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream early"
        seen += chunk
    sock.close()
    deadline = time.monotonic() + 10
    while engine.num_disconnects == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_disconnects == before + 1
    live_server.wait_idle(timeout=10)
    # the server still serves after the abort
    r = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0).responses.create(
        model="m", input="Hi", max_output_tokens=2)
    assert r.usage.output_tokens == 2


def test_internal_error_mid_stream_still_ends_with_response_failed(live_server, client, monkeypatch):
    """A bug while rendering (injected here) must not cut the stream: response.failed ends it, the run is aborted."""
    original = ResponseRenderer.push

    def broken(self, ev):
        if isinstance(ev, TextDelta) and self.response["output"]:
            raise RuntimeError("injected renderer bug")
        return original(self, ev)

    monkeypatch.setattr(ResponseRenderer, "push", broken)
    events = list(client.responses.create(model="m", input="Write a long story.", max_output_tokens=400,
                                          stream=True))
    final = check_stream([e.model_dump(mode="json", exclude_unset=True) for e in events])
    assert events[-1].type == "response.failed" and final["error"]["message"].startswith("internal server error")
    assert final["output"][0]["status"] == "incomplete"
    # 400 tokens take far longer than this at CPU speed: the blocks are freed because the run was aborted
    live_server.wait_idle(timeout=3.0)  # the generation is aborted, its KV blocks freed
