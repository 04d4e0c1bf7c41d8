"""Server-sent events framing (WHATWG HTML, "Server-sent events").

A frame is an optional `event: NAME` line, one `data: ...` line per line of the
payload, and a blank line. A newline inside the payload must become a new
`data:` line: a raw newline would end the frame early and the client would see
half a JSON object.
"""

from __future__ import annotations

import re

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def encode_event(data: str | bytes, event: str | None = None) -> bytes:
    """One SSE frame: `event: X\\ndata: line1\\ndata: line2\\n\\n` (no event line when `event` is None)."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    parts = []
    if event is not None:
        if "\n" in event or "\r" in event:
            raise ValueError(f"SSE event name cannot contain a line break: {event!r}")
        parts.append(b"event: " + event.encode("utf-8") + b"\n")
    for line in _LINE_BREAK.split(payload):
        parts.append(b"data: " + line + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def encode_comment(text: str = "") -> bytes:
    """A comment frame (`: text`), ignored by clients; keeps idle proxies and client timeouts at bay."""
    lines = _LINE_BREAK.split(text.encode("utf-8"))
    return b"".join(b": " + line + b"\n" for line in lines) + b"\n"
