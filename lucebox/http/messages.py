"""What a handler sees: the `Request` it reads and the `Response` it writes.

A handler is `async def handler(request: Request, response: Response) -> None`.
The request body is fully read before the handler runs. The response is written
either in one go (`send_json`, `send_text`, `send`) or as a stream
(`start_stream`, then `send_event` / `write`, then `end`). Every write awaits
the socket's backpressure, so a slow client pauses the handler instead of
filling memory.

When the client goes away (EOF, reset, failed write) `request.disconnected` is
set at once, whether or not the response is streaming; writes after that are
silently dropped. Generation code polls or awaits that event to stop work.
"""

from __future__ import annotations

import asyncio
import http
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import h11
import orjson

from lucebox.http.router import HttpError
from lucebox.http.sse import encode_event

Handler = Callable[["Request", "Response"], Awaitable[None]]
"""The one handler signature the server calls (a `Router` is one too)."""

HeaderArg = Mapping[str, str] | None


def reason(status: int) -> bytes:
    """The standard reason phrase for `status` (b"" when it has none); some clients print it."""
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


class Headers(Mapping[str, str]):
    """Read-only, case-insensitive request headers; a repeated header reads as its values joined by ', '."""

    __slots__ = ("_items",)

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = [(name.lower(), value) for name, value in items]

    def __getitem__(self, name: str) -> str:
        values = self.get_all(name)
        if not values:
            raise KeyError(name)
        return ", ".join(values)

    def get_all(self, name: str) -> list[str]:
        """Every value of `name`, in the order received."""
        key = name.lower()
        return [value for item, value in self._items if item == key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(item == name.lower() for item, _ in self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(item for item, _ in self._items))

    def __len__(self) -> int:
        return len(dict.fromkeys(item for item, _ in self._items))

    def raw(self) -> list[tuple[str, str]]:
        """(lower-case name, value) pairs exactly as received, repeats kept."""
        return list(self._items)

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


MAX_JSON_DEPTH = 64
"""Deepest nesting a request body may have: the code that walks request JSON (schemas, templates) recurses."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper_than(text: bytes, limit: int) -> bool:
    """Whether valid JSON `text` nests arrays/objects more than `limit` deep.

    Works on the bytes in C-speed passes (strings removed, then one level of empty pairs per pass), so any
    depth is safe to ask about and a 16 MB body takes a fraction of a second, never a recursion.
    """
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = _EMPTY_PAIR.sub(b"", brackets)
    return bool(brackets)


class Request:
    """One HTTP request with its whole body.

    `path` is the target without its query string (what routing matches);
    `query` maps each query parameter to its last value. `log_fields` is added
    to the request's log line as `key=value` (the engine puts token counts there).
    """

    __slots__ = ("body", "client", "disconnected", "headers", "http_version", "log_fields", "method", "path",
                 "query", "received_at", "target")

    def __init__(self, method: str, target: str, path: str, query: dict[str, str], headers: Headers,
                 body: bytes = b"", client: tuple[str, int] | None = None, http_version: str = "1.1") -> None:
        self.method = method
        self.target = target
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.client = client
        self.http_version = http_version
        self.disconnected = asyncio.Event()
        self.log_fields: dict[str, Any] = {}
        self.received_at = time.monotonic()

    def json(self) -> Any:
        """The body parsed as JSON; an `HttpError` 400 naming the problem when it is not JSON."""
        if not self.body.strip():
            raise HttpError(400, "Request body is empty; expected a JSON object.")
        try:
            value = orjson.loads(self.body)
        except orjson.JSONDecodeError as e:
            raise HttpError(400, f"Request body is not valid JSON: {e}") from None
        if nests_deeper_than(self.body, MAX_JSON_DEPTH):
            raise HttpError(400, f"Request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep.")
        return value

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.target} {len(self.body)}B>"


class Wire(Protocol):
    """What a `Response` needs from the connection under it (implemented in server.py)."""

    def send(self, event: h11.Event) -> bool:
        """Hand one h11 event to the socket; False when the peer is gone."""
        ...

    async def drain(self) -> None:
        """Wait while the socket's write buffer is above its high-water mark."""
        ...

    def default_headers(self) -> list[tuple[str, str]]:
        """Headers every response carries (Date, Server, CORS, Connection: close while shutting down)."""
        ...

    def abort(self) -> None:
        """Close the connection now, leaving the response unfinished."""
        ...


class Response:
    """Writes one response to the client.

    Each method may be called once in this order: one of the `send*` methods,
    or `start_stream` + any number of `send_event`/`write` + `end`. Calling them
    out of order raises RuntimeError (a handler bug, turned into a 500).
    """

    def __init__(self, wire: Wire, request: Request | None = None) -> None:
        self._wire = wire
        self._request = request
        self._state = "new"  # new -> streaming -> done; or aborted
        self.status = 0
        self.bytes_sent = 0
        self._head_only = request is not None and request.method == "HEAD"  # headers as for GET, no body

    @property
    def started(self) -> bool:
        """True once the status line has been handed to the socket."""
        return self._state != "new"

    @property
    def finished(self) -> bool:
        """True once the whole response is written (or dropped because the client left)."""
        return self._state == "done"

    # -- one-shot responses ---------------------------------------------------------------

    async def send(self, status: int, body: bytes = b"", headers: HeaderArg = None,
                   content_type: str | None = None) -> None:
        """Send a complete response with a Content-Length (204/304 carry neither body nor length)."""
        self._begin(status)
        extra: list[tuple[str, str]] = []
        if content_type is not None:
            extra.append(("content-type", content_type))
        if status not in (204, 304) and not 100 <= status < 200:
            extra.append(("content-length", str(len(body))))
        elif body:
            raise RuntimeError(f"a {status} response cannot have a body")
        if self._emit(h11.Response(status_code=status, headers=self._headers(extra, headers), reason=reason(status))):
            if body and not self._head_only and self._emit(h11.Data(data=body)):
                self.bytes_sent += len(body)
            self._emit(h11.EndOfMessage())
        self._state = "done"
        await self._wire.drain()

    async def send_json(self, status: int, obj: Any, headers: HeaderArg = None) -> None:
        """Send `obj` serialised by orjson as `application/json`."""
        body = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
        await self.send(status, body, headers, "application/json")

    async def send_text(self, status: int, text: str | bytes, content_type: str = "text/plain; charset=utf-8",
                        headers: HeaderArg = None) -> None:
        """Send text (UTF-8 encoded when a str) with the given content type."""
        body = text.encode("utf-8") if isinstance(text, str) else text
        await self.send(status, body, headers, content_type)

    # -- streaming ------------------------------------------------------------------------

    async def start_stream(self, status: int = 200, headers: HeaderArg = None,
                           content_type: str = "text/event-stream") -> None:
        """Send the head of a streamed response (chunked on HTTP/1.1); `Cache-Control: no-cache`."""
        self._begin(status)
        extra = [("content-type", content_type), ("cache-control", "no-cache"), ("x-accel-buffering", "no")]
        if self._emit(h11.Response(status_code=status, headers=self._headers(extra, headers), reason=reason(status))):
            self._state = "streaming"
        await self._wire.drain()

    async def send_event(self, data: str | bytes, event: str | None = None) -> None:
        """Send one SSE frame (`event: X` line, one `data:` line per line of `data`) and flush it."""
        await self.write(encode_event(data, event))

    async def write(self, data: bytes) -> None:
        """Send raw bytes of the streamed body; waits while the client is not reading."""
        if self._state == "new":
            raise RuntimeError("call start_stream() before write() or send_event()")
        if self._state != "streaming":
            if self._state == "done" and self._gone():
                return  # the client left; the handler learns it from request.disconnected
            raise RuntimeError(f"response already {self._state}; nothing more can be written")
        if data and not self._head_only and self._emit(h11.Data(data=data)):
            self.bytes_sent += len(data)
        await self._wire.drain()

    async def end(self) -> None:
        """Finish a streamed response (the terminating zero-length chunk)."""
        if self._state == "done":
            return
        if self._state != "streaming":
            raise RuntimeError(f"end() on a response that is {self._state}; use start_stream() first")
        self._emit(h11.EndOfMessage())
        self._state = "done"
        await self._wire.drain()

    def abort(self) -> None:
        """Close the connection without finishing the response, so the client sees it cut short.

        Used after an error in the middle of a stream: a truncated chunked body is
        the one signal every HTTP client reports as a failure.
        """
        if self._state != "done":
            self._state = "aborted"
        self._wire.abort()

    # -- internals ------------------------------------------------------------------------

    def _begin(self, status: int) -> None:
        if self._state != "new":
            raise RuntimeError(f"response already started (status {self.status}); send one response per request")
        self.status = status

    def _headers(self, extra: list[tuple[str, str]], user: HeaderArg) -> list[tuple[str, str]]:
        """Defaults, then ours, then the handler's; a later header replaces an earlier one of the same name."""
        merged: dict[str, tuple[str, str]] = {}
        for name, value in [*self._wire.default_headers(), *extra, *(user or {}).items()]:
            merged[name.lower()] = (name, value)
        return list(merged.values())

    def _emit(self, event: h11.Event) -> bool:
        """Send one event; on a lost peer mark the request disconnected and report False."""
        try:
            ok = self._wire.send(event)
        except h11.LocalProtocolError as e:
            self._state = "aborted"
            self._wire.abort()
            raise RuntimeError(f"invalid response: {e}") from None
        if not ok:
            self._state = "done"  # nothing more can reach the client; further writes are dropped
            if self._request is not None:
                self._request.disconnected.set()
        return ok

    def _gone(self) -> bool:
        return self._request is not None and self._request.disconnected.is_set()
