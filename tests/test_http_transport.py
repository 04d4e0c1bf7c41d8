"""HTTP transport over real sockets: framing, limits, routing, auth, CORS, SSE, disconnects, shutdown.

Most tests talk raw HTTP/1.1 through a socket (so the bytes on the wire are what
is checked, with a response parser written here, independent of h11), and run
once on plain asyncio and once on uvloop. A few use real client libraries
(urllib, httpx2) and one runs `run()` in a subprocess and sends it SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http import HTTPStatus
from pathlib import Path

import orjson
import pytest

from lucebox import procs
from lucebox.errors import LuceboxError
from lucebox.http import HttpError, HttpServer, Request, Response, Router, encode_comment, encode_event, error_body, run

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test environment
    uvloop = None

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request):
    """Run a coroutine to completion on the chosen event loop."""
    if request.param == "uvloop" and uvloop is None:
        pytest.skip("uvloop not installed")

    def runner(coro):
        return uvloop.run(coro) if request.param == "uvloop" else asyncio.run(coro)

    return runner


# -- a raw HTTP/1.1 client ---------------------------------------------------------------


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return orjson.loads(self.body)

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.headers}, {self.body[:200]!r})"


class Raw:
    """Writes bytes exactly as given; parses responses (Content-Length, chunked, read-to-EOF) itself."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, server: HttpServer) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", server.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(self, timeout: float = 5.0) -> tuple[int, dict[str, str]]:
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = raw.decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ")[:2]
        assert version == "HTTP/1.1", lines[0]
        assert lines[0] == f"{version} {status} {HTTPStatus(int(status)).phrase}"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return int(status), headers

    async def chunk(self, timeout: float = 5.0) -> bytes:
        """One chunk of a chunked body; b"" for the last one."""
        size_line = await asyncio.wait_for(self.reader.readuntil(b"\r\n"), timeout)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            assert await asyncio.wait_for(self.reader.readuntil(b"\r\n"), timeout) == b"\r\n"  # no trailers
            return b""
        data = await asyncio.wait_for(self.reader.readexactly(size + 2), timeout)
        assert data.endswith(b"\r\n")
        return data[:-2]

    async def response(self, timeout: float = 5.0, head_request: bool = False) -> Reply:
        status, headers = await self.head(timeout)
        if head_request:
            body = b""
        elif "content-length" in headers:
            body = await asyncio.wait_for(self.reader.readexactly(int(headers["content-length"])), timeout)
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while part := await self.chunk(timeout):
                parts.append(part)
            body = b"".join(parts)
        elif status in (204, 304) or status < 200:
            body = b""
        else:
            body = await asyncio.wait_for(self.reader.read(), timeout)
        return Reply(status, headers, body)

    async def at_eof(self, timeout: float = 3.0) -> bool:
        """True when the server closed the connection (nothing more arrives)."""
        try:
            rest = await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionResetError:
            return True
        assert rest == b"", rest
        return True

    def close(self) -> None:
        self.writer.close()


