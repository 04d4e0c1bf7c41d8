"""OpenAI Chat Completions and legacy Completions (lucebox/api/openai_chat.py).

Three layers:
- parsing: bodies → ChatRequest, every malformed field a 400 that names it (never another exception);
- rendering: hand-made event sequences through the pure renderers (every wire shape the spec
  and real clients depend on);
- end to end: the real `openai` SDK (and a raw HTTP client where the SDK would hide the bytes)
  against the real server running SmolLM2-135M on CPU. The model is tiny: tests assert protocol
  and consistency (same text twice, usage equal to real token counts), never what it says.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import time
from pathlib import Path

import openai
import orjson
import pytest

from lucebox.api.common import TEXT_ONLY, ServerContext
from lucebox.api.openai_chat import (
    DONE,
    ChatRenderer,
    LogprobFormatter,
    TextRenderer,
    parse_chat,
    parse_completion,
)
from lucebox.chat.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
)
from lucebox.chat.run import Usage
from lucebox.engine.runtime.sampler import TokenLogprobs
from lucebox.http import HttpError

QWEN3_TEMPLATE = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ===== parsing =====================================================================================================

CTX = ServerContext(model_id="the-model", n_ctx=4096)


def chat_body(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def bad_request(fn, *args) -> HttpError:
    with pytest.raises(HttpError) as exc:
        fn(*args)
    assert exc.value.status == 400
    return exc.value


def test_parse_messages_roles_parts_and_tool_turns():
    req = parse_chat({
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        ],
        "tools": [WEATHER_TOOL],
        "user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "parallel_tool_calls": False,
        "stream_options": {"include_usage": True}, "prompt_cache_key": "k", "include": [], "truncation": "auto",
        "previous_response_id": "resp_1",  # a Responses field: not a chat field, ignored
    }, CTX)
    system, user, assistant, tool = req.messages
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": "Weather\nin Paris?"}
    assert assistant["content"] == "" and assistant["reasoning_content"] == "I should call the tool."
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool == {"role": "tool", "content": "Sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert req.tools == [WEATHER_TOOL] and req.tool_choice == "auto"
    assert req.model == "the-model" and not req.stream and req.params.logprobs is None  # no model: the server's


def test_parse_fields_map_to_the_request():
    req = parse_chat(chat_body(max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=-1,
                               seed=3, stop="END", logprobs=True, top_logprobs=3, stream=True,
                               reasoning={"effort": "xhigh"},
                               chat_template_kwargs={"enable_thinking": False, "custom": 1},
                               tools=[WEATHER_TOOL], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}), CTX)
    assert req.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (req.params.temperature, req.params.top_p, req.params.top_k, req.params.seed) == (0.5, 0.9, 0, 3)
    assert req.params.logprobs == 3 and req.stop == ["END"] and req.stream
    assert req.reasoning_effort == "x-high"
    assert req.enable_thinking is False and req.template_kwargs == {"custom": 1}
    assert req.tool_choice == {"name": "get_weather"}
    assert parse_chat(chat_body(logprobs=True), CTX).params.logprobs == 0
    assert parse_chat(chat_body(reasoning_effort="none"), CTX).enable_thinking is False
    low = parse_chat(chat_body(reasoning_effort="low"), CTX)
    assert low.reasoning_effort == "low" and low.template_kwargs == {"reasoning_effort": "low"}  # gpt-oss reads it
    flat = parse_chat(chat_body(tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"}), CTX)
    assert flat.tool_choice == {"name": "get_weather"}
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, CTX).model == "the-model"


@pytest.mark.parametrize("body, field", [
    (chat_body(n=2), "n"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(temperature=-1), "temperature"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_completion_tokens="5"), "max_completion_tokens"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(stop=[1]), "stop"),
    (chat_body(seed=1.5), "seed"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat_body(reasoning_effort="extreme"), "reasoning_effort"),
    (chat_body(reasoning={"effort": 3}), "reasoning.effort"),
    (chat_body(chat_template_kwargs={"enable_thinking": "no"}), "chat_template_kwargs.enable_thinking"),
    (chat_body(chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    (chat_body(tools={"type": "function"}), "tools"),
    (chat_body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (chat_body(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters"),
    (chat_body(tool_choice="any"), "tool_choice"),
    (chat_body(tool_choice="required"), "tool_choice"),
    (chat_body(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
])
def test_parse_chat_bad_fields_are_400_naming_the_field(body, field):
    err = bad_request(parse_chat, body, CTX)
    assert err.param == field and f"'{field}'" in err.message


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                  {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}])
def test_media_parts_are_text_only_400(part):
    err = bad_request(parse_chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]},
                      CTX)
    assert TEXT_ONLY in err.message


@pytest.mark.parametrize("field", ["model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
                                   "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "seed", "stop", "n", "stream", "logprobs", "top_logprobs",
                                   "reasoning_effort", "reasoning", "chat_template_kwargs"])
def test_any_wrong_type_is_a_400_never_a_crash(field):
    for value in ("x", 1.5, -1, True, [], [None], {}, {"x": None}):
        try:
            parse_chat({**chat_body(), field: value}, CTX)
        except HttpError as exc:
            assert exc.status == 400 and field in (exc.param or "")
    for value in (None, 1, "x", [1], {"content": "no role"}):  # whole messages entries of the wrong shape
        with pytest.raises(HttpError):
            parse_chat({"messages": [value]}, CTX)


def test_parse_completion_prompt_forms():
    assert parse_completion({"prompt": "Once"}, CTX).prompt == "Once"
    assert parse_completion({"prompt": ["Once"]}, CTX).prompt == "Once"
    assert parse_completion({"prompt": [1, 2, 3]}, CTX).prompt == [1, 2, 3]
    assert parse_completion({"prompt": [[1, 2]]}, CTX).prompt == [1, 2]
    req = parse_completion({"prompt": "x", "suffix": "ignored", "logprobs": 2, "max_tokens": 3, "stop": ["a"]}, CTX)
    assert req.messages == [] and req.params.logprobs == 2 and req.max_tokens == 3 and req.stop == ["a"]
    for body, field in [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [[1], [2]]}, "prompt"), ({}, "prompt"),
                        ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [True]}, "prompt"),
                        ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "n": 3}, "n"),
                        ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "logprobs": True}, "logprobs"),
                        ({"prompt": "x", "suffix": 3}, "suffix")]:
        assert bad_request(parse_completion, body, CTX).param == field


# ===== rendering (pure) ============================================================================================

USAGE = Usage(prompt_tokens=11, completion_tokens=5, cached_tokens=3, reasoning_tokens=2,
              timings={"prefill_ms": 1.0, "decode_ms": 2.0})


def render_stream(events, renderer=None, usage=USAGE) -> list:
    """What the handler sends for these events: start frames, then each event's frames."""
    renderer = renderer or ChatRenderer("m", completion_id="chatcmpl-x", created=7)
    frames = list(renderer.start())
    for ev in events:
        frames += renderer.frames(ev, usage)
    return frames


