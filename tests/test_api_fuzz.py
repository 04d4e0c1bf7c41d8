"""Hostile request bodies against the live server, per dialect: never a 5xx, always the dialect's error shape.

Hypothesis starts from a valid body of each dialect (OpenAI chat and completions, Responses, Anthropic
messages and count_tokens; /tokenize and /detokenize too) and replaces one value anywhere in it with a
value of the wrong type, a huge string, a huge or non-finite number or a 1,000-deep nesting; or deletes a
field; or adds a known field with a random value; or sends random JSON. Every answer must be a 200 or a
4xx whose body has the dialect's error shape (OpenAI `{"error": {"message", "type", ...}}`, Anthropic `{"type": "error",
"error": {"type", "message"}}`), and nothing may be logged at ERROR (a caught exception mid-stream is a
bug too). Valid bodies generate 1-2 tokens, so the whole file runs in well under a minute.

The requests go over a real socket to the real server (tests/live_server.py) on the default model.
"""

from __future__ import annotations

import http.client
import json
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucebox.http.router import TRACEBACK_FRAMES, log_failure

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
VALID: dict[str, dict] = {
    "/v1/chat/completions": {
        "model": "m", "max_tokens": 1, "stream": False, "temperature": 0, "top_p": 1, "seed": 1, "stop": ["\n"],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": SCHEMA}}],
        "tool_choice": "auto", "logprobs": False, "chat_template_kwargs": {"enable_thinking": False},
    },
    "/v1/completions": {"model": "m", "prompt": "Once upon", "max_tokens": 1, "stream": False, "temperature": 0,
                        "logprobs": 1, "stop": ["."]},
    "/v1/responses": {
        "model": "m", "max_output_tokens": 1, "stream": False, "instructions": "Be brief.", "temperature": 0,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Paris\"}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "tools": [{"type": "function", "name": "weather", "description": "d", "parameters": SCHEMA},
                  {"type": "custom", "name": "patch", "description": "d"}],
        "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "weather"}]},
        "reasoning": {"effort": "low"},
    },
    "/v1/messages": {
        "model": "m", "max_tokens": 1, "stream": False, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "sunny"}]}]}],
        "tools": [{"name": "weather", "description": "d", "input_schema": SCHEMA}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "temperature": 0, "top_k": 1,
        "stop_sequences": ["\n"],
    },
}
VALID["/v1/messages/count_tokens"] = {k: v for k, v in VALID["/v1/messages"].items()
                                      if k not in ("max_tokens", "stream")}
DIALECTS = list(VALID)
VALID["/tokenize"] = {"content": "hi", "add_special": False, "with_pieces": True}
VALID["/detokenize"] = {"tokens": [1, 2, 3]}
TOKEN_LIMITS = {"max_tokens", "max_output_tokens", "max_completion_tokens"}
"""A valid, larger value here would generate for seconds: the fuzz keeps them at 1-2 (or invalid)."""
EXTRA_FIELDS = ["n", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                "seed", "tool_choice", "tools", "reasoning_effort", "reasoning", "thinking", "top_logprobs",
                "chat_template_kwargs", "previous_response_id", "best_of", "echo", "suffix", "metadata"]
WORDS = ["function", "message", "tool", "auto", "none", "required", "any", "custom", "namespace", "allowed_tools",
         "text", "input_text", "output_text", "tool_use", "tool_result", "function_call", "function_call_output",
         "user", "assistant", "system", "developer", "enabled", "weather", "object", "string", "web_search"]


def deep_text(n: int, compact: bool = False) -> str:
    """JSON text nesting arrays and objects `n` levels deep (json.dumps itself recurses, so built as text).

    `compact`: arrays only, the fewest characters (and prompt tokens, where the text reaches the prompt).
    """
    if compact:
        return "[" * n + "]" * n
    return '{"a": [' * (n // 2) + "1" + "]}" * (n // 2)


def deep(n: int) -> str:
    """A placeholder that `encode` turns into `deep_text(n)` where it stands as a value."""
    return f"<deep {n}>"


hostile = st.one_of(
    st.none(), st.booleans(), st.sampled_from(WORDS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN/inf go out as NaN/Infinity: not JSON, must be a 400
    st.sampled_from([1e-300, 1e300, -1e300, 5e-324]),
    st.text(max_size=20), st.just("x" * 200_000),  # longer than the context
    st.lists(st.sampled_from([None, 1, "x", [], {}, ["a"], {"name": [1]}]), max_size=3),
    st.dictionaries(st.sampled_from(["type", "name", "function", "required", "properties", "x"]),
                    st.sampled_from([None, 5, "function", ["x"], {"x": 1}, [["a"]], []]), max_size=3),
    st.builds(deep, st.sampled_from([63, 200, 1000])),
    st.builds(deep_text, st.sampled_from([200, 1000]), st.just(True)),
)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=20)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indexes) to a value inside `value`, the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        out.append((*prefix, key))
        out.extend(paths(child, (*prefix, key)))
    return out


