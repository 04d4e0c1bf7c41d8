"""A small asyncio HTTP/1.1 client for the benchmarks: JSON requests and SSE streams over raw sockets.

The serving benchmark measures when each token reaches the client, so the
client must hand over every SSE frame the moment its bytes arrive, stamped with
that moment. h11 does the HTTP framing (no I/O of its own); this module does
the socket reads and the SSE parsing (WHATWG "Server-sent events": `event:` and
`data:` lines, a blank line ends a frame, `:` starts a comment).

    async for frame in stream_sse("http://127.0.0.1:8080/v1/chat/completions", body):
        frame.time, frame.event, frame.data   # perf_counter() at arrival, event name or None, payload text

One connection per request (`Connection: close`), plain http only. A status
other than 200 raises `HttpStatusError` carrying the status and the body; a
refused connection, a timeout or malformed HTTP raises `HttpClientError`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import h11

from lucebox.errors import LuceboxError

READ_SIZE = 64 * 1024
_LINE_END = re.compile(rb"\r\n|\r|\n")


class HttpClientError(LuceboxError):
    """The request did not get an HTTP answer: refused, timed out, or not HTTP."""


class HttpStatusError(HttpClientError):
    """The server answered with a status other than 200."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        self.status, self.body = status, body
        super().__init__(f"{method} {url} -> {status}: {body[:500]}")


class SSEFrame(NamedTuple):
    time: float
    """time.perf_counter() when the bytes that completed this frame were read from the socket."""
    event: str | None
    data: str


class SSEParser:
    """Incremental SSE parser: feed bytes as they come, get back the (event, data) frames they complete.

    Lines may break anywhere between two feeds, including between the \\r and \\n of a CRLF.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        self._buf += chunk
        frames: list[tuple[str | None, str]] = []
        while True:
            m = _LINE_END.search(self._buf)
            if m is None or (m.group() == b"\r" and m.end() == len(self._buf)):
                break  # no complete line yet (a lone trailing \r may be the first half of \r\n)
            line, self._buf = self._buf[: m.start()].decode("utf-8", "replace"), self._buf[m.end():]
            frame = self._line(line)
            if frame is not None:
                frames.append(frame)
        return frames

    def _line(self, line: str) -> tuple[str | None, str] | None:
        if not line:  # a blank line dispatches the frame (none without data, per the spec)
            event, data = self._event, self._data
            self._event, self._data = None, []
            return (event, "\n".join(data)) if data else None
        if line.startswith(":"):
            return None  # comment (keep-alive)
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # id / retry / unknown fields: not needed here


class _Exchange:
    """One request/response on its own connection."""

    def __init__(self, method: str, url: str, body: Any, headers: dict[str, str] | None, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise HttpClientError(f"{url}: only http://host[:port]/path URLs are supported")
        self.method, self.url, self.timeout = method, url, timeout
        self.host, self.port = parts.hostname, parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.payload = b"" if body is None else json.dumps(body).encode("utf-8")
        hdrs = {"Host": parts.netloc, "User-Agent": "lucebox-bench", "Accept": "*/*", "Connection": "close"}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        hdrs["Content-Length"] = str(len(self.payload))
        hdrs.update(headers or {})
        self.request = h11.Request(method=method, target=target, headers=list(hdrs.items()))
        self.conn = h11.Connection(h11.CLIENT)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._stamp = 0.0  # perf_counter() of the last read

    async def open(self) -> None:
        try:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.timeout)
        except asyncio.TimeoutError:
            raise HttpClientError(f"{self.method} {self.url}: connect timed out after {self.timeout:g} s") from None
        except OSError as exc:
            raise HttpClientError(f"{self.method} {self.url}: cannot connect: {exc.strerror or exc}") from None
        out = self.conn.send(self.request)
        if self.payload:
            out += self.conn.send(h11.Data(data=self.payload))
        out += self.conn.send(h11.EndOfMessage())
        self.writer.write(out)
        try:
            await self.writer.drain()
        except OSError as exc:
            raise HttpClientError(f"{self.method} {self.url}: send failed: {exc.strerror or exc}") from None

    async def next_event(self) -> tuple[float, Any]:
        """The next h11 event, and perf_counter() when the bytes holding it were read."""
        assert self.reader is not None
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise HttpClientError(f"{self.method} {self.url}: bad HTTP from the server: {exc}") from None
            if event is not h11.NEED_DATA:
                return self._stamp, event
            try:
                data = await asyncio.wait_for(self.reader.read(READ_SIZE), self.timeout)
            except asyncio.TimeoutError:
                raise HttpClientError(f"{self.method} {self.url}: no data for {self.timeout:g} s") from None
            except OSError as exc:
                raise HttpClientError(f"{self.method} {self.url}: read failed: {exc.strerror or exc}") from None
            self._stamp = time.perf_counter()
            self.conn.receive_data(data)  # b"" = EOF: h11 ends a close-delimited body or reports truncation

    async def response(self) -> h11.Response:
        while True:
            _, event = await self.next_event()
            if isinstance(event, h11.Response):
                return event
            # h11.InformationalResponse (1xx): skip

    async def read_body(self) -> bytes:
        body = bytearray()
        while True:
            _, event = await self.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)

    async def fail(self, status: int) -> HttpStatusError:
        try:
            text = (await self.read_body()).decode("utf-8", "replace")
        except HttpClientError as exc:
            text = f"<body unreadable: {exc}>"
        return HttpStatusError(self.method, self.url, status, text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def request_json(method: str, url: str, body: Any = None, *, headers: dict[str, str] | None = None,
                       timeout: float = 60.0) -> tuple[int, Any]:
    """Send a request (JSON body if given); returns (status, the body parsed as JSON, or as text if it isn't)."""
    ex = _Exchange(method, url, body, headers, timeout)
    try:
        await ex.open()
        status = (await ex.response()).status_code
        raw = await ex.read_body()
    finally:
        ex.close()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


async def get_json(url: str, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> Any:
    """GET a JSON document; HttpStatusError unless the status is 200."""
    status, obj = await request_json("GET", url, headers=headers, timeout=timeout)
    if status != 200:
        raise HttpStatusError("GET", url, status, obj if isinstance(obj, str) else json.dumps(obj))
    return obj


async def post_json(url: str, body: Any, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> Any:
    """POST JSON, return the JSON answer; HttpStatusError unless the status is 200."""
    status, obj = await request_json("POST", url, body, headers=headers, timeout=timeout)
    if status != 200:
        raise HttpStatusError("POST", url, status, obj if isinstance(obj, str) else json.dumps(obj))
    return obj


async def stream_sse(url: str, body: Any, *, headers: dict[str, str] | None = None,
                     timeout: float = 300.0) -> AsyncIterator[SSEFrame]:
    """POST JSON and yield the SSE frames of the answer as they arrive.

    `timeout` bounds the connect and each wait for more bytes, not the whole
    stream. Leaving the loop early (break, exception) closes the socket, which
    the server takes as a disconnect.
    """
    ex = _Exchange("POST", url, body, {"Accept": "text/event-stream", **(headers or {})}, timeout)
    try:
        await ex.open()
        response = await ex.response()
        if response.status_code != 200:
            raise await ex.fail(response.status_code)
        parser = SSEParser()
        while True:
            stamp, event = await ex.next_event()
            if isinstance(event, h11.Data):
                for name, data in parser.feed(event.data):
                    yield SSEFrame(stamp, name, data)
            elif isinstance(event, h11.EndOfMessage):
                return
    finally:
        ex.close()
