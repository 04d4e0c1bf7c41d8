"""Routing and the policy around every handler call: CORS preflight, API-key auth, error shapes.

Errors are rendered in the dialect of the path (spec API.md, "Errors"):
Anthropic's `{"type":"error","error":{"type","message"}}` under `/v1/messages`,
OpenAI's `{"error":{"message","type","param","code"}}` everywhere else, so each
SDK can show the message instead of a parse failure.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING

from lucebox.errors import LuceboxError

if TYPE_CHECKING:
    from lucebox.http.messages import Handler, Request, Response
    from lucebox.http.security import SecurityPolicy

log = logging.getLogger("lucebox.http")

PUBLIC_PATHS = frozenset({"/health", "/", "/status"})
"""Paths served without an API key: health probes carry none, and `/status` is a static page that asks the
browser for the key (it sends it on its `/status/json` polls)."""

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
                 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


CLIENT_CLOSED = 499
"""The status logged and counted for a request whose client left before its answer was complete (nginx's code)."""
TRACEBACK_FRAMES = 12
"""Innermost frames a logged failure shows: enough to find the bug, never the thousands of a RecursionError."""


def log_failure(logger: logging.Logger, message: str, *args: object) -> None:
    """Log the exception being handled: one line (`message: Type: text`) plus a bounded traceback.

    `logger.exception` prints every frame and the whole message; one hostile request could write
    thousands of lines. Here the text is cut to 300 characters and the traceback to TRACEBACK_FRAMES.
    """
    exc = sys.exc_info()[1]
    if exc is None:
        logger.error(message, *args)
        return
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:300] + "..."
    frames = "".join(traceback.format_tb(exc.__traceback__, limit=-TRACEBACK_FRAMES)).rstrip()
    logger.error(message + ": %s: %s\nTraceback (innermost %d frames):\n%s", *args, type(exc).__name__, text,
                 TRACEBACK_FRAMES, frames)


class HttpError(LuceboxError):
    """Raise from a handler to answer `status` with `message` in the path's error shape.

    `type` defaults from the status (see `error_type`); `param` names the
    offending field (OpenAI shape only); `headers` are added to the response
    (say `Retry-After` on 429/503).
    """

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = dict(headers or {})


def is_anthropic(path: str) -> bool:
    """Whether `path` speaks the Anthropic dialect (errors in its shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_type(path: str, status: int) -> str:
    """The default error `type` for `status` in the dialect of `path`."""
    if is_anthropic(path):
        return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(path: str, status: int, message: str, type: str | None = None, param: str | None = None) -> dict:
    """The error object for `path`'s dialect; also what the API layer sends as an error event inside a stream."""
    kind = type or error_type(path, status)
    if is_anthropic(path):
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def is_authorized(request: Request, api_key: str) -> bool:
    """True when the request carries `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`."""
    want = api_key.encode("utf-8")
    scheme, _, token = (request.headers.get("authorization") or "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), want):
        return True
    key = request.headers.get("x-api-key")
    return key is not None and hmac.compare_digest(key.strip().encode("latin-1"), want)


class Router:
    """Exact-path routing: `add("POST", "/v1/chat/completions", handler)`; itself a handler.

    The query string never takes part (`/v1/messages?beta=true` finds
    `/v1/messages`). HEAD is served by the GET handler. Unknown path -> 404; known path,
    other method -> 405 with `Allow`.
    """

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Serve `method path` with `handler`; registering the same pair twice is an error."""
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/': {path!r}")
        methods = self._routes.setdefault(path, {})
        method = method.upper()
        if method in methods:
            raise ValueError(f"route {method} {path} is already registered")
        methods[method] = handler

    @property
    def routes(self) -> list[tuple[str, str]]:
        """(method, path) of every route, in registration order (for `/props` `endpoints`)."""
        return [(method, path) for path, methods in self._routes.items() for method in methods]

    async def __call__(self, request: Request, response: Response) -> None:
        methods = self._routes.get(request.path)
        if methods is None:
            raise HttpError(404, f"Unknown endpoint: {request.method} {request.path}")
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")  # the Response leaves the body out
        if handler is None:
            allowed = ", ".join(sorted({*methods, "OPTIONS"}))
            raise HttpError(405, f"Method {request.method} is not allowed on {request.path}; allowed: {allowed}",
                            headers={"allow": allowed})
        await handler(request, response)


async def dispatch(handler: Handler, request: Request, response: Response, *, api_key: str | None,
                   policy: SecurityPolicy) -> None:
    """Run `handler` for one request with the server's policy around it.

    A foreign Host, a disallowed Origin, a cross-origin admin call -> 403, a
    body that is not JSON -> 415 (`SecurityPolicy.refusal`, before anything
    else); OPTIONS -> 204 (CORS preflight, never authenticated: browsers send no
    credentials on it); missing/wrong API key -> 401; `HttpError` or
    `LuceboxError` -> 4xx in the path's shape; any other exception -> 500 with
    a generic message and the traceback in the log only. A stream the handler
    left open is ended; a stream cut by an exception is aborted.
    """
    try:
        refused = policy.refusal(request.method, request.path, request.headers, bool(request.body))
        if refused is not None:
            raise HttpError(*refused)
        if request.method == "OPTIONS":
            await response.send(204, headers=policy.preflight_headers(request.path, request.headers))
            return
        if api_key and request.path not in PUBLIC_PATHS and not is_authorized(request, api_key):
            raise HttpError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                 "'x-api-key: <key>'.", headers={"www-authenticate": "Bearer"})
        await handler(request, response)
    except asyncio.CancelledError:
        raise
    except HttpError as e:
        await _send_error(request, response, e.status, e.message, e.type, e.param, e.headers)
        return
    except LuceboxError as e:
        await _send_error(request, response, 400, str(e))
        return
    except Exception:
        log_failure(log, "handler failed: %s %s", request.method, request.path)
        await _send_error(request, response, 500, "Internal server error; see the server log.")
        return
    if not response.started:
        log.error("handler for %s %s returned without a response", request.method, request.path)
        await response.send_json(500, error_body(request.path, 500, "Internal server error: no response."))
    elif not response.finished:
        await response.end()


async def _send_error(request: Request, response: Response, status: int, message: str, type: str | None = None,
                      param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
    request.log_fields.setdefault("error", message[:200])
    if response.started:  # the status line is gone; cutting the body short is the only signal left
        if not response.finished:
            log.warning("error after the response started (%s %s): %s", request.method, request.path, message)
            response.abort()
        return
    await response.send_json(status, error_body(request.path, status, message, type, param), headers=headers)
