"""SIGTERM while streams are open: each one ends in its dialect's way, then the server exits 0 (issue 11, s. 8).

Before, the streams still running after the grace period were cut mid-body: no finish reason, no error
frame, no `[DONE]` (the log said `200 ... cancelled=1`), which clients report as a network failure at
best. Now, after the grace, every generation is cancelled and each stream renders that end: OpenAI chat an
error data frame then `[DONE]`, Responses `response.failed`, Anthropic an `error` event; a non-streaming
request gets an error answer. This runs the real `python -m lucebox serve` on the default model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lucebox import procs

ROOT = Path(__file__).resolve().parents[1]
LONG = [{"role": "user", "content": "Count from 1 to 5000, one number per line."}]
REQUESTS = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": LONG, "max_tokens": 4000, "stream": True,
                                      "ignore_eos": True}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "1, 2, 3,", "max_tokens": 4000, "stream": True,
                                        "ignore_eos": True}),
    "responses": ("/v1/responses", {"model": "m", "input": LONG, "max_output_tokens": 4000, "stream": True,
                                    "ignore_eos": True}),
    "messages": ("/v1/messages", {"model": "m", "messages": LONG, "max_tokens": 4000, "stream": True,
                                  "ignore_eos": True}),
    "chat-whole": ("/v1/chat/completions", {"model": "m", "messages": LONG, "max_tokens": 4000,
                                            "ignore_eos": True}),
}


def start_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_all(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def dechunk(body: bytes) -> tuple[bytes, bool]:
    """(payload, whether the chunked body ended with its terminating chunk)."""
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out, True
        out += rest[:size]
        body = rest[size + 2:]
    return out, False


def sse(payload: bytes) -> list[tuple[str | None, str]]:
    frames = []
    for block in payload.decode().split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            frames.append((event, "\n".join(data)))
    return frames


@pytest.fixture(scope="module")
def sigtermed(smollm2_path, tmp_path_factory):
    """Serve, open one request per dialect, wait until each streams, SIGTERM; (replies, exit code, log)."""
    log_path = tmp_path_factory.mktemp("shutdown") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LUCEBOX_API_KEY", None)
    cmd = [sys.executable, "-m", "lucebox", "serve", "--model", str(smollm2_path), "--port", "0",
           "--kv-tokens", "4096", "--max-num-seqs", "8", "--no-prefix-cache", "--prefill-compression", "off",
           "--shutdown-grace", "1"]
    with open(log_path, "w") as log, procs.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                cwd=ROOT) as proc:
        try:
            port = None
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                text = log_path.read_text()
                if port is None and "listening on http://" in text:
                    port = int(text.split("listening on http://", 1)[1].split()[0].rsplit(":", 1)[1])
                if port is not None:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        pass
                time.sleep(0.5)
            else:
                pytest.fail("server did not become ready: " + log_path.read_text()[-3000:])
            socks = {name: start_request(port, path, body) for name, (path, body) in REQUESTS.items()}
            first = {name: read_all_until(s, b"data: ", 120) for name, s in socks.items() if name != "chat-whole"}
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            replies = {name: first.get(name, b"") + read_all(s, 30) for name, s in socks.items()}
            for s in socks.values():
                s.close()
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return replies, code, log_path.read_text()


def read_all_until(sock: socket.socket, marker: bytes, seconds: float) -> bytes:
    """Read until `marker` shows up (the stream is producing), keeping what was read."""
    sock.settimeout(seconds)
    data = b""
    while marker not in data.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def stream_frames(reply: bytes) -> list[tuple[str | None, str]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    payload, terminated = dechunk(body)
    assert terminated, "the stream was cut instead of ended: " + payload[-500:].decode(errors="replace")
    return sse(payload)


def test_server_exits_0_after_ending_every_stream(sigtermed):
    _, code, log = sigtermed
    assert code == 0, log[-3000:]
    assert "ending 5 request(s) still running after the 1.0 s grace period" in log
    assert "cancelling" not in log  # none had to be cut


@pytest.mark.parametrize("name", ["chat", "completions"])
def test_openai_stream_ends_with_an_error_frame_then_done(sigtermed, name):
    frames = stream_frames(sigtermed[0][name])
    assert len(frames) > 2 and frames[-1] == (None, "[DONE]")
    error = json.loads(frames[-2][1])["error"]
    assert error["type"] == "overloaded_error" and "shutting down" in error["message"]


def test_responses_stream_ends_with_response_failed(sigtermed):
    frames = stream_frames(sigtermed[0]["responses"])
    event, data = frames[-1]
    assert event == "response.failed"
    failed = json.loads(data)
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "shutting down" in failed["response"]["error"]["message"]


def test_anthropic_stream_ends_with_an_error_event(sigtermed):
    frames = stream_frames(sigtermed[0]["messages"])
    event, data = frames[-1]
    assert event == "error" and not any(e == "message_stop" for e, _ in frames)
    error = json.loads(data)
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "shutting down" in error["error"]["message"]


def test_non_streaming_request_gets_an_error_answer(sigtermed):
    head, _, body = sigtermed[0]["chat-whole"].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert b"connection: close" in head.lower()
    assert "shutting down" in json.loads(body)["error"]["message"]