async def request(server: HttpServer, method: str, target: str, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> Reply:
    """One request on a fresh connection."""
    client = await Raw.connect(server)
    try:
        await client.send(http_bytes(method, target, body, headers))
        return await client.response()
    finally:
        client.close()


def http_bytes(method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost"]
    if body and not any(k.lower() == "content-type" for k in headers or {}):
        lines.append("Content-Type: application/json")  # what every JSON client sends (security.py requires it)
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# -- test handlers -------------------------------------------------------------------------


async def hello(request: Request, response: Response) -> None:
    await response.send_json(200, {"path": request.path, "query": request.query, "client_port": request.client[1]})


async def echo(request: Request, response: Response) -> None:
    await response.send_json(200, {"len": len(request.body), "body": request.body.decode("latin-1"),
                                   "type": request.headers.get("Content-Type")})


def make_router() -> Router:
    router = Router()
    router.add("GET", "/hello", hello)
    router.add("POST", "/echo", echo)
    router.add("GET", "/health", hello)
    router.add("GET", "/", hello)
    router.add("POST", "/v1/chat/completions", echo)
    router.add("POST", "/v1/messages", echo)
    return router


# -- framing, keep-alive, pipelining ---------------------------------------------------------


def test_keepalive_two_requests_on_one_connection(arun):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            assert server.port != 0
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/hello?a=1&b=x%20y"))
            first = await client.response()
            await client.send(http_bytes("POST", "/echo", b'{"k": 1}', {"Content-Type": "application/json"}))
            second = await client.response()
            client.close()
        assert first.status == 200 and first.headers["content-type"] == "application/json"
        assert first.json()["query"] == {"a": "1", "b": "x y"}
        assert "close" not in first.headers.get("connection", "")
        assert second.json() == {"len": 8, "body": '{"k": 1}', "type": "application/json"}
        local_port = client.writer.get_extra_info("sockname")[1]
        assert first.json()["client_port"] == local_port  # the same socket served both

    arun(main())


def test_chunked_request_body(arun):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            client = await Raw.connect(server)
            await client.send(b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
            for piece in (b"hello ", b"chunked ", b"world"):
                await client.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                await asyncio.sleep(0.02)
            await client.send(b"0\r\n\r\n")
            reply = await client.response()
            client.close()
        assert reply.status == 200
        assert reply.json()["body"] == "hello chunked world"

    arun(main())


def test_expect_100_continue(arun):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            client = await Raw.connect(server)
            await client.send(b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n")
            interim = await client.response()
            await client.send(b"12345")
            final = await client.response()
            client.close()
        assert interim.status == 100
        assert final.status == 200 and final.json()["body"] == "12345"

    arun(main())


def test_pipelined_requests_answered_in_order(arun):
    order = []

    async def slow(request: Request, response: Response) -> None:
        order.append("slow-start")
        await asyncio.sleep(0.1)
        order.append("slow-end")
        await response.send_json(200, {"n": 1})

    async def fast(request: Request, response: Response) -> None:
        order.append("fast")
        await response.send_json(200, {"n": request.query["n"]})

    async def main():
        router = make_router()
        router.add("GET", "/slow", slow)
        router.add("GET", "/fast", fast)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/slow") + http_bytes("POST", "/echo", b"abc")
                              + http_bytes("GET", "/fast?n=3"))
            replies = [await client.response() for _ in range(3)]
            client.close()
        assert [r.status for r in replies] == [200, 200, 200]
        assert replies[0].json() == {"n": 1} and replies[1].json()["body"] == "abc"
        assert replies[2].json() == {"n": "3"}
        assert order == ["slow-start", "slow-end", "fast"]  # one at a time, in order

    arun(main())


def test_idle_keepalive_connection_is_closed(arun):
    async def main():
        async with HttpServer(make_router(), port=0, keepalive_timeout=0.2) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/hello"))
            assert (await client.response()).status == 200
            t0 = time.monotonic()
            assert await client.at_eof(timeout=2.0)
            assert 0.1 < time.monotonic() - t0 < 1.5
            client.close()

    arun(main())


def test_head_http10_and_connection_close(arun):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("HEAD", "/hello") + http_bytes("HEAD", "/nope") + http_bytes("GET", "/hello"))
            head_ok = await client.response(head_request=True)
            head_missing = await client.response(head_request=True)
            after = await client.response()
            client.close()
            old = await Raw.connect(server)
            await old.send(b"GET /hello HTTP/1.0\r\n\r\n")
            old_reply = await old.response()
            old_closed = await old.at_eof()
            old.close()
            closing = await Raw.connect(server)
            await closing.send(http_bytes("GET", "/hello", headers={"Connection": "close"}))
            close_reply = await closing.response()
            close_closed = await closing.at_eof()
            closing.close()
        assert head_ok.status == 200 and int(head_ok.headers["content-length"]) > 0
        assert head_missing.status == 404
        assert after.status == 200 and after.json()["path"] == "/hello"  # no stray body bytes in between
        assert old_reply.status == 200 and old_reply.json()["path"] == "/hello" and old_closed
        assert close_reply.status == 200 and close_reply.headers["connection"] == "close" and close_closed

    arun(main())


# -- limits and malformed input ------------------------------------------------------------


def test_body_too_large_413(arun):
    async def main():
        async with HttpServer(make_router(), port=0, max_body=1000) as server:
            # declared too large: answered before the body is sent
            client = await Raw.connect(server)
            await client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5000\r\n\r\n")
            declared = await client.response()
            assert await client.at_eof()
            client.close()
            # chunked, grows past the limit while it is read; Anthropic path -> Anthropic shape
            client = await Raw.connect(server)
            await client.send(b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: localhost\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
            for _ in range(3):
                await client.send(b"200\r\n" + b"x" * 0x200 + b"\r\n")
            chunked = await client.response()
            client.close()
            # within the limit still works
            ok = await request(server, "POST", "/echo", b"y" * 1000)
        assert declared.status == 413
        assert declared.headers["connection"] == "close"
        err = declared.json()["error"]
        assert err["type"] == "request_too_large" and "1000" in err["message"] and "param" in err
        assert chunked.status == 413
        assert chunked.json()["type"] == "error" and chunked.json()["error"]["type"] == "request_too_large"
        assert ok.status == 200 and ok.json()["len"] == 1000

    arun(main())


def test_413_reaches_a_client_that_keeps_uploading(arun):
    # Closing a socket with unread input sends a TCP reset, which destroys the answer in the client's
    # receive buffer; the server must drain the upload after answering instead.
    async def main():
        async with HttpServer(make_router(), port=0, max_body=1000) as server:
            client = await Raw.connect(server)
            size = 8 << 20
            client.writer.write(b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % size)

            async def upload():
                try:
                    for _ in range(size >> 16):
                        client.writer.write(b"u" * (1 << 16))
                        await client.writer.drain()
                except ConnectionError:
                    pass

            uploading = asyncio.ensure_future(upload())
            await asyncio.sleep(0.2)  # the answer is sent while the upload is still going on
            reply = await client.response()
            await uploading
            client.close()
        return reply

    reply = arun(main())
    assert reply.status == 413


def test_header_too_large_431(arun):
    async def main():
        async with HttpServer(make_router(), port=0, max_header=8 * 1024) as server:
            # the whole head at once (h11 would parse it: the server's own size check answers)
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/hello", headers={"X-Big": "a" * 20000}))
            whole = await client.response()
            client.close()
            # a head that never ends, growing past the limit
            client = await Raw.connect(server)
            await client.send(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n")
            for i in range(20):
                await client.send(b"X-H%d: %s\r\n" % (i, b"b" * 1000))
            endless = await client.response()
            client.close()
            normal = await request(server, "GET", "/hello", headers={"X-Small": "c" * 1000})
        for reply in (whole, endless):
            assert reply.status == 431, reply
            assert "too large" in reply.json()["error"]["message"]
        assert normal.status == 200

    arun(main())


def test_slow_headers_408_and_silent_idle_close(arun):
    async def main():
        async with HttpServer(make_router(), port=0, header_timeout=0.3) as server:
            client = await Raw.connect(server)
            t0 = time.monotonic()
            await client.send(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n")  # never finishes the head
            reply = await client.response()
            elapsed = time.monotonic() - t0
            assert await client.at_eof()
            client.close()
            # a connection that sends nothing at all is closed without an answer
            silent = await Raw.connect(server)
            assert await asyncio.wait_for(silent.reader.read(), 3.0) == b""
            silent.close()
        assert reply.status == 408 and reply.headers["connection"] == "close"
        assert 0.25 < elapsed < 2.0
        assert reply.json()["error"]["message"]

    arun(main())


@pytest.mark.parametrize("garbage", [b"GARBAGE\r\n\r\n",
                                     b"GET /hello HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n",
                                     b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: nope\r\n\r\n"])
def test_malformed_request_400(arun, garbage):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            client = await Raw.connect(server)
            await client.send(garbage)
            reply = await client.response()
            assert await client.at_eof()
            client.close()
        assert reply.status == 400
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert "Malformed" in reply.json()["error"]["message"]

    arun(main())


# -- routing, CORS, auth, error shapes -------------------------------------------------------


def test_404_405_and_query_ignored_for_routing(arun):
    async def main():
        async with HttpServer(make_router(), port=0) as server:
            missing = await request(server, "GET", "/nope?x=1")
            missing_anthropic = await request(server, "GET", "/v1/messages/nope")
            wrong = await request(server, "GET", "/v1/messages?beta=true")
            routed = await request(server, "POST", "/v1/messages?beta=true", b"{}")
        assert missing.status == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
        assert "/nope" in missing.json()["error"]["message"]
        assert missing_anthropic.status == 404
        assert missing_anthropic.json() == {"type": "error", "error": {
            "type": "not_found_error", "message": missing_anthropic.json()["error"]["message"]}}
        assert wrong.status == 405 and wrong.headers["allow"] == "OPTIONS, POST"
        assert wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "invalid_request_error"
        assert routed.status == 200 and routed.json()["body"] == "{}"

    arun(main())


def test_options_preflight_and_cors_headers(arun):
    origin = {"Origin": "http://localhost:3000"}
    async def main():
        async with HttpServer(make_router(), port=0, api_key="k") as server:
            pre = await request(server, "OPTIONS", "/v1/chat/completions",
                                headers={**origin, "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type"})
            anywhere = await request(server, "OPTIONS", "/not/a/route", headers=origin)
            no_origin = await request(server, "OPTIONS", "/v1/chat/completions")
            get = await request(server, "GET", "/health", headers=origin)
            missing = await request(server, "GET", "/nope", headers={"x-api-key": "k", **origin})
            plain = await request(server, "GET", "/health")
        for reply in (pre, anywhere):
            assert reply.status == 204 and reply.body == b"" and "content-length" not in reply.headers
            assert reply.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert reply.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
        assert pre.headers["access-control-allow-headers"].startswith("*")
        assert "authorization" in pre.headers["access-control-allow-headers"]
        assert no_origin.status == 204 and not [h for h in no_origin.headers if h.startswith("access-control-")]
        for reply in (get, missing):  # every response to an allowed origin, errors included
            assert reply.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert reply.headers["vary"] == "Origin"
        assert plain.status == 200 and "access-control-allow-origin" not in plain.headers  # no Origin, no CORS

    arun(main())


def test_no_cors(arun):
    async def main():
        origin = {"Origin": "http://localhost:3000"}
        async with HttpServer(make_router(), port=0, cors=False) as server:
            replies = [await request(server, "GET", "/hello", headers=origin),
                       await request(server, "OPTIONS", "/hello"), await request(server, "GET", "/nope")]
        assert [r.status for r in replies] == [403, 204, 404]  # without CORS only same-origin pages get through
        for reply in replies:
            assert not [h for h in reply.headers if h.startswith("access-control-")]

    arun(main())


def test_api_key_auth_in_both_shapes(arun):
    async def main():
        async with HttpServer(make_router(), port=0, api_key="sekret") as server:
            return {
                "openai_none": await request(server, "POST", "/v1/chat/completions", b"{}"),
                "anthropic_none": await request(server, "POST", "/v1/messages?beta=true", b"{}"),
                "wrong": await request(server, "POST", "/v1/chat/completions", b"{}",
                                       {"Authorization": "Bearer nope"}),
                "bearer": await request(server, "POST", "/v1/chat/completions", b"{}",
                                        {"Authorization": "Bearer sekret"}),
                "x_api_key": await request(server, "POST", "/v1/messages?beta=true", b"{}", {"x-api-key": "sekret"}),
                "unknown_path": await request(server, "GET", "/secret-route"),
                "health": await request(server, "GET", "/health"),
                "root": await request(server, "GET", "/"),
            }

    r = arun(main())
    assert r["openai_none"].status == 401
    err = r["openai_none"].json()["error"]
    assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert err["param"] is None and err["code"] is None
    assert r["anthropic_none"].status == 401
    assert r["anthropic_none"].json()["type"] == "error"
    assert r["anthropic_none"].json()["error"]["type"] == "authentication_error"
    assert r["wrong"].status == 401
    assert r["bearer"].status == 200 and r["x_api_key"].status == 200
    assert r["unknown_path"].status == 401  # routes are not revealed without a key
    assert r["health"].status == 200 and r["root"].status == 200


def test_handler_errors_are_shaped_and_500_hides_the_traceback(arun, caplog):
    async def crash(request: Request, response: Response) -> None:
        raise RuntimeError("secret internal detail")

    async def bad_input(request: Request, response: Response) -> None:
        raise HttpError(400, "messages: expected a list", param="messages")

    async def user_error(request: Request, response: Response) -> None:
        raise LuceboxError("the model file is truncated")

    async def busy(request: Request, response: Response) -> None:
        raise HttpError(503, "queue is full", headers={"Retry-After": "2"})

    async def parse(request: Request, response: Response) -> None:
        await response.send_json(200, request.json())

    async def silent(request: Request, response: Response) -> None:
        pass

    async def main():
        router = make_router()
        for path, handler in [("/crash", crash), ("/bad", bad_input), ("/user", user_error), ("/busy", busy),
                              ("/parse", parse), ("/silent", silent), ("/v1/messages/crash", crash)]:
            router.add("POST", path, handler)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            replies = {}
            for path, body in [("/crash", b""), ("/bad", b""), ("/user", b""), ("/busy", b""),
                               ("/parse", b"{not json"), ("/parse", b""), ("/silent", b""),
                               ("/v1/messages/crash", b""), ("/echo", b"still alive")]:
                await client.send(http_bytes("POST", path, body))
                replies.setdefault(path, []).append(await client.response())  # same connection throughout
            client.close()
        return replies

    with caplog.at_level(logging.INFO, logger="lucebox.http"):
        r = arun(main())
    crash_reply = r["/crash"][0]
    assert crash_reply.status == 500
    assert crash_reply.json()["error"]["type"] == "server_error"
    assert b"secret" not in crash_reply.body and b"Traceback" not in crash_reply.body
    assert "secret internal detail" in caplog.text and "Traceback" in caplog.text  # the log has it
    assert r["/v1/messages/crash"][0].json()["error"]["type"] == "api_error"
    bad = r["/bad"][0]
    assert bad.status == 400 and bad.json()["error"]["param"] == "messages"
    assert r["/user"][0].status == 400 and "truncated" in r["/user"][0].json()["error"]["message"]
    busy_reply = r["/busy"][0]
    assert busy_reply.status == 503 and busy_reply.headers["retry-after"] == "2"
    assert busy_reply.json()["error"]["type"] == "overloaded_error"
    invalid, empty = r["/parse"]
    assert invalid.status == 400 and "not valid JSON" in invalid.json()["error"]["message"]
    assert empty.status == 400 and "empty" in empty.json()["error"]["message"]
    assert r["/silent"][0].status == 500
    assert r["/echo"][0].status == 200


def test_headers_are_case_insensitive():
    from lucebox.http import Headers

    headers = Headers([("Content-Type", "application/json"), ("X-Tag", "a"), ("x-tag", "b")])
    assert headers["content-type"] == headers.get("CONTENT-TYPE") == "application/json"
    assert headers["X-TAG"] == "a, b" and headers.get_all("x-Tag") == ["a", "b"]
    assert "x-tag" in headers and "missing" not in headers and headers.get("missing") is None
    assert list(headers) == ["content-type", "x-tag"] and len(headers) == 2


def test_error_body_shapes():
    assert error_body("/v1/chat/completions", 400, "bad", param="x") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
    assert error_body("/v1/messages", 429, "slow down") == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert error_body("/v1/messages/count_tokens", 500, "x")["error"]["type"] == "api_error"
    assert error_body("/v1/responses", 503, "x", type="overloaded_error")["error"]["type"] == "overloaded_error"
    assert error_body("/v1/messagesX", 404, "x")["error"]["type"] == "invalid_request_error"  # not Anthropic


def test_request_log_line_with_extra_fields(arun, caplog):
    async def counted(request: Request, response: Response) -> None:
        request.log_fields["tokens"] = 42
        await response.send_text(200, "hello")

    async def main():
        router = make_router()
        router.add("GET", "/counted", counted)
        async with HttpServer(router, port=0) as server:
            await request(server, "GET", "/counted?secret=1")

    with caplog.at_level(logging.INFO, logger="lucebox.http"):
        arun(main())
    lines = [rec.getMessage() for rec in caplog.records if "/counted" in rec.getMessage()]
    assert len(lines) == 1
    parts = lines[0].split()
    assert parts[1:4] == ["GET", "/counted", "200"] and parts[4].endswith("ms") and parts[5] == "5B"
    assert "tokens=42" in parts and "secret" not in lines[0]


# -- SSE and streaming ----------------------------------------------------------------------


def test_sse_encoding():
    assert encode_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert encode_event("one\ntwo\r\nthree\rfour", event="delta") == (
        b"event: delta\ndata: one\ndata: two\ndata: three\ndata: four\n\n")
    assert encode_event(b"x\n") == b"data: x\ndata: \n\n"
    assert encode_event("caf\u00e9") == "data: caf\u00e9\n\n".encode()
    assert encode_comment("ping") == b": ping\n\n"
    with pytest.raises(ValueError, match="line break"):
        encode_event("x", event="a\nb")


def test_sse_frames_arrive_one_by_one(arun):
    sent_at: list[float] = []

    async def stream(request: Request, response: Response) -> None:
        await response.start_stream()
        for i in range(3):
            if i:
                await asyncio.sleep(0.2)
            sent_at.append(time.monotonic())
            await response.send_event(orjson.dumps({"i": i, "text": "a\nb"}) if i < 2 else "line1\nline2",
                                      event="tick")
        await response.end()

    async def main():
        router = make_router()
        router.add("GET", "/stream", stream)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/stream"))
            status, headers = await client.head()
            frames = []
            while frame := await client.chunk():
                frames.append((time.monotonic(), frame))
            await client.send(http_bytes("GET", "/hello"))  # the connection is reusable afterwards
            after = await client.response()
            client.close()
        return status, headers, frames, after

    status, headers, frames, after = arun(main())
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert headers["transfer-encoding"] == "chunked"
    assert [f for _, f in frames] == [b'event: tick\ndata: {"i":0,"text":"a\\nb"}\n\n',
                                      b'event: tick\ndata: {"i":1,"text":"a\\nb"}\n\n',
                                      b"event: tick\ndata: line1\ndata: line2\n\n"]
    assert frames[0][0] < sent_at[2]  # the first frame was in the client's hands before the last was sent
    assert frames[2][0] - frames[0][0] > 0.3
    assert after.status == 200


def test_stream_write_backpressure(arun):
    chunk = b"z" * (1 << 20)
    total = 64
    progress = {"written": 0, "done": False}

    async def flood(request: Request, response: Response) -> None:
        await response.start_stream(content_type="application/octet-stream")
        for _ in range(total):
            await response.write(chunk)
            progress["written"] += 1
        await response.end()
        progress["done"] = True

    async def main():
        router = make_router()
        router.add("GET", "/flood", flood)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/flood"))
            await asyncio.sleep(0.5)  # not reading: the handler must be held back
            held_at = progress["written"]
            reply = await client.response(timeout=30)
            client.close()
        return held_at, reply

    held_at, reply = arun(main())
    assert held_at < total // 2, f"handler wrote {held_at} MiB into a client that was not reading"
    assert progress["done"] and len(reply.body) == total * len(chunk)


def test_real_client_httpx2_stream_and_keepalive(arun):
    httpx2 = pytest.importorskip("httpx2")

    async def stream(request: Request, response: Response) -> None:
        await response.start_stream()
        for i in range(3):
            await response.send_event(orjson.dumps({"i": i}))
        await response.send_event("[DONE]")
        await response.end()

    async def main():
        router = make_router()
        router.add("GET", "/stream", stream)
        async with HttpServer(router, port=0) as server, httpx2.AsyncClient(base_url=server.url) as http:
            async with http.stream("GET", "/stream") as resp:
                lines = [line async for line in resp.aiter_lines() if line]
                ctype = resp.headers["content-type"]
            posted = await http.post("/echo", json={"x": 1})
        return ctype, lines, posted.status_code, posted.json()

    ctype, lines, status, body = arun(main())
    assert ctype == "text/event-stream"
    assert lines == ['data: {"i":0}', 'data: {"i":1}', 'data: {"i":2}', "data: [DONE]"]
    assert status == 200 and body["body"] == '{"x":1}'


def test_real_client_urllib_json(arun):
    def fetch(url: str, data: bytes | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, orjson.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())

    async def main():
        async with HttpServer(make_router(), port=0) as server:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(None, fetch, server.url + "/echo", b'{"hello": "world"}')
            missing = await loop.run_in_executor(None, fetch, server.url + "/v1/nothing")
        return ok, missing

    (status, body), (missing_status, missing_body) = arun(main())
    assert status == 200 and orjson.loads(body["body"]) == {"hello": "world"}
    assert missing_status == 404 and missing_body["error"]["type"] == "invalid_request_error"


# -- disconnects -----------------------------------------------------------------------------


def test_disconnect_mid_stream_is_seen_quickly(arun, caplog):
    seen: dict[str, float] = {}

    async def endless(request: Request, response: Response) -> None:
        await response.start_stream()
        while not request.disconnected.is_set():
            await response.send_event("tick")
            try:
                await asyncio.wait_for(request.disconnected.wait(), 0.05)
            except TimeoutError:
                pass
        seen["at"] = time.monotonic()
        await response.send_event("after the client left")  # must not raise

    async def main():
        router = make_router()
        router.add("GET", "/endless", endless)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("GET", "/endless"))
            await client.head()
            assert await client.chunk() == b"data: tick\n\n"
            closed_at = time.monotonic()
            client.close()
            await asyncio.sleep(0.3)
            alive = await request(server, "GET", "/hello")
        return closed_at, alive

    with caplog.at_level(logging.INFO, logger="lucebox.http"):
        closed_at, alive = arun(main())
    assert "at" in seen and seen["at"] - closed_at < 0.1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # late writes are dropped quietly
    assert "disconnected=1" in caplog.text
    assert alive.status == 200


def test_disconnect_during_non_streaming_request_is_seen_quickly(arun, caplog):
    seen: dict[str, float] = {}

    async def long_generation(request: Request, response: Response) -> None:
        try:
            await asyncio.wait_for(request.disconnected.wait(), 5.0)
        except TimeoutError:
            pass
        seen["at"] = time.monotonic()
        await response.send_json(200, {"too": "late"})  # dropped, no exception

    async def main():
        router = make_router()
        router.add("POST", "/generate", long_generation)
        async with HttpServer(router, port=0) as server:
            client = await Raw.connect(server)
            await client.send(http_bytes("POST", "/generate", b'{"prompt": "x"}'))
            await asyncio.sleep(0.2)
            closed_at = time.monotonic()
            client.close()
            await asyncio.sleep(0.3)
        return closed_at

    closed_at = arun(main())
    assert "at" in seen and 0 <= seen["at"] - closed_at < 0.1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- shutdown ---------------------------------------------------------------------------------


def test_graceful_shutdown_lets_inflight_request_finish(arun):
    async def slow(request: Request, response: Response) -> None:
        await asyncio.sleep(0.4)
        await response.send_json(200, {"finished": True})

    async def main():
        router = make_router()
        router.add("GET", "/slow", slow)
        server = HttpServer(router, port=0)
        await server.start()
        serving = asyncio.ensure_future(server.serve_forever())
        idle = await Raw.connect(server)  # an idle keep-alive connection: closed at once
        busy = await Raw.connect(server)
        await busy.send(http_bytes("GET", "/slow"))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        stopping = asyncio.ensure_future(server.shutdown(grace=5.0))
        await asyncio.sleep(0.05)
        idle_closed = await idle.at_eof(timeout=1.0)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", server.port)  # no longer accepting
        reply = await busy.response()
        await stopping
        await asyncio.wait_for(serving, 1.0)
        busy.close()
        idle.close()
        return reply, idle_closed, time.monotonic() - t0

    reply, idle_closed, took = arun(main())
    assert reply.status == 200 and reply.json() == {"finished": True}
    assert reply.headers["connection"] == "close"
    assert idle_closed
    assert took < 2.0


def test_shutdown_cancels_requests_after_grace(arun):
    state = {}

    async def stuck(request: Request, response: Response) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def main():
        router = make_router()
        router.add("GET", "/stuck", stuck)
        server = HttpServer(router, port=0)
        await server.start()
        client = await Raw.connect(server)
        await client.send(http_bytes("GET", "/stuck"))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await server.shutdown(grace=0.2)
        took = time.monotonic() - t0
        closed = await client.at_eof(timeout=1.0)
        client.close()
        return took, closed

    took, closed = arun(main())
    assert state.get("cancelled") and closed
    assert 0.15 < took < 1.5


SERVE_SCRIPT = r"""
import asyncio, sys
from lucebox.http import Router, run

async def slow(request, response):
    await asyncio.sleep(float(request.query["s"]))
    await response.send_json(200, {"finished": True})

async def announce(server):
    print(server.port, flush=True)

router = Router()
router.add("GET", "/slow", slow)
sys.exit(run(router, port=0, grace=float(sys.argv[1]), startup=announce))
"""


def serve_in_subprocess(
    grace: float, request_seconds: float, signals: list[signal.Signals]
) -> tuple[int, bytes, float]:
    """Start `run()` in a child, send one request, signal the child; (exit code, response bytes, seconds to exit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with procs.spawn([sys.executable, "-c", SERVE_SCRIPT, str(grace)], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, env=env) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 20)
            assert ready, "server did not start"
            port = int(proc.stdout.readline())
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /slow?s=%f HTTP/1.1\r\nHost: localhost\r\n\r\n" % request_seconds)
                time.sleep(0.15)
                t0 = time.monotonic()
                for sig in signals:
                    proc.send_signal(sig)
                    time.sleep(0.1)
                data = b""
                try:
                    while chunk := sock.recv(65536):
                        data += chunk
                except ConnectionResetError:
                    pass
            code = proc.wait(timeout=10)
            assert code == 0, proc.stderr.read().decode()
            return code, data, time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sigterm_finishes_inflight_request_and_exits_0():
    code, data, _ = serve_in_subprocess(grace=5.0, request_seconds=0.5, signals=[signal.SIGTERM])
    head, _, body = data.partition(b"\r\n\r\n")
    assert code == 0 and head.startswith(b"HTTP/1.1 200")
    assert b"connection: close" in head.lower()
    assert orjson.loads(body) == {"finished": True}


def test_second_signal_cancels_inflight_requests():
    code, data, took = serve_in_subprocess(grace=30.0, request_seconds=30.0, signals=[signal.SIGTERM, signal.SIGINT])
    assert code == 0 and data == b"" and took < 5.0


def test_run_raises_when_startup_fails():
    async def fail(server: HttpServer) -> None:
        raise LuceboxError("model file not found")

    with pytest.raises(LuceboxError, match="model file not found"):
        run(make_router(), port=0, startup=fail)
