"""The HTTP/1.1 server: one asyncio Protocol and one `h11.Connection` per socket.

h11 does no I/O: `_Connection` feeds it the bytes the socket delivers and
writes the bytes it returns. A connection serves its requests one after the
other (keep-alive, pipelining by h11's rules). The body is read whole, then the
handler runs as a task while the protocol keeps reading the socket, so a client
that closes it sets `request.disconnected` at once, streaming or not.

Limits: body over `max_body` -> 413 (from Content-Length before any body is
read; chunked bodies as they grow); head over `max_header` -> 431; a head not
complete within `header_timeout`, or a whole request (head and body) not
within `request_timeout` of its first byte -> 408 (one deadline per request,
not per byte, so a trickling client cannot hold a connection open); malformed
HTTP -> 400. Each of these answers in the OpenAI/Anthropic error shape and
closes the connection (after draining what the client still sends, so the
answer is not lost to a TCP reset). At most `max_connections` sockets are
open: a new one pushes out a connection lingering after an error answer, else
the one that has held its slot longest without sending a whole request (an
idle keep-alive, a trickler); when every connection runs a handler, the new
one gets a quick 503. Either way one (rate-limited) line is logged.

The body limit (16 MiB) is also what bounds JSON parsing on the loop: orjson
holds the GIL, so a worker thread would not free the loop (measured: a 30 MB
body stalls it ~0.3 s in a thread or not). After a large body the heap is
trimmed, so its memory goes back to the OS.

Browser rules (Origin, Host, Content-Type, admin paths) live in `security.py`.

`HttpServer.shutdown(grace)` stops accepting, closes idle connections, lets
in-flight requests finish for `grace` seconds, then has the app end them
(`before_cancel`: open streams close with their dialect's error event) and
cancels what still runs. `run()` is the blocking entry point with SIGINT/SIGTERM
handling.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import h11
import orjson

from lucebox import heap
from lucebox.http.messages import Handler, Headers, Request, Response, reason
from lucebox.http.router import CLIENT_CLOSED, dispatch, error_body, log_failure
from lucebox.http.security import SecurityPolicy

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("lucebox.http")

KiB = 1024
MiB = 1024 * KiB
WRITE_HIGH_WATER = 64 * KiB
"""A handler's write waits while more than this is queued for the socket."""
PIPELINE_BUFFER = 1 * MiB
"""Pipelined bytes kept while a handler runs; beyond it reading pauses (and EOF goes unseen until it resumes)."""
LINGER = 2.0
"""Seconds to keep discarding input after an error answer, so the client's unread upload can't reset it away."""
TRIM_AFTER = 1 * MiB
"""After a request with a body at least this large, give freed heap memory back to the OS (see `_trim_heap`)."""
END_WAIT = 2.0
"""Seconds handlers get after `before_cancel()` at the end of the shutdown grace to finish their answers."""
CAP_LOG_EVERY = 10.0
"""Seconds between two log lines about the connection limit."""


def _trim_heap() -> None:
    """glibc keeps freed large blocks in its heap: six rejected 16 MB bodies left ~300 MB resident for good.

    `heap.trim` hands them back (measured: 1.93 -> 1.39 GiB in 0.12 s, off the loop).
    """
    heap.trim()