def mutate(body: dict, path: tuple, action: str, value: Any) -> dict:
    body = json.loads(json.dumps(body))
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if last in TOKEN_LIMITS and (action == "delete" or (type(value) is int and value > 2)):
        return body  # keep generation short: a valid limit stays 1
    if action == "delete":
        del parent[last]
    else:
        parent[last] = value
    return body


@st.composite
def mutated_bodies(draw: st.DrawFn, path: str) -> dict:
    base = VALID[path]
    action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if action == "add":
        return {**base, draw(st.sampled_from(EXTRA_FIELDS)): draw(hostile)}
    return mutate(base, draw(st.sampled_from(paths(base))), action, draw(hostile))


def post(url: str, path: str, payload: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, payload, {"content-type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def encode(body: Any) -> bytes:
    """JSON as Python writes it (big ints exact; NaN/inf as NaN/Infinity, which JSON does not allow), deep values in."""
    text = json.dumps(body)
    for n in (40, 63, 200, 1000):
        text = text.replace(json.dumps(deep(n)), deep_text(n))
    return text.encode()


def check_answer(path: str, status: int, data: bytes) -> None:
    """200, or a 4xx in the dialect's error shape with a message in words."""
    assert status < 500, (status, data[:500])
    if status == 200:
        assert b"internal server error" not in data.lower(), data[:500]
        return
    assert 400 <= status < 500, status
    err = json.loads(data)
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and isinstance(err["error"]["type"], str), err
    else:
        assert isinstance(err["error"]["type"], str), err
    message = err["error"]["message"]
    assert isinstance(message, str) and message and len(message) < 1000, err
    assert "bytearray(" not in message and "Traceback" not in message, message


@pytest.fixture
def no_errors_logged(caplog):
    """Nothing logged at ERROR while the test runs (a handled exception inside a stream counts)."""
    caplog.set_level(logging.INFO)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0].getMessage()[:2000]


FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("path", list(VALID))
def test_valid_bodies_are_valid(live_server, path):
    status, data = post(live_server.url, path, encode(VALID[path]))
    assert status == 200, data[:500]


@pytest.mark.parametrize("path", list(VALID))
def test_mutated_bodies_never_5xx(live_server, no_errors_logged, path):
    @FUZZ
    @given(body=mutated_bodies(path))
    def run(body: dict) -> None:
        check_answer(path, *post(live_server.url, path, encode(body)))

    run()


@pytest.mark.parametrize("path", list(VALID))
def test_random_json_never_5xx(live_server, no_errors_logged, path):
    @settings(FUZZ, max_examples=10)
    @given(body=json_values)
    def run(body: Any) -> None:
        check_answer(path, *post(live_server.url, path, encode(body)))

    run()


# ----- the crash sites found by fuzzing (issue 11, section 3), each by name -----------------------------------------

FORCED = {"/v1/chat/completions": {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
          "/v1/responses": {"tool_choice": {"type": "function", "name": "weather"}},
          "/v1/messages": {"tool_choice": {"type": "tool", "name": "weather"}},
          "/v1/messages/count_tokens": {"tool_choice": {"type": "tool", "name": "weather"}}}


def with_schema(path: str, schema: Any) -> dict:
    body = {**VALID[path], **FORCED[path]}
    if path == "/v1/chat/completions":
        body["tools"] = [{"type": "function", "function": {"name": "weather", "parameters": schema}}]
    elif path == "/v1/responses":
        body["tools"] = [{"type": "function", "name": "weather", "parameters": schema}]
    else:
        body["tools"] = [{"name": "weather", "input_schema": schema}]
    return body


@pytest.mark.parametrize("path", list(FORCED))
@pytest.mark.parametrize("schema", [{"type": "object", "required": [["a"]]}, {"type": "object", "required": 5},
                                    {"type": "object", "properties": ["a", "b"]},
                                    {"type": "object", "properties": {"a": 5}, "required": ["a", 7]},
                                    {"type": "object", "properties": {"a": {"anyOf": 3, "type": ["string", []]}}}])
def test_forced_tool_choice_tolerates_any_schema(live_server, no_errors_logged, path, schema):
    status, data = post(live_server.url, path, encode(with_schema(path, schema)))
    assert status == 200, data[:500]


RESPONSES_400 = [
    {"model": "x", "input": [{"type": ["x"]}]},
    {"model": "x", "input": [{"type": {"a": 1}}]},
    {"model": "x", "input": [{"type": "message", "role": "user", "content": [{"type": ["input_text"]}]}]},
    {"model": "x", "input": "hi", "tool_choice": {"type": ["function"]}},
    {"model": "x", "input": "hi", "tool_choice": {"type": {"x": 1}}},
    {"model": "x", "input": "hi", "tool_choice": {"type": "allowed_tools", "tools": [{"name": [1]}]}},
    {"model": "x", "input": "hi", "tool_choice": {"type": "function", "function": "weather"}},
    {"model": "x", "input": "hi", "tools": [{"type": ["function"], "name": "f"}]},
]


@pytest.mark.parametrize("body", RESPONSES_400)
def test_responses_wrong_types_are_400(live_server, no_errors_logged, body):
    status, data = post(live_server.url, "/v1/responses", encode(body))
    check_answer("/v1/responses", status, data)
    assert status == 400


def deep_sites(path: str, n: int) -> list[tuple[dict, bool]]:
    """(body, nested in the JSON itself) with an `n`-deep value in each place fuzzing found a RecursionError.

    Nested in the JSON: the edge rejects it past 64 levels. Nested inside a JSON string (tool-call arguments
    sent as text): the text is kept as it is when it will not parse, and the request is served.
    """
    base = VALID[path]
    out = [(with_schema(path, {"type": "object", "properties": {"a": deep(n)}}), True)] if path in FORCED else []
    if path == "/v1/chat/completions":
        call = ("messages", 2, "tool_calls", 0, "function", "arguments")
        out.append((mutate(base, call, "replace", deep(n)), True))
        out.append((mutate(base, call, "replace", deep_text(n, compact=True)), False))
        out.append(({**base, "chat_template_kwargs": {"x": deep(n)}}, True))
    if path == "/v1/messages":
        out.append((mutate(base, ("messages", 1, "content", 0, "input"), "replace", {"x": deep(n)}), True))
    if path == "/v1/responses":
        out.append((mutate(base, ("input", 1, "arguments"), "replace", deep_text(n, compact=True)), False))
    return out


@pytest.mark.parametrize("path", DIALECTS)
def test_deep_nesting_is_a_400_with_one_log_line(live_server, caplog, path):
    caplog.set_level(logging.INFO)
    sites = deep_sites(path, 1000)
    for body, in_json in sites:
        status, data = post(live_server.url, path, encode(body))
        check_answer(path, status, data)
        if in_json:
            assert status == 400 and b"levels deep" in data, data[:300]
    lines = sum(r.getMessage().count("\n") + 1 for r in caplog.records)
    assert lines <= 3 * len(sites), [r.getMessage()[:200] for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", DIALECTS)
def test_nesting_below_the_limit_is_served(live_server, no_errors_logged, path):
    for body, _ in deep_sites(path, 40):
        status, data = post(live_server.url, path, encode(body))
        assert status == 200, data[:300]


def test_a_failure_logs_one_line_and_a_bounded_traceback(caplog):
    log = logging.getLogger("lucebox.test")

    def recurse(a: int) -> int:
        return twice(a + 1)

    def twice(a: int) -> int:  # two alternating frames: Python's "[Previous line repeated]" cannot fold them
        return recurse(a + 1)

    try:
        recurse(0)
    except RecursionError:
        log_failure(log, "handler failed: %s %s", "POST", "/v1/x")
    (record,) = [r for r in caplog.records if r.name == "lucebox.test"]
    text = record.getMessage()
    assert text.splitlines()[0].startswith("handler failed: POST /v1/x: RecursionError: maximum recursion depth")
    assert text.count("File ") == TRACEBACK_FRAMES and len(text.splitlines()) < 4 * TRACEBACK_FRAMES + 3
    assert record.exc_info is None  # the formatter would print the whole traceback again


def test_garbage_http_is_answered_in_words(live_server):
    import socket

    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    message = json.loads(body)["error"]["message"]
    assert message == 'Malformed HTTP request: the request line "GARBAGE" is not of the form "METHOD /path HTTP/1.1".'


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_body_that_is_not_json_is_answered_in_words(live_server, path):
    status, data = post(live_server.url, path, b"GARBAGE")
    check_answer(path, status, data)
    assert status == 400 and "not valid JSON" in json.loads(data)["error"]["message"]


def anyof_chain(n: int) -> dict:
    """`n` nested anyOf schemas (built in the test process, where no body-depth limit applies)."""
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"anyOf": [schema]}
    return schema


@pytest.mark.parametrize("schema", [{"anyOf": 3}, {"oneOf": {"type": "string"}}, {"type": [["string"], 5]},
                                    {"enum": [[1], {"a": 1}]}, anyof_chain(2), anyof_chain(5000), [], 5, "string"])
def test_tool_call_parsing_tolerates_any_parameter_schema(schema):
    """The parser reads the declared types of a parameter from the client's schema: any JSON there is no error."""
    from lucebox.chat.events import ToolCallEnd
    from lucebox.chat.toolcalls import ToolCallParser

    tools = [{"name": "weather", "parameters": {"type": "object", "properties": {"days": schema}}}]
    parser = ToolCallParser(tools)
    events = parser.push("<tool_call>\n<function=weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                         "</tool_call>") + parser.finish()
    (call,) = [ev for ev in events if isinstance(ev, ToolCallEnd)]
    assert call.name == "weather" and json.loads(call.arguments)["days"] in (3, "3")
