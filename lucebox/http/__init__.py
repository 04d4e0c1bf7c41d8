"""HTTP transport: asyncio (uvloop when installed) + h11, no web framework.

The API layer writes handlers `async def h(request: Request, response: Response) -> None`,
registers them on a `Router`, and serves it with `HttpServer` (or `run` from `python -m lucebox`).
Errors raised as `HttpError` (or any `LuceboxError`) reach the client in the path's dialect
(`error_body`); SSE frames come from `Response.send_event` (`sse.encode_event` underneath).
"""

from lucebox.http.messages import Handler, Headers, Request, Response
from lucebox.http.router import HttpError, Router, error_body, error_type
from lucebox.http.server import HttpServer, run
from lucebox.http.sse import encode_comment, encode_event

__all__ = ["Handler", "Headers", "HttpError", "HttpServer", "Request", "Response", "Router", "encode_comment",
           "encode_event", "error_body", "error_type", "run"]
