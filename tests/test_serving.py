"""The server under concurrent load: batching is exact, long prompts don't stall streams,
disconnects leak nothing, a full queue answers in each dialect's overload shape."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.live_server import start_server

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "What does a compiler do?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
]


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def chat(url: str, question: str, max_tokens: int = 16) -> str:
    status, _, body = post(url, "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": max_tokens})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_concurrent_greedy_requests_equal_each_alone(live_server):
    alone = [chat(live_server.url, q) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: chat(live_server.url, q), QUESTIONS))
    assert together == alone


def stream_chat(url: str, question: str, max_tokens: int, out: list, close_after: int | None = None) -> None:
    """A raw-socket SSE client: appends (time, text) per content delta; may hang up after some deltas."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "x", "stream": True, "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": question}]}).encode()
    with socket.create_connection((host, int(port)), timeout=300) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        buf = b""
        while True:
            data = s.recv(65536)
            if not data:
                return
            buf += data
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                line = frame.split(b"data: ", 1)[-1]
                if line.strip() == b"[DONE]":
                    return
                try:
                    chunk = json.loads(line)
                except ValueError:
                    continue
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        out.append((time.monotonic(), choice["delta"]["content"]))
                if close_after is not None and len(out) >= close_after:
                    return  # hang up mid-stream


@pytest.fixture  # one test uses it: stopped right after, not kept beside the next server until the module ends
def small_chunks(smollm2_path):
    server = start_server(smollm2_path, max_step_tokens=128, max_num_seqs=16)
    yield server
    server.stop()


def test_long_prompt_does_not_stall_running_streams(small_chunks):
    """While 8 streams decode, a ~1900-token prompt arrives: every step that prefills a chunk of it also
    decodes every running stream, and each chunk stays within the step budget."""
    server = small_chunks
    eng = server.ctx.engine
    outs: list[list] = [[] for _ in range(8)]
    threads = [threading.Thread(target=stream_chat, args=(server.url, QUESTIONS[i % 6] + " Explain at length.",
                                                          64, outs[i])) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while sum(1 for o in outs if len(o) >= 3) < 8:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    long_text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(150))
    steps_before = len(eng.step_log)
    t0 = time.monotonic()
    text = chat(server.url, long_text + "\nSummarise.", max_tokens=4)
    prefill_window = time.monotonic() - t0
    for t in threads:
        t.join()
    log = [rows for _, rows in list(eng.step_log)[steps_before:]]
    chunked = [i for i, rows in enumerate(log) if any(n > 1 for _, _, n in rows)]
    assert len(chunked) >= 10, "the long prompt was not cut into chunks"
    streams = {sid for sid, start, n in log[chunked[0] - 1] if n == 1 and start > 0}
    assert len(streams) == 8
    for i in chunked:
        rows = log[i]
        assert sum(n for _, _, n in rows) <= 128, "a step went over its token budget"
        still_running = {sid for sid in streams if any(sid == s for later in log[i + 1:] for s, _, _ in later)}
        decoded = {sid for sid, start, n in rows if n == 1 and start > 0}
        assert still_running <= decoded, f"step {i} prefilled a chunk without decoding every running stream"
    # Timing, reported (not asserted: CI machines vary): the worst gap vs the steady gap.
    gaps = sorted(b[0] - a[0] for o in outs for a, b in zip(o, o[1:]))
    if gaps:
        print(f"[serving] long prefill {prefill_window:.2f}s; inter-token p50 {gaps[len(gaps) // 2] * 1000:.0f} ms, "
              f"max {gaps[-1] * 1000:.0f} ms")
        assert gaps[-1] < prefill_window / 3, "a stream stalled for most of the long prefill"
    assert text is not None
    server.wait_idle(timeout=120)


def test_64_streams_with_random_disconnects_leak_nothing(live_server):
    eng = live_server.ctx.engine
    before = eng.num_disconnects
    rng = random.Random(7)
    outs: list[list] = [[] for _ in range(64)]
    plan = [rng.choice([None, 1, 3, 6]) for _ in range(64)]
    threads = [threading.Thread(target=stream_chat, args=(live_server.url, QUESTIONS[i % 6], 12, outs[i], plan[i]))
               for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    live_server.wait_idle(timeout=300)
    assert eng.engine.blocks_in_use == 0, "KV blocks leaked"
    assert not eng.engine.scheduler.running and not eng.engine.scheduler.waiting
    hung_up = sum(1 for p, o in zip(plan, outs) if p is not None and len(o) >= p)
    assert eng.num_disconnects - before >= hung_up // 2, "disconnects were not noticed"
    finished = [o for p, o in zip(plan, outs) if p is None]
    assert all(finished), "a stream that stayed connected got no tokens"


@pytest.fixture(scope="module")
def tiny_queue(smollm2_path):
    server = start_server(smollm2_path, max_queue=1, max_num_seqs=1)
    yield server
    server.stop()


@pytest.mark.parametrize("path,body,status,shape", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 503, "openai"),
    ("/v1/responses", {"input": "hi"}, 503, "openai"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, 529, "anthropic"),
])
def test_full_queue_answers_with_the_dialects_overload_error(tiny_queue, path, body, status, shape):
    url = tiny_queue.url
    eng = tiny_queue.ctx.engine
    busy = [threading.Thread(target=chat, args=(url, "Count from one to one hundred.", 64)) for _ in range(2)]
    # One at a time, so the second cannot reach the queue before the first is admitted.
    for t, (attr, n) in zip(busy, [("num_running", 1), ("num_waiting", 1)]):
        t.start()
        deadline = time.monotonic() + 120
        while getattr(eng, attr) < n:  # then: one running, one waiting: the queue is full
            assert time.monotonic() < deadline, f"engine never had {attr} >= {n}"
            time.sleep(0.005)
    got, headers, reply = post(url, path, {"model": "x", "max_tokens": 4, **body})
    for t in busy:
        t.join()
    assert got == status, reply
    assert int(headers.get("Retry-After") or headers.get("retry-after")) >= 1
    if shape == "anthropic":
        assert reply["type"] == "error" and reply["error"]["type"] == "overloaded_error"
    else:
        assert reply["error"]["type"] == "overloaded_error"
    tiny_queue.wait_idle(timeout=120)
