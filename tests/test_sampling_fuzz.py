"""Random sampling parameters never reach the engine unless the sampler can compute them (issue 11, section 2).

One request with `repetition_penalty: 1e-300` or `top_k: 2**63` used to make the engine step raise and
fail every generation in flight. Here hypothesis sends random sampling fields (extreme and non-finite
floats, NaN/inf as JSON text allows them (`1e999`), 64-bit-and-beyond ints, negatives, wrong types) in
every dialect while 4 greedy streams run in a loop. Each answer must be a 200 exactly when the values
are in the documented ranges (`lucebox.api.common.SAMPLING_RANGES` and friends, restated below as the
contract) and a 4xx in the dialect's error shape otherwise; every stream must end with its normal text
(the same as alone), and nothing may be logged at ERROR.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
           "What does a compiler do?"]
STREAM_TOKENS = 40

FLOATS = {"temperature": (0.0, 100.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
          "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
          "repetition_penalty": (0.01, 100.0, False)}
"""field -> (low, high, low excluded): the ranges the API promises to accept."""
LIMIT_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
               "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}


class Raw(str):
    """JSON text sent as it is (1e999, NaN): what no JSON encoder writes but a client can send."""


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parsed(v: Any) -> Any:
    """The value the server sees: JSON integers beyond 64 bits arrive as floats; raw text as JSON reads it."""
    if isinstance(v, Raw):
        return float(v) if re.fullmatch(r"-?1e-999", v) else ValueError  # 1e-999 is 0.0; the rest is no JSON
    if is_int(v) and not -(2**63) <= v <= 2**64 - 1:
        return float(v)
    return v


IGNORED = {"/v1/messages": {"n", "logit_bias"}, "/v1/responses": {"logit_bias"}}
"""Fields a dialect does not have: ignored, as unknown fields are."""


def valid(name: str, v: Any, path: str = "") -> bool:
    """The contract: which values of each field are served (None means absent: the default)."""
    if name in IGNORED.get(path, ()):
        return True
    v = parsed(v)
    if v is ValueError:
        return False
    if v is None:
        return name != "limit"  # a missing limit is served too, but the fuzz never sends one (long generation)
    if name in FLOATS:
        lo, hi, lo_open = FLOATS[name]
        return is_number(v) and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if name == "top_k":
        return is_int(v) and -1 <= v <= 2**31 - 1
    if name == "seed":
        return is_int(v) and -(2**63) <= v <= 2**64 - 1
    if name == "limit":
        return is_int(v) and v >= 1
    if name == "n":
        return is_int(v) and v == 1
    if name == "logit_bias":
        return isinstance(v, dict) and all(
            re.fullmatch(r"[0-9]{1,10}", k) and is_number(b) and -100 <= b <= 100 for k, b in v.items())
    raise AssertionError(name)


numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e300, -1e300, 3.4e38, 1e39, 0.01, 0.0099, 100.0, 100.001,
                     1.0, 1.0000001, 2.0, 2.0000001, -2.0000001, 0.5, 0.7]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, -2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    st.sampled_from([Raw("1e999"), Raw("-1e999"), Raw("NaN"), Raw("Infinity"), Raw("1e-999")]),
)
wrong_types = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
values = st.one_of(numbers, numbers, wrong_types)
plain_values = st.one_of(numbers.filter(lambda v: not isinstance(v, Raw)), wrong_types)  # inside an object
limits = st.sampled_from([1, 2, 1, 2, 1, 2, 0, -1, 2**64, 1.5, "2", True, [], Raw("1e999")])
token_ids = st.one_of(st.sampled_from(["0", "42", "99999999999", "-1", "x"]), st.text(max_size=3))
NAMES = [*FLOATS, "top_k", "seed", "n", "logit_bias"]


def in_range(name: str) -> st.SearchStrategy:
    """Values the contract accepts: these must run through the sampler."""
    if name in FLOATS:
        lo, hi, lo_open = FLOATS[name]
        return st.floats(lo, hi, exclude_min=lo_open)
    if name == "top_k":
        return st.one_of(st.integers(-1, 2**31 - 1), st.integers(-1, 100))
    if name == "seed":
        return st.integers(-(2**63), 2**64 - 1)
    if name == "n":
        return st.just(1)
    return st.dictionaries(st.integers(0, 10**10 - 1).map(str), st.floats(-100, 100), max_size=3)


def field_value(name: str) -> st.SearchStrategy:
    hostile = st.dictionaries(token_ids, plain_values, max_size=3) if name == "logit_bias" else numbers
    return st.one_of(in_range(name), hostile, wrong_types)


params = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: field_value(name) for name in names}))


def body_text(path: str, fields: dict[str, Any], limit: Any) -> bytes:
    """The request body, with Raw values written in as they are."""
    base: dict[str, Any] = {"model": "m"}
    if path == "/v1/completions":
        base["prompt"] = "Once upon a time"
    elif path == "/v1/responses":
        base["input"] = "Say hi."
    else:
        base["messages"] = [{"role": "user", "content": "Say hi."}]
    items = [*base.items(), (LIMIT_FIELD[path], limit), *fields.items()]
    text = ", ".join(f"{json.dumps(k)}: {v if isinstance(v, Raw) else json.dumps(v)}" for k, v in items)
    return ("{" + text + "}").encode()


def connect(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=120)


def stream_text(url: str, prompt: str) -> str:
    """One greedy chat stream of STREAM_TOKENS tokens (EOS ignored, so every run is the same length)."""
    conn = connect(url)
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200, reply.read()[:300]
    text, finish = [], None
    for line in reply:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    conn.close()
    assert finish == "length", finish
    return "".join(text)


class Streams:
    """4 threads, each running its greedy stream again and again until `stop`; every run compared to `reference`."""

    def __init__(self, url: str, reference: list[str]) -> None:
        self.url, self.reference = url, reference
        self.stop = threading.Event()
        self.runs = [0] * len(reference)
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(reference))]

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                got = stream_text(self.url, PROMPTS[i])
            except Exception as exc:  # noqa: BLE001 - reported by the test, with the stream it hit
                self.failures.append(f"stream {i}: {type(exc).__name__}: {exc}")
                return
            if got != self.reference[i]:
                self.failures.append(f"stream {i}: {got!r} != {self.reference[i]!r}")
                return
            self.runs[i] += 1

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def check(path: str, status: int, data: bytes, ok: bool) -> None:
    if ok:
        assert status == 200, data[:300]
        return
    assert 400 <= status < 500, (status, data[:300])
    err = json.loads(data)
    if path == "/v1/messages":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    else:
        assert err["error"]["type"] == "invalid_request_error" and isinstance(err["error"]["message"], str), err


def test_random_sampling_parameters_never_break_running_streams(live_server, caplog):
    caplog.set_level(logging.WARNING)
    reference = [stream_text(live_server.url, p) for p in PROMPTS]
    conn = connect(live_server.url)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(path=st.sampled_from(list(LIMIT_FIELD)), fields=params, limit=limits)
    def poison(path: str, fields: dict[str, Any], limit: Any) -> None:
        ok = valid("limit", limit) and all(valid(k, v, path) for k, v in fields.items())
        conn.request("POST", path, body_text(path, fields, limit), {"content-type": "application/json"})
        reply = conn.getresponse()
        check(path, reply.status, reply.read(), ok)

    with Streams(live_server.url, reference) as streams:
        try:
            poison()
        finally:
            conn.close()
    assert not streams.failures, streams.failures
    assert all(streams.runs), streams.runs  # every stream finished at least once while the requests came in
    errors = [r.getMessage()[:500] for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


POISON = [{"repetition_penalty": 1e-300, "temperature": 0.7}, {"top_k": 2**63}, {"seed": 2**64},
          {"temperature": 1e300}, {"min_p": 1.5}, {"logit_bias": {"42": 1e9}}, {"top_p": Raw("1e999")}]


@pytest.mark.parametrize(("path", "fields"), [(path, fields) for path in LIMIT_FIELD for fields in POISON
                                              if not set(fields) & IGNORED.get(path, set())])
def test_reported_poison_values_are_400_naming_the_field(live_server, path, fields):
    conn = connect(live_server.url)
    conn.request("POST", path, body_text(path, fields, 2), {"content-type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    check(path, reply.status, data, False)
    if not any(isinstance(v, Raw) for v in fields.values()):  # 1e999 is a JSON error, not a field's
        name = next(k for k in fields if k != "temperature" or len(fields) == 1)
        assert name in json.loads(data)["error"]["message"]


def test_values_at_the_edges_of_the_ranges_are_served(live_server):
    """Each range's extremes really run through the sampler (a 200 with the tokens asked for)."""
    edges = [{"temperature": 100.0, "top_p": 5e-324}, {"temperature": 1.0, "repetition_penalty": 0.01},
             {"temperature": 1.0, "repetition_penalty": 100.0, "presence_penalty": -2, "frequency_penalty": 2},
             {"temperature": 1.0, "top_k": 2**31 - 1, "min_p": 1.0, "seed": 2**64 - 1},
             {"temperature": 0.5, "seed": -(2**63), "top_k": -1, "logit_bias": {"0": -100, "1": 100}}]
    for fields in edges:
        conn = connect(live_server.url)
        conn.request("POST", "/v1/chat/completions", body_text("/v1/chat/completions", fields, 4),
                     {"content-type": "application/json"})
        reply = conn.getresponse()
        data = json.loads(reply.read())
        conn.close()
        assert reply.status == 200, data
        assert data["usage"]["completion_tokens"] >= 1, data