def deltas(frames) -> list[dict]:
    return [f["choices"][0]["delta"] for f in frames if isinstance(f, dict) and f.get("choices")]


def check_stream_envelope(frames, finish: str) -> None:
    """Role chunk first; same id/created/model everywhere; empty-delta finish; usage chunk; [DONE] last."""
    chunks = frames[:-1]
    assert frames[-1] == DONE and DONE not in chunks
    assert all(c["object"] == "chat.completion.chunk" and (c["id"], c["created"], c["model"]) == ("chatcmpl-x", 7, "m")
               for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last, usage = chunks[-2], chunks[-1]
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == finish
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 2}}
    assert usage["timings"] == USAGE.timings


def respond(events, renderer=None) -> dict:
    renderer = renderer or ChatRenderer("m", completion_id="chatcmpl-x", created=7)
    return renderer.response(merge_events(events[:-1]), events[-1], USAGE)


def test_render_text_only():
    events = [TextDelta("Hel"), TextDelta(""), TextDelta("lo"), Finish("stop")]
    frames = render_stream(events)
    check_stream_envelope(frames, "stop")
    assert deltas(frames)[1:-1] == [{"content": "Hel"}, {"content": "lo"}]  # no empty delta
    body = respond(events)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-x"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 16 and body["timings"] == USAGE.timings