def default_max_connections() -> int:
    """Three quarters of the open-file limit (the rest is for model files, threads, the disk tier), at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft * 3 // 4))


class _Connection(asyncio.Protocol):
    """One client socket: bytes in -> h11 events -> handler task; handler writes -> h11 -> bytes out."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=server.max_header)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.task: asyncio.Task | None = None  # the running handler
        self.request: Request | None = None  # its request
        self.response: Response | None = None  # and its response
        self._left_early = False  # the client went away before that response was complete
        self._head: h11.Request | None = None  # head of the request being received
        self._headers: Headers | None = None  # its headers
        self._head_time = 0.0
        self._started = time.monotonic()  # first byte of the request being received (or the connection's start)
        self._cors: list[tuple[str, str]] = []  # CORS headers for the answer to the current request
        self._body: list[bytes] = []
        self._body_size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_mode = ""  # idle | head | body
        self._buffered = 0  # bytes received while the handler ran
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._read_paused = False
        self._lingering = False
        self._lost = False

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a uvloop TCPTransport is no asyncio.Transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = (str(peer[0]), int(peer[1]))
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        if not self.server._admit(self):
            return
        self.server._connections.add(self)
        self._arm("idle", self.server.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        self.conn.receive_data(data)
        if self.task is not None:  # a handler runs: keep the bytes for later (h11 says PAUSED until then)
            self._buffered += len(data)
            if self._buffered > PIPELINE_BUFFER and not self._read_paused:
                self.transport.pause_reading()
                self._read_paused = True
            return
        if self._timer_mode == "idle":
            self._begin_request()
        self._process()

    def eof_received(self) -> bool:
        # A client that half-closes is treated as gone: that is how aborted requests look on the wire.
        self._client_left()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        self._client_left()
        self._wake_writers()
        self.server._connections.discard(self)

    def _client_left(self) -> None:
        if self.request is not None:
            self.request.disconnected.set()
            if self.response is not None and not self.response.finished:
                self._left_early = True

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writers()

    # -- the Wire interface used by messages.Response ----------------------------------

    def send(self, event: h11.Event) -> bool:
        """Hand one h11 event to the socket; False when the peer is gone."""
        if self._lost or self.transport is None or self.transport.is_closing():
            return False
        data = self.conn.send(event)
        if data:
            self.transport.write(data)
        return True

    async def drain(self) -> None:
        """Wait while the transport's buffer is above the high-water mark (returns at once if the peer left)."""
        if self._write_paused and not self._lost:
            waiter = self.loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def default_headers(self) -> list[tuple[str, str]]:
        headers = [("date", _http_date()), ("server", "lucebox"), *self._cors]
        if self.server._closing:
            headers.append(("connection", "close"))
        return headers

    def abort(self) -> None:
        self._close()

    # -- reading requests -----------------------------------------------------------------

    def _process(self) -> None:
        """Pull events out of h11 until it needs more bytes or a handler starts."""
        while self.task is None and not self._lost and not self._lingering:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                if e.error_status_hint == 431:
                    self._reject(431, f"Request header fields too large (limit {self.server.max_header} bytes).")
                else:
                    self._reject(e.error_status_hint, f"Malformed HTTP request: {protocol_problem(e)}")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                if not self._on_head(event):
                    return
            elif isinstance(event, h11.Data):
                self._body.append(event.data)
                self._body_size += len(event.data)
                if self._body_size > self.server.max_body:
                    self._reject(413, self._too_large(), self._head)
                    return
            elif isinstance(event, h11.EndOfMessage):
                self._start_handler()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return

    def _on_head(self, head: h11.Request) -> bool:
        """Check a request head against the limits; False when it was rejected."""
        self._head_time = time.monotonic()
        size = len(head.method) + len(head.target) + sum(len(n) + len(v) + 4 for n, v in head.headers)
        if size > self.server.max_header:
            self._reject(431, f"Request header fields too large (limit {self.server.max_header} bytes).", head)
            return False
        self._head = head
        self._body, self._body_size = [], 0
        self._headers = Headers([(n.decode("latin-1"), v.decode("latin-1")) for n, v in head.headers])
        path = _split_target(head.target.decode("ascii", "replace"))[0]
        self._cors = self.server.policy.cors_headers(path, self._headers)
        length = next((v for n, v in head.headers if n == b"content-length"), None)
        if length is not None and int(length) > self.server.max_body:
            self._reject(413, self._too_large(), head)
            return False
        if self.conn.they_are_waiting_for_100_continue:
            self.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
        # One deadline for the whole request from its first byte: body bytes do not push it back.
        self._arm("body", max(0.0, self._started + self.server.request_timeout - time.monotonic()))
        return True

    def _too_large(self) -> str:
        return f"Request body too large (limit {self.server.max_body} bytes)."

    def _start_handler(self) -> None:
        head, self._head = self._head, None
        headers, self._headers = self._headers, None
        assert head is not None and headers is not None
        self._disarm()
        target = head.target.decode("ascii", "replace")
        path, query = _split_target(target)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body, self._body_size = [], 0
        request = Request(head.method.decode("ascii", "replace"), target, path, query, headers, body,
                          self.client, head.http_version.decode("ascii", "replace"))
        request.received_at = self._head_time
        self._buffered = 0
        self.request = request
        self.response = Response(self, request)
        self._left_early = False
        self.task = self.loop.create_task(self._run(request, self.response))

    # -- running a handler ----------------------------------------------------------------

    async def _run(self, request: Request, response: Response) -> None:
        server = self.server
        try:
            await dispatch(server.handler, request, response, api_key=server.api_key, policy=server.policy)
        except asyncio.CancelledError:
            request.log_fields["cancelled"] = 1
            raise
        except Exception:  # a bug in the policy code itself, not in the handler
            log_failure(log, "internal error serving %s %s", request.method, request.path)
        finally:
            if request.disconnected.is_set():
                request.log_fields.setdefault("disconnected", 1)
            status = CLIENT_CLOSED if self._left_early else response.status  # one outcome, streamed or not
            server._log_request(self.client, request.method, request.path, status,
                                time.monotonic() - request.received_at, response.bytes_sent, request.log_fields)
            self.task = None
            self.request = None
            self.response = None
            if len(request.body) >= TRIM_AFTER:
                server._schedule_trim()
            self._after_response(response)

    def _after_response(self, response: Response) -> None:
        """Keep the connection for the next request when both sides finished cleanly; else close it."""
        if self._lost or self._lingering or self.transport.is_closing():
            return
        done = response.finished and self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE
        if not done or self.server._closing:
            self._close()
            return
        self.conn.start_next_cycle()
        self._cors = []
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        if self.conn.trailing_data[0]:
            self._begin_request()
        else:
            self._started = time.monotonic()
            self._arm("idle", self.server.keepalive_timeout)
        self._process()

    # -- errors, timers, closing ----------------------------------------------------------

    def _begin_request(self) -> None:
        """The first byte of a request arrived: start its head deadline (the total one is measured from here)."""
        self._started = time.monotonic()
        self._arm("head", min(self.server.header_timeout, self.server.request_timeout))

    def _reject(self, status: int, message: str, head: h11.Request | None = None) -> None:
        """Answer a protocol-level error in the error shape, then close the connection."""
        self._disarm()
        method = head.method.decode("ascii", "replace") if head is not None else "-"
        path = _split_target(head.target.decode("ascii", "replace"))[0] if head is not None else "-"
        body = orjson.dumps(error_body(path, status, message))
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            headers = [h for h in self.default_headers() if h[0] != "connection"]
            headers += [("content-type", "application/json"), ("content-length", str(len(body))),
                        ("connection", "close")]
            try:
                if self.send(h11.Response(status_code=status, headers=headers, reason=reason(status))):
                    self.send(h11.Data(data=body))
                    self.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                pass
        self.server._log_request(self.client, method, path, status, time.monotonic() - self._head_time
                                 if head is not None else 0.0, len(body), {"error": message[:200]})
        self._linger()

    def _linger(self) -> None:
        """Send EOF, then discard input until the client closes (or LINGER passes)."""
        self._lingering = True
        self._disarm()
        t = self.transport
        if t is None or t.is_closing():
            return
        if self._read_paused:
            self._read_paused = False
            t.resume_reading()
        if t.can_write_eof():
            t.write_eof()
            self._timer = self.loop.call_later(LINGER, self._close)
        else:
            t.close()

    def _arm(self, mode: str, seconds: float) -> None:
        self._disarm()
        self._timer_mode = mode
        self._timer = self.loop.call_later(seconds, self._on_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_mode = ""

    def _on_timeout(self) -> None:
        mode, self._timer, self._timer_mode = self._timer_mode, None, ""
        if mode == "idle":  # nothing of a request yet: just hang up
            self._close()
        else:
            self._reject(408, "Timed out waiting for the request.", self._head)

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _wake_writers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- shutdown -------------------------------------------------------------------------

    @property
    def evictable(self) -> int:
        """0 when this connection must not be pushed out (a handler runs); 1 lingering after an answer; else 2."""
        if self.task is not None or self._lost:
            return 0
        return 1 if self._lingering else 2

    def evict(self) -> None:
        """Close at once to make room for a new connection (no answer: its request was not read whole)."""
        self._disarm()
        self._lingering = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        """True while a request is being received or handled (shutdown waits for these)."""
        if self._lost or self._lingering:
            return False
        return self.task is not None or self.conn.their_state is not h11.IDLE or bool(self.conn.trailing_data[0])

    def cancel(self) -> None:
        """Cancel the running handler (if any) and close the socket; drop unsent bytes of a cut response."""
        if self.task is not None:
            self.task.cancel()
            if self.transport is not None:
                self.transport.abort()  # close() would wait for a client that may never read
        self._close()


class HttpServer:
    """An HTTP/1.1 server calling one `handler(request, response)` per request.

    `await start()` binds (port 0 picks a free port; `port` holds the bound one),
    `await serve_forever()` returns once `shutdown()` has finished. Also an async
    context manager: start on enter, graceful shutdown on exit.
    """

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 8080, max_body: int = 16 * MiB,
                 max_header: int = 64 * KiB, header_timeout: float = 30.0, request_timeout: float = 60.0,
                 keepalive_timeout: float = 75.0, max_connections: int | None = None, cors: bool = True,
                 cors_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = (), api_key: str | None = None,
                 on_request: Callable[[str, str, int, dict[str, Any]], None] | None = None,
                 before_cancel: Callable[[], None] | None = None) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key is empty: pass None for no key (an empty key must not mean 'no auth')")
        self.handler = handler
        self.on_request = on_request  # (method, path, status, log fields) after every request, for metrics
        self.before_cancel = before_cancel  # called once the shutdown grace is over, before handlers are cancelled
        self.host = host
        self.port = port
        self.max_body = max_body
        self.max_header = max_header
        self.header_timeout = header_timeout
        self.request_timeout = request_timeout
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections or default_max_connections()
        self.policy = SecurityPolicy(bound_host=host, cors=cors, cors_origins=cors_origins,
                                     allowed_hosts=allowed_hosts)
        self.api_key = api_key
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._cap_logged = 0.0
        self._cap_hits = 0
        self._trim: asyncio.TimerHandle | None = None
        self._closing = False
        self._cut = asyncio.Event()
        self._stopped = asyncio.Event()

    @property
    def url(self) -> str:
        """Base URL of the bound socket, e.g. `http://127.0.0.1:8080`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self._server is not None:
            raise RuntimeError("server already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("listening on %s", self.url)

    async def serve_forever(self) -> None:
        """Serve until `shutdown()` completes (starts the server first if needed)."""
        if self._server is None:
            await self.start()
        await self._stopped.wait()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop accepting, close idle connections, give in-flight requests `grace` seconds, then end them.

        Ending: `before_cancel()` (the app cancels its generations there, so every open stream closes with
        its dialect's error ending), up to END_WAIT seconds for the handlers to write it, then the handlers
        still running are cancelled and their sockets closed.

        Calling it again while a shutdown runs waits for that one; with `grace <= 0` it cuts the wait short.
        """
        if self._server is None:
            self._stopped.set()
            return
        if self._closing:
            if grace <= 0:
                self._cut.set()
            await self._stopped.wait()
            return
        self._closing = True
        self._server.close()
        for conn in list(self._connections):
            if not conn.busy:
                conn.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace, 0.0)
        while any(c.busy for c in self._connections) and not self._cut.is_set() and loop.time() < deadline:
            await asyncio.sleep(min(0.02, max(deadline - loop.time(), 0.0)))
        tasks = [c.task for c in self._connections if c.task is not None]
        if tasks and self.before_cancel is not None and not self._cut.is_set():
            # Let each handler end its answer in its own dialect (an error event, response.failed, ...)
            # rather than cut the socket mid-stream; whatever is still running after END_WAIT is cancelled.
            log.info("ending %d request(s) still running after the %.1f s grace period", len(tasks), grace)
            try:
                self.before_cancel()
            except Exception:
                log_failure(log, "before_cancel hook failed")
            await asyncio.wait(tasks, timeout=END_WAIT)
            tasks = [c.task for c in self._connections if c.task is not None]
        if tasks:
            log.info("cancelling %d request(s) still running after the %.1f s grace period", len(tasks), grace)
        for conn in list(self._connections):
            conn.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        closed = asyncio.ensure_future(self._server.wait_closed())
        await asyncio.wait([closed], timeout=1.0)  # on 3.12+ this waits for connections too
        closed.cancel()
        self._stopped.set()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _schedule_trim(self) -> None:
        """Trim the heap a second after a large request (once for a burst of them), in a worker thread."""
        if self._trim is not None:
            return
        loop = asyncio.get_running_loop()

        def trim() -> None:
            self._trim = None
            loop.run_in_executor(None, _trim_heap)

        self._trim = loop.call_later(1.0, trim)

    def _admit(self, conn: _Connection) -> bool:
        """Make room for `conn` under `max_connections`; False (after a quick 503) when every slot runs a handler."""
        if len(self._connections) < self.max_connections:
            return True
        # Lingering ones first (already answered), then whichever has held its slot longest without a whole
        # request: an old idle keep-alive, a trickler; never one that has just connected, never a running handler.
        victims = [c for c in self._connections if c.evictable]
        victim = min(victims, key=lambda c: (c.evictable != 1, c._started), default=None)
        self._cap_hits += 1
        now = time.monotonic()
        if now - self._cap_logged >= CAP_LOG_EVERY:
            self._cap_logged = now
            log.warning("connection limit %d reached (%d time(s) since the last such line): %s; --max-connections "
                        "raises it", self.max_connections, self._cap_hits,
                        "closing idle or slowest-sending connections" if victim else "new connections get 503")
            self._cap_hits = 0
        if victim is not None:
            self._connections.discard(victim)
            victim.evict()
            return True
        body = orjson.dumps(error_body("/", 503, f"Too many connections (limit {self.max_connections}); retry."))
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                "\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode("ascii")
        conn._lost = conn._lingering = True
        if conn.transport is not None:
            conn.transport.write(head + body)
            conn.transport.close()
        return False

    def _log_request(self, client: tuple[str, int] | None, method: str, path: str, status: int, seconds: float,
                     nbytes: int, fields: dict[str, Any]) -> None:
        """The one INFO line per request: client, method, path, status, duration, body bytes, then key=value."""
        if self.on_request is not None:
            try:
                self.on_request(method, path, status, fields)
            except Exception:  # metrics must never break serving
                log.exception("on_request hook failed")
        if not log.isEnabledFor(logging.INFO):
            return
        peer = f"{client[0]}:{client[1]}" if client else "-"
        extra = "".join(f" {k}={_log_value(v)}" for k, v in fields.items() if v is not None)
        log.info("%s %s %s %d %.1fms %dB%s", peer, method, path, status, seconds * 1000, nbytes, extra)


