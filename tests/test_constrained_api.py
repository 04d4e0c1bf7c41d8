"""Constrained decoding through the live server (chat/constrain.py): forced tool calls in every dialect, streaming
and not, parse and validate against their tools' schemas; JSON answers validate; what cannot compile is a 400;
each call format's grammar takes well-formed calls and refuses others."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from lucebox.chat.constrain import plan_output
from lucebox.chat.reasoning import ReasoningConfig
from lucebox.engine.runtime.grammar import compiler_for, grammar_from_lark

RAW = ("<tool_call>", "</tool_call>", "<function=", '"arguments"')

TOOLS: list[tuple[str, str, dict, str]] = [  # name, description, parameters, a request that fits it
    ("get_weather", "Weather forecast for a city", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "units": {"enum": ["metric", "imperial"]}},
        "required": ["city", "days", "units"]}, "What's the weather in Zürich for the next 3 days, in metric?"),
    ("create_event", "Create a calendar event", {
        "type": "object", "properties": {
            "title": {"type": "string"},
            "start": {"type": "object", "properties": {"date": {"type": "string"}, "time": {"type": "string"}},
                      "required": ["date", "time"]},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 30}, "email": {"type": "string", "maxLength": 40}},
                                                   "required": ["name"]}, "maxItems": 3}},
        "required": ["title", "start", "attendees"]}, 'Book "Sprint review" on 2026-12-03 at 10:00 with Ana and Bo.'),
    ("write_file", "Write text to a file", {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}, 'Write "héllo — 世界" with a "quote" to /tmp/a.txt'),
    ("set_flags", "Turn feature flags on", {
        "type": "object", "properties": {"flags": {"type": "array", "items": {"enum": ["dark", "beta", "fast"]},
                                                   "minItems": 1, "maxItems": 3},
                                         "dry_run": {"type": "boolean"}},
        "required": ["flags", "dry_run"]}, "Enable the dark and beta flags, for real."),
    ("calculate", "Arithmetic on two numbers", {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                         "op": {"type": "string", "enum": ["add", "sub", "mul", "div"]}},
        "required": ["a", "b", "op"]}, "What is 12.5 times 4?"),
    ("list_files", "List the files of the current folder", {"type": "object", "properties": {}},
     "Which files are here?"),
]
SCHEMAS = {name: params for name, _, params, _ in TOOLS}
N = int(os.environ.get("LUCEBOX_CONSTRAINED_N", "12"))  # forced-call requests (12: every dialect x stream x
# named combination once, every tool twice; the note ran 100)


def openai_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p, _ in TOOLS]


def forced_chat(client: openai.OpenAI, name: str, ask: str, stream: bool, named: bool) -> tuple[list, str, str]:
    choice = {"type": "function", "function": {"name": name}} if named else "required"
    tools = openai_tools() if named else [t for t in openai_tools() if t["function"]["name"] == name]
    kw: dict[str, Any] = dict(model="m", messages=[{"role": "user", "content": ask}], tools=tools, tool_choice=choice,
                              max_tokens=256, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return [(c.function.name, c.function.arguments) for c in m.tool_calls or []], m.content or "", \
            r.choices[0].finish_reason
    calls: dict[int, list[str]] = {}
    text, finish = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for tc in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
        text += (delta.content or "") if delta else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return [tuple(c) for c in calls.values()], text, finish


def forced_responses(client: openai.OpenAI, name: str, ask: str, stream: bool, named: bool) -> tuple[list, str, str]:
    tools = [{"type": "function", "name": n, "description": d, "parameters": p} for n, d, p, _ in TOOLS]
    choice = {"type": "function", "name": name} if named else "required"
    tools = tools if named else [t for t in tools if t["name"] == name]
    kw: dict[str, Any] = dict(model="m", input=ask, tools=tools, tool_choice=choice, max_output_tokens=256,
                              temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    text = "".join(c.text for i in r.output if i.type == "message" for c in i.content if c.type == "output_text")
    return calls, text, "tool_calls" if calls and r.status == "completed" else r.status


def forced_messages(client: anthropic.Anthropic, name: str, ask: str, stream: bool, named: bool) -> tuple[list, str,
                                                                                                         str]:
    tools = [{"name": n, "description": d, "input_schema": p} for n, d, p, _ in TOOLS]
    choice = {"type": "tool", "name": name} if named else {"type": "any"}
    tools = tools if named else [t for t in tools if t["name"] == name]
    kw: dict[str, Any] = dict(model="m", max_tokens=256, tools=tools, tool_choice=choice,
                              messages=[{"role": "user", "content": ask}], extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    calls = [(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"]
    text = "".join(b.text for b in msg.content if b.type == "text")
    return calls, text, {"tool_use": "tool_calls"}.get(msg.stop_reason, msg.stop_reason)


def test_forced_calls_parse_and_validate_in_every_dialect(live_server):
    """Named and required tool choices, streaming and not, over varied schemas (nested objects, enums, arrays,
    required fields, quotes and unicode in the request): one call of the right tool whose arguments validate,
    no markup in the text, finish tool_calls / tool_use."""
    oa = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=300)
    an = anthropic.Anthropic(base_url=live_server.url, api_key="x", max_retries=0, timeout=300)
    dialects = [lambda *a: forced_chat(oa, *a), lambda *a: forced_responses(oa, *a), lambda *a: forced_messages(an, *a)]
    cases = [(i, TOOLS[i % len(TOOLS)], i % 2 == 1, i % 4 < 2) for i in range(N)]

    def one(case: tuple) -> tuple:
        i, (name, _, params, ask), stream, named = case
        return case, dialects[i % 3](name, ask, stream, named)

    with ThreadPoolExecutor(6) as pool:  # several at once: they share the engine's batches
        results = list(pool.map(one, cases))
    for (i, (name, *_), stream, named), (calls, text, finish) in results:
        where = f"case {i}: dialect {i % 3}, {name}, stream={stream}, named={named}"
        assert len(calls) == 1 and calls[0][0] == name, f"{where}: {calls} {text!r}"
        jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[name])
        assert not any(m in text for m in RAW), f"{where}: markup leaked into the text: {text!r}"
        assert finish == "tool_calls", f"{where}: finished {finish}"
    props = httpx.get(live_server.url + "/props").json()["constrained_decoding"]
    assert props["library"].startswith("llguidance") and props["call_format"] == "json"
    assert props["generations"].get("tool_choice_named", 0) + props["generations"].get("tool_choice_required", 0) >= N


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"]}


def test_json_answers_validate_in_every_dialect(live_server):
    oa = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=300)
    an = anthropic.Anthropic(base_url=live_server.url, api_key="x", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Describe a made-up person as JSON."}]
    texts = []
    for strict in (True, False):
        r = oa.chat.completions.create(model="m", messages=ask, max_tokens=120, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}})
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
    stream = oa.chat.completions.create(model="m", messages=ask, max_tokens=120, temperature=0, stream=True,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": PERSON}})
    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    r = oa.responses.create(model="m", input="Describe a made-up person as JSON.", max_output_tokens=120,
                            temperature=0, text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                            "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    texts.append(r.output_text)
    msg = an.messages.create(model="m", max_tokens=120, messages=ask, extra_body={"temperature": 0},
                             output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert msg.stop_reason == "end_turn"
    texts.append(msg.content[0].text)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    strict_one = json.loads(texts[0])
    assert set(strict_one) <= set(PERSON["properties"])  # strict: no keys the schema does not list
    r = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Give the capital of France."}],
                                   max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_what_cannot_compile_is_a_400_in_the_dialects_shape(live_server):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    chat = httpx.post(live_server.base_url + "/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "nowhere" in chat.json()["error"]["message"]
    msg = httpx.post(live_server.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "output_config": {"format": {"type": "json_schema", "schema": bad}}})
    assert msg.status_code == 400 and msg.json()["type"] == "error"
    assert msg.json()["error"]["type"] == "invalid_request_error"
    typed = httpx.post(live_server.base_url + "/responses", timeout=60, json={
        "model": "m", "input": "hi", "text": {"format": {"type": "yaml"}}})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "text.format.type"
    # A tool whose schema does not compile still gets a well-formed forced call (any object as arguments).
    r = httpx.post(live_server.base_url + "/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "Look it up."}], "max_tokens": 64, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": bad}}],
        "tool_choice": "required"})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "lookup" and isinstance(json.loads(call["arguments"]), dict)


def test_a_constrained_agent_turn_streams_over_two_turns_with_the_cache(live_server):
    """Tools + required + streaming, then the result turn: the second turn reuses the first's prompt, and a
    client that disconnects in the middle of a constrained stream costs the next request nothing."""
    oa = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=300)
    name, _, params, ask = TOOLS[0]
    tools = [t for t in openai_tools() if t["function"]["name"] == name]
    calls, _, finish = forced_chat(oa, name, ask, True, False)
    assert finish == "tool_calls"
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": name, "arguments": calls[0][1]}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    with oa.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice="required", stream=True,
                                    max_tokens=160, temperature=0) as s:
        next(iter(s))  # leave after the first frame
    follow = oa.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice="required",
                                        max_tokens=160, temperature=0)
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
    jsonschema.validate(json.loads(follow.choices[0].message.tool_calls[0].function.arguments), params)


# ----- the grammars, token by token (no model run) ----------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}
BASH = {"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": "metric"}}' \
            '\n</tool_call>'
XML_CALL = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
            '</parameter>\n<parameter=units>\nmetric\n</parameter>\n</function>\n</tool_call>')
XML = "{{ '<function=' }}"  # a template source that writes XML calls
THINKING = ReasoningConfig(enabled=True, start_in_reasoning=True)
GEMMA = "{{ '<|tool_call>call:' }}"  # a template source that writes Gemma 4 calls
GEMMA_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:<|"|>metric<|"|>}<tool_call|>'
FLAGS = {"type": "function", "function": {"name": "set_flags", "parameters": SCHEMAS["set_flags"]}}
LLAMA = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'


@pytest.mark.parametrize("source, choice, fmt, reasoning, text, ok", [
    ("", "required", None, None, JSON_CALL, True),
    ("", "required", None, None, "Sure: " + JSON_CALL, False),  # forced: nothing but the call
    ("", "required", None, None, JSON_CALL.replace('"days": 3', '"days": 99'), False),  # the schema's maximum
    ("", {"name": "bash"}, None, None, JSON_CALL, False),  # the named tool only
    ("", "required", None, None, JSON_CALL.replace('{"city"', '{\n  "city"'), False),  # as tojson writes it
    ("", "auto", None, None, "No call needed.", True),
    ("", "auto", None, None, "Let me look.\n" + JSON_CALL + "\nDone.", True),
    ("", "auto", None, None, 'Let me look.\n<tool_call>\n{"name": "nope"', False),  # an opened call follows it
    ("", "auto", None, None, JSON_CALL.replace('"days": 3', '"days": 99'), True),  # auto: its own arguments
    (XML, "required", None, None, XML_CALL, True),
    (XML, "required", None, None, XML_CALL.replace("<parameter=units>\nmetric\n</parameter>\n", ""), False),
    (XML, "required", None, None, XML_CALL.replace("metric", "kelvin"), False),  # an enum, written raw
    (XML, "auto", None, None, "Checking.\n" + XML_CALL, True),
    (GEMMA, "required", None, None, GEMMA_CALL, True),
    (GEMMA, "required", None, None, GEMMA_CALL.replace("days:3", "days:99"), False),  # the schema's maximum
    (GEMMA, "required", None, None, GEMMA_CALL.replace("metric", "kelvin"), False),  # an enum
    (GEMMA, "required", None, None, GEMMA_CALL.replace(',units:<|"|>metric<|"|>', ""), False),  # a required key
    (GEMMA, "required", None, None, '<|tool_call>call:get_weather{days:3,city:<|"|>Paris<|"|>,units:<|"|>metric'
                                    '<|"|>}<tool_call|>', False),  # keys in the template's (sorted) order
    (GEMMA, {"name": "set_flags"}, None, None, "<|tool_call>call:set_flags{dry_run:false,flags:[<|\"|>dark<|\"|>]}"
                                               "<tool_call|>", True),
    (GEMMA, {"name": "set_flags"}, None, None, "<|tool_call>call:set_flags{dry_run:false,flags:[]}<tool_call|>",
     False),  # minItems
    (GEMMA, "auto", None, None, "Checking. " + GEMMA_CALL + " Done.", True),
    (GEMMA, "auto", None, None, "Checking. <|tool_call>call:nope{}", False),  # an opened call names a declared tool
    (LLAMA, "required", None, None, '{"name": "bash", "parameters": {"command": "ls"}}', True),
    (LLAMA, "required", None, None, '{"name": "bash", "arguments": {"command": "ls"}}', False),
    ("", "none", {"type": "json_object"}, None, '{"a": [1, {"b": null}]}', True),
    ("", "none", {"type": "json_object"}, None, "[1, 2]", False),
    ("", "none", {"type": "json_object"}, None, '{\n  "a": [\n    1,\n\n    {"b": null}\n  ]\n}', True),  # pretty
    ("", "none", {"type": "json_object"}, None, '{"a":\n\n\n1}', False),  # at most one blank line between tokens
    ("", "none", {"type": "json_object"}, None, '{\n' + " " * 33 + '"a": 1}', False),  # at most 32 columns of indent
    ("", "auto", {"type": "json_object"}, None, JSON_CALL, True),  # tools and JSON: a call or the JSON
    ("", "none", {"type": "json_schema", "schema": SCHEMAS["calculate"]}, THINKING,
     'Twelve and a half times four.</think>\n\n{"a": 12.5, "b": 4, "op": "mul"}', True),
    ("", "none", {"type": "json_schema", "schema": SCHEMAS["calculate"]}, THINKING,
     '{"a": 12.5, "b": 4, "op": "mul"}', False),  # still reasoning: the JSON is only text so far
])
def test_each_format_takes_well_formed_calls_and_refuses_others(smollm2_tokenizer, source, choice, fmt, reasoning,
                                                                text, ok):
    plan = plan_output(smollm2_tokenizer, source, [WEATHER, BASH, FLAGS], choice, fmt, reasoning)
    constraint = compiler_for(smollm2_tokenizer, smollm2_tokenizer.vocab_size).constraint(
        grammar_from_lark(plan.lark), plan.reason)
    ids = smollm2_tokenizer.encode(text, add_special=False)
    taken = constraint.matcher.try_consume_tokens(ids)
    assert (taken == len(ids) and constraint.matcher.is_accepting()) is ok, (plan.lark, taken, len(ids))


def test_a_free_request_is_not_constrained(smollm2_tokenizer):
    assert plan_output(smollm2_tokenizer, "", None, "auto", None, None) is None
    assert plan_output(smollm2_tokenizer, "", [WEATHER], "none", None, None) is None
    assert plan_output(smollm2_tokenizer, LLAMA, [WEATHER], "auto", None, None) is None  # no marker to wait for


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from lucebox.engine.tokenizer import tokenizer_from_gguf
    from lucebox.engine.weights.gguf_file import GGUFFile

    return tokenizer_from_gguf(GGUFFile(smollm2_path))



def test_the_grammar_tokenizer_is_built_at_start_up(live_server):
    """Before the first constrained request: building it then would hold the GIL while others decode."""
    engine = live_server.ctx.engine.engine
    built = engine.tokenizer.grammar
    assert built is not None and built.vocab_size == engine.model_config.vocab_size