def test_render_reasoning_then_text():
    events = [ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("Answer"), Finish("stop")]
    frames = render_stream(events)
    check_stream_envelope(frames, "stop")
    assert deltas(frames)[1:-1] == [{"reasoning_content": "Think"}, {"reasoning_content": "ing."},
                                    {"content": "Answer"}]
    message = respond(events)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Answer", "reasoning_content": "Thinking."}


def test_render_tool_call_with_streamed_arguments():
    pieces = ['{"city": "', "Par", 'is"}']
    events = [ToolCallStart(0, "call_abc", "get_weather"), *[ToolCallArgsDelta(0, p) for p in pieces],
              ToolCallEnd(0, "call_abc", "get_weather", "".join(pieces)), Finish("tool_calls")]
    frames = render_stream(events)
    check_stream_envelope(frames, "tool_calls")
    calls = [d["tool_calls"] for d in deltas(frames) if "tool_calls" in d]
    assert all(len(c) == 1 for c in calls)
    assert calls[0][0] == {"index": 0, "id": "call_abc", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}
    for (cont,), piece in zip(calls[1:], pieces, strict=True):
        assert cont == {"index": 0, "function": {"arguments": piece}}  # no id/type/name keys at all, not even null
    assert b"null" not in b"".join(orjson.dumps(c) for c in calls[1:])
    assert not any("content" in d for d in deltas(frames)[1:])  # nothing leaks as text
    message = respond(events)["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message
    assert message["tool_calls"] == [{"id": "call_abc", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert respond(events)["choices"][0]["finish_reason"] == "tool_calls"


def test_render_two_tool_calls_after_text():
    events = [TextDelta("Checking."), ToolCallStart(0, "call_a", "get_weather"), ToolCallArgsDelta(0, '{"city": "A"}'),
              ToolCallEnd(0, "call_a", "get_weather", '{"city": "A"}'), ToolCallStart(1, "call_b", "get_time"),
              ToolCallArgsDelta(1, "{}"), ToolCallEnd(1, "call_b", "get_time", "{}"), Finish("tool_calls")]
    frames = render_stream(events)
    check_stream_envelope(frames, "tool_calls")
    calls = [d["tool_calls"][0] for d in deltas(frames) if "tool_calls" in d]
    assert [(c["index"], c.get("id"), c["function"].get("name")) for c in calls] == [
        (0, "call_a", "get_weather"), (0, None, None), (1, "call_b", "get_time"), (1, None, None)]
    message = respond(events)["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("call_a", "get_weather", {"city": "A"}), ("call_b", "get_time", {})]


def test_render_length_finish_in_streaming():
    events = [TextDelta("cut sh"), Finish("length")]
    check_stream_envelope(render_stream(events), "length")
    assert respond(events)["choices"][0]["finish_reason"] == "length"


def test_render_stop_sequence_is_stop():
    events = [TextDelta("one two"), Finish("stop_sequence", "three")]
    check_stream_envelope(render_stream(events), "stop")
    assert respond(events)["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("reason, kind", [("error", "server_error"), ("cancelled", "overloaded_error")])
def test_render_error_mid_stream(reason, kind):
    frames = render_stream([TextDelta("partial"), Finish(reason)])
    assert deltas(frames) == [{"role": "assistant", "content": ""}, {"content": "partial"}]
    error = frames[-2]
    assert frames[-1] == DONE and set(error) == {"error"}
    assert error["error"]["type"] == kind and error["error"]["message"]
    assert not any(isinstance(f, dict) and "usage" in f for f in frames)  # no result after an error


def test_render_legacy_text_completion():
    r = TextRenderer("m", completion_id="cmpl-x", created=7)
    events = [TextDelta("Paris"), TextDelta("."), Finish("length")]
    frames = render_stream(events, r)
    assert frames[-1] == DONE
    chunks = frames[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-x" for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Paris", ".", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 16
    body = TextRenderer("m", completion_id="cmpl-x", created=7).response(events[:-1], events[-1], USAGE)
    assert body["choices"] == [{"text": "Paris.", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 11


def test_legacy_logprobs_text_offset_runs_across_chunks(live_server):
    tok = live_server.ctx.prompt.tokenizer
    ids = tok.encode(" Paris is big", add_special=False)
    entries = [TokenLogprobs(i, -0.5, [(i, -0.5)]) for i in ids]
    r = TextRenderer("m", LogprobFormatter(tok))
    first = r.chunk(TextDelta("x"), entries[:2])["choices"][0]["logprobs"]
    rest = r.finish(Finish("stop"), entries[2:] + [TokenLogprobs(min(tok.eos_ids), -0.1, [])])["choices"][0]["logprobs"]
    tokens = first["tokens"] + rest["tokens"]
    assert "".join(tokens) == " Paris is big"  # the end-of-turn token is not reported
    offsets = first["text_offset"] + rest["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert rest["top_logprobs"][0] == {tokens[2]: -0.5}


def test_logprob_bytes_of_a_split_character(live_server):
    """A token holding half of a UTF-8 character reports its raw bytes, so bytes rejoin to the text."""
    tok = live_server.ctx.prompt.tokenizer
    ids = tok.encode("naïve 日本語 🙂", add_special=False)
    fmt = LogprobFormatter(tok)
    assert any("\ufffd" in fmt.token(i)[0] for i in ids)  # the test needs a split character
    assert bytes(b for i in ids for b in fmt.token(i)[1]).decode("utf-8") == "naïve 日本語 🙂"


# ===== end to end: the real SDK against the real server ============================================================


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=60)


def create(client, **kw):
    args = {"model": "smol", "messages": QUESTION, "temperature": 0, "max_tokens": 12, **kw}
    return client.chat.completions.create(**args)


def stream_chat(client, **kw) -> tuple[list, str, str | None, object]:
    chunks = list(create(client, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    return chunks, text, finishes[0], chunks[-1].usage


def test_chat_non_stream_and_stream_agree_with_real_token_counts(client, live_server):
    r = create(client)
    prompt_ids = live_server.ctx.prompt.render_ids(QUESTION, add_generation_prompt=True)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "smol"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    timings = r.model_extra["timings"]
    assert timings["prefill_ms"] > 0 and timings["decode_ms"] is not None

    chunks, text, finish, usage = stream_chat(client)
    assert text == r.choices[0].message.content  # content equals the concatenated deltas (greedy)
    assert finish == r.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == r.usage.completion_tokens


def test_greedy_is_deterministic(client):
    assert create(client).choices[0].message.content == create(client).choices[0].message.content


def test_stop_string_never_leaks(client):
    full = create(client, max_tokens=16).choices[0].message.content
    k = len(full) // 3
    stop = full[k:k + 6]  # from inside the output, likely split across tokens
    expected = full[: full.find(stop)]
    r = create(client, max_tokens=16, stop=[stop, "never-there"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    _, text, finish, _ = stream_chat(client, max_tokens=16, stop=stop)
    assert text == expected and finish == "stop"


@pytest.mark.parametrize("stop, words", [(["s" * 257], "257 characters"), ([str(i) for i in range(17)], "17 stop")])
def test_too_long_or_too_many_stop_strings_are_a_400(client, stop, words):
    """Every proper prefix of a stop string is kept while matching: a 100K-character one took ~5 GB."""
    with pytest.raises(openai.BadRequestError) as e:
        create(client, max_tokens=2, stop=stop)
    assert e.value.body["param"] == "stop" and words in e.value.body["message"]
    assert create(client, max_tokens=2, stop=["s" * 256] + [str(i) for i in range(15)]).choices  # the limits pass


def test_max_tokens_gives_length_in_both_modes(client):
    r = create(client, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    _, text, finish, usage = stream_chat(client, max_completion_tokens=3)
    assert finish == "length" and usage.completion_tokens == 3 and text == r.choices[0].message.content


def test_logprobs_present_and_consistent(client):
    r = create(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8") == t.token
        assert len(t.top_logprobs) == 3 and [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
    chunks, text, _, _ = stream_chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(t.token for t in streamed) == text == r.choices[0].message.content
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert create(client, max_tokens=2).choices[0].logprobs is None


def test_seed_reproducible_at_temperature_1(client):
    poem = [{"role": "user", "content": "Write a short poem about anything you like."}]
    texts = [create(client, messages=poem, temperature=1.0, top_p=1.0, seed=s, max_tokens=12).choices[0].message.content
             for s in (1234, 1234, 99, 7)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1  # the seed matters: three seeds do not all give the same 12 tokens


def test_template_kwargs_and_reasoning_effort_reach_the_template(client, live_server):
    """SmolLM2's ChatML template ignores enable_thinking; the request must still render and count exactly."""
    n = len(live_server.ctx.prompt.render_ids(QUESTION, add_generation_prompt=True, enable_thinking=False))
    r = create(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == n
    assert create(client, max_tokens=1, reasoning_effort="low").usage.prompt_tokens == n


def test_ignored_fields_do_not_fail(client):
    r = create(client, max_tokens=2, user="u", metadata={"k": "v"}, store=False, service_tier="auto",
               parallel_tool_calls=False, stream_options={"include_usage": False}, prompt_cache_key="p",
               extra_body={"previous_response_id": "resp_123", "include": ["x"], "truncation": "auto"})
    assert r.choices[0].finish_reason == "length"


def test_access_log_line_has_token_counts_and_finish(client, caplog):
    caplog.set_level(logging.INFO, logger="lucebox.http")
    r = create(client, max_tokens=2)
    want = (rf"/v1/chat/completions 200 .* prompt_tokens={r.usage.prompt_tokens} cached_tokens=\d+ "
            r"completion_tokens=2 queue_ms=[\d.]+ prefill_ms=[\d.]+ finish=length")
    assert wait_for(lambda: any(re.search(want, m) for m in caplog.messages), 5)


def error_of(fn, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        fn(**kw)
    assert exc.value.status_code == 400
    return exc.value.body


def test_bad_requests_are_400_with_the_sdk(client, live_server):
    assert error_of(create, client=client, n=2)["param"] == "n"
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
    assert TEXT_ONLY in error_of(create, client=client, messages=[{"role": "user", "content": image}])["message"]
    body = error_of(create, client=client, temperature="warm")
    assert body["param"] == "temperature" and body["type"] == "invalid_request_error"
    body = error_of(create, client=client, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert body["param"] == "tools[0].function.name"

    long = [{"role": "user", "content": "hello " * (live_server.ctx.n_ctx + 10)}]
    p = len(live_server.ctx.prompt.render_ids(long, add_generation_prompt=True))
    n = live_server.ctx.n_ctx
    assert error_of(create, client=client, messages=long, max_tokens=16)["message"] == (
        f"This model's maximum context length is {n} tokens. However, you requested {p + 16} tokens "
        f"({p} in the messages, 16 in the completion). Please reduce the length of the messages or completion.")


def test_legacy_completions_string_ids_and_stream(client, live_server):
    tok = live_server.ctx.prompt.tokenizer
    prompt = "The capital of France is"
    args = {"model": "smol", "max_tokens": 8, "temperature": 0}
    r = client.completions.create(prompt=prompt, logprobs=2, **args)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "smol"
    assert choice.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 8
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(8)]
    assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))

    ids = tok.encode(prompt)
    by_ids = client.completions.create(prompt=ids, **args)
    assert by_ids.choices[0].text == choice.text and by_ids.usage.prompt_tokens == len(ids)
    assert client.completions.create(prompt=[prompt], **args).choices[0].text == choice.text

    chunks = list(client.completions.create(prompt=prompt, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    assert error_of(client.completions.create, prompt=["one", "two"], **args)["param"] == "prompt"
    assert error_of(client.completions.create, prompt=prompt, echo=True, **args)["param"] == "echo"


# -- raw wire checks (what the SDK would hide) --------------------------------------------------------------------


def raw_post(live_server, path: str, body: dict) -> tuple[http.client.HTTPResponse, bytes]:
    host, port = live_server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, orjson.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp, data


def sse_data(raw: bytes) -> list[str]:
    frames = raw.decode("utf-8").split("\n\n")
    assert frames[-1] == ""  # every frame ends with a blank line
    return [f.removeprefix("data: ") for f in frames[:-1]]


def test_raw_stream_frames_and_done(live_server):
    resp, raw = raw_post(live_server, "/v1/chat/completions",
                         {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "stream": True})
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []


@pytest.fixture(scope="module")
def tool_server(smollm2_path):
    """SmolLM2 behind the Qwen3 chat template, which renders tools (Hermes JSON calls in <tool_call>)."""
    from tests.live_server import start_server

    server = start_server(smollm2_path, chat_template_file=QWEN3_TEMPLATE)
    yield server
    server.stop()


def test_tool_call_round_trip_with_the_sdk(tool_server):
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="x", max_retries=0, timeout=60)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice=choice,
                                       temperature=0, max_tokens=40)
    message = r.choices[0].message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert isinstance(json.loads(call.function.arguments), dict)
    assert "<tool_call>" not in (message.content or "")  # the call never leaks as text
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    if r.choices[0].finish_reason == "tool_calls":
        assert message.content is None

    # streamed, on the raw wire: continuation chunks carry no id/type/name at all
    resp, raw = raw_post(tool_server, "/v1/chat/completions",
                         {"messages": messages, "tools": [WEATHER_TOOL], "tool_choice": choice, "temperature": 0,
                          "max_tokens": 40, "stream": True})
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    calls = [c for d in data[:-1] for ch in json.loads(d)["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(calls) > 1 and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                                  for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == call.function.arguments

    # second turn: the call and its result go back through the template, and the model answers
    followup = [*messages, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 22}'}]
    r2 = client.chat.completions.create(model="smol", messages=followup, tools=[WEATHER_TOOL], temperature=0,
                                        max_tokens=12)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call is the server's own: it goes back as the text the model wrote (API.md, multi-turn replay).
    replayed = tool_server.ctx.replay.rewrite(followup)
    assert replayed[1] == {"role": "assistant", "content": replayed[1]["content"]}
    assert replayed[1]["content"].startswith("<tool_call>") and "get_weather" in replayed[1]["content"]
    rendered = tool_server.ctx.prompt.render_ids(replayed, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert r2.usage.prompt_tokens == len(rendered) > r.usage.prompt_tokens
    text = tool_server.ctx.prompt.render(replayed, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert "<tool_response>" in text and "get_weather" in text


# -- disconnects ---------------------------------------------------------------------------------------------------


def wait_for(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_generation(live_server, stream):
    engine = live_server.ctx.engine
    before = engine.num_disconnects
    body = orjson.dumps({"messages": QUESTION, "max_tokens": 1000, "temperature": 0, "stream": stream,
                         "stop": []})
    host, port = live_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        got = b""
        while got.count(b"data: ") < 3:  # the role chunk and two content chunks: generation is running
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
    else:
        assert wait_for(lambda: engine.num_running > 0)
    steps = engine.steps
    sock.close()
    assert wait_for(lambda: engine.num_disconnects > before)
    assert wait_for(lambda: engine.num_running == 0 and engine.engine.blocks_in_use == 0)
    assert engine.steps - steps < 100  # aborted long before its 1000 tokens


COUNT = "Count from 1 to 300, separated by commas."
LONG_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 1000},
    "/v1/completions": {"prompt": COUNT, "max_tokens": 1000},
    "/v1/responses": {"input": COUNT, "max_output_tokens": 1000},
    "/v1/messages": {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 1000},
}


def requests_counted(url: str, path: str, status: int) -> int:
    """lucebox_requests_total for (path, status), read from /metrics."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    line = f'lucebox_requests_total{{route="{path}",status="{status}"}} '
    return next((int(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line)), 0)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", list(LONG_BODIES))
def test_client_disconnect_is_one_outcome_499_in_log_and_metrics(live_server, caplog, path, stream):
    """A client that hangs up mid-generation: status 499 in the request's log line and in /metrics, every dialect,
    streamed or not (it was 503 "server shutting down?" for a non-streaming chat, 200 elsewhere)."""
    caplog.set_level(logging.INFO, logger="lucebox.http")
    engine = live_server.ctx.engine
    before = requests_counted(live_server.url, path, 499)
    body = orjson.dumps({"model": "m", "temperature": 0, "stream": stream, **LONG_BODIES[path]})
    host, port = live_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    if stream:
        got = b""
        while got.count(b"data: ") < 4:  # generation is running
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    else:
        assert wait_for(lambda: engine.num_running > 0)
    sock.close()
    assert wait_for(lambda: requests_counted(live_server.url, path, 499) == before + 1)
    assert wait_for(lambda: engine.num_running == 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "lucebox.http" and f" POST {path} " in r.getMessage()]
    assert lines and f" POST {path} 499 " in lines[-1] and "disconnected=1" in lines[-1], lines