def run(handler: Handler, *, grace: float = 10.0, startup: Callable[[HttpServer], Awaitable[None]] | None = None,
        cleanup: Callable[[], Awaitable[None]] | None = None, **options: Any) -> int:
    """Serve `handler` until SIGINT/SIGTERM, shut down gracefully, return 0 (the process exit code).

    `options` go to `HttpServer`. `startup(server)` runs as a task once the
    socket is bound (load the model there: requests are served meanwhile);
    if it raises, the server stops and the error propagates. `cleanup()` runs
    after shutdown. A second signal cancels in-flight requests at once.
    Uses uvloop when it is installed.
    """
    return _loop_runner()(_serve(handler, grace, startup, cleanup, options))


async def _serve(handler: Handler, grace: float, startup: Callable[[HttpServer], Awaitable[None]] | None,
                 cleanup: Callable[[], Awaitable[None]] | None, options: dict[str, Any]) -> int:
    server = HttpServer(handler, **options)
    await server.start()
    loop = asyncio.get_running_loop()
    background: set[asyncio.Task] = set()
    failures: list[BaseException] = []
    signals = 0

    def stop(seconds: float) -> None:
        task = loop.create_task(server.shutdown(seconds))
        background.add(task)
        task.add_done_callback(background.discard)

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("%s: shutting down; in-flight requests get %.1f s", sig.name, grace)
            stop(grace)
        else:
            log.info("%s again: cancelling in-flight requests", sig.name)
            stop(0.0)

    def on_startup_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())
            stop(0.0)

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            pass
    startup_task = loop.create_task(startup(server)) if startup is not None else None
    if startup_task is not None:
        startup_task.add_done_callback(on_startup_done)
    try:
        await server.serve_forever()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if startup_task is not None and not startup_task.done():
            startup_task.cancel()
            await asyncio.wait([startup_task])
        if cleanup is not None:
            await cleanup()
    if failures:
        raise failures[0]
    return 0


def _loop_runner() -> Callable[[Awaitable[int]], int]:
    """`uvloop.run` when uvloop is importable, else `asyncio.run`."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return getattr(uvloop, "run", asyncio.run)


_H11_LINE = re.compile(r"illegal (request|header) line: (?:bytearray\()?b(['\"])(.*)\2\)?", re.DOTALL)
_BYTES_REPR = re.compile(r"(?:bytearray\()?b'((?:[^'\\]|\\.)*)'\)?")


def protocol_problem(error: h11.RemoteProtocolError) -> str:
    """What h11 rejected, in words: its messages quote the bytes as Python reprs (`bytearray(b'GARBAGE')`)."""
    text = str(error)
    m = _H11_LINE.fullmatch(text)
    if m is not None:
        line = m.group(3) if len(m.group(3)) <= 80 else m.group(3)[:80] + "..."
        if m.group(1) == "request":
            return f'the request line "{line}" is not of the form "METHOD /path HTTP/1.1".'
        return f'the header line "{line}" is not of the form "Name: value".'
    return _BYTES_REPR.sub(lambda b: f'"{b.group(1)[:80]}"', text).rstrip(".") + "."


def _split_target(target: str) -> tuple[str, dict[str, str]]:
    """Request target -> (path without query, query parameters; the last of a repeated name wins)."""
    if not target.startswith("/") and "://" in target:  # absolute-form, as sent to a proxy
        rest = target.split("://", 1)[1]
        slash = rest.find("/")
        target = rest[slash:] if slash >= 0 else "/"
    path, _, query = target.partition("?")
    return path, dict(parse_qsl(query, keep_blank_values=True))


_date_cache: tuple[int, str] = (0, "")


def _http_date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


def _log_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return repr(text) if (" " in text or not text) else text
