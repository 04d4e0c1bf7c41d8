"""Who may drive the server from a browser: Origin (CORS), Host (DNS rebinding), Content-Type, admin paths.

A page the user visits can send requests to a loopback server: simple requests
(no preflight) with `text/plain` or form bodies, or, after a DNS rebinding, as
if it were same-origin. So, like Ollama (`OLLAMA_ORIGINS`, its allowed-hosts
check) and stricter than llama-server (which answers any origin):

- a request that carries an `Origin` is served only when that origin is a
  loopback one (`http(s)://localhost|*.localhost|127.x.x.x|[::1]`, any port), one
  given with `--cors-origins`, or the server's own (same-origin); otherwise 403,
  and a preflight gets no allow headers. Requests without an `Origin` (curl, the
  SDKs, Codex, Claude Code, Open WebUI's backend) are not affected.
- when bound to loopback, the `Host` must be a loopback name, the bound host, this
  machine's hostname, a `*.internal` name (Docker's `host.docker.internal`), or one
  given with `--allowed-hosts`: a rebound name (`evil.example`) gets 403.
- a request body must be `application/json` (or `+json`): `text/plain`, forms and
  a body without a type are what a browser sends cross-site without asking, so 415.
- admin paths (`/cache/clear`) never serve a cross-origin request, whatever the
  allow list says, and never carry CORS headers.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

log = logging.getLogger("lucebox.http")

ADMIN_PATHS = frozenset({"/cache/clear"})
"""Paths no browser page of another origin may call, even an allowed one."""
ALLOW_METHODS = "GET, POST, OPTIONS"
JSON_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _host_name(value: str) -> str:
    """`Host`/origin authority -> bare lower-case name: `[::1]:8080` -> `::1`, `Localhost.:80` -> `localhost`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_loopback_name(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: browsers resolve these to loopback themselves), 127.0.0.0/8, ::1."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


DEFAULT_PORTS = {"http": 80, "https": 443}


def _parse_origin(origin: str) -> tuple[str, str, int] | None:
    """`scheme://host[:port]` -> (scheme, host, port); None when it is no such origin (`null`, junk)."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    return parts.scheme, parts.hostname.rstrip("."), port or DEFAULT_PORTS[parts.scheme]


def parse_origins(entries: Iterable[str]) -> tuple[bool, set[tuple[str, str, int]], set[tuple[str, str]]]:
    """`--cors-origins` entries -> (any origin, exact origins, (scheme, host) with any port); ValueError on junk."""
    any_origin = False
    exact: set[tuple[str, str, int]] = set()
    any_port: set[tuple[str, str]] = set()
    for raw in entries:
        entry = raw.strip().rstrip("/")
        if entry == "*":
            any_origin = True
            continue
        wild = entry.endswith(":*")
        parsed = _parse_origin(entry[:-2] if wild else entry)
        if parsed is None:
            raise ValueError(f"--cors-origins entry {raw!r} is not an origin like http://host:port, http://host:* "
                             "or *")
        if wild:
            any_port.add(parsed[:2])
        else:
            exact.add(parsed)
    return any_origin, exact, any_port


class SecurityPolicy:
    """The origin, host and content-type rules for one server (see the module docstring).

    `cors_origins`: extra allowed origins, `scheme://host[:port]` or `scheme://host:*`, or `*` for any.
    `allowed_hosts`: extra `Host` names accepted when bound to loopback (or anywhere, once given);
    `*` turns the Host check off. `cors=False` sends no CORS headers (only same-origin pages work).
    """

    def __init__(self, *, bound_host: str = "127.0.0.1", cors: bool = True, cors_origins: Iterable[str] = (),
                 allowed_hosts: Iterable[str] = ()) -> None:
        self.cors = cors
        self.any_origin, self.origins, self.origin_any_port = parse_origins(cors_origins)
        if self.any_origin:
            log.warning("CORS: --cors-origins '*' lets every web page you visit use this server (and read its "
                        "answers); list the origins you need instead")
        hosts = [h.strip().lower() for h in allowed_hosts if h.strip()]
        self.any_host = "*" in hosts
        self.bound_host = _host_name(bound_host)
        self.hosts = {_host_name(h) for h in hosts if h != "*"} | {socket.gethostname().lower()}
        if self.bound_host not in ("", "0.0.0.0", "::"):
            self.hosts.add(self.bound_host)
        # Bound to loopback only loopback pages can reach the socket, so a foreign Host is a rebinding attack.
        # Bound elsewhere, any name may be the right one unless the operator listed them.
        self.check_host = not self.any_host and (is_loopback_name(self.bound_host) or bool(hosts))

    # -- the checks -------------------------------------------------------------------------

    def _known(self, name: str) -> bool:
        # `*.internal` is reserved for private use (no public DNS can rebind it): Docker's host.docker.internal.
        return not name or is_loopback_name(name) or name in self.hosts or name.endswith(".internal")

    def trusted_host(self, host: str) -> bool:
        """A Host that cannot be a rebound name: a known one (see `host_allowed`) or an IP literal."""
        name = _host_name(host)
        return self._known(name) or _is_ip(name)

    def host_allowed(self, host: str) -> bool:
        """The DNS-rebinding check: False when this `Host` must be refused (only done when `check_host`)."""
        return not self.check_host or self._known(_host_name(host))

    def same_origin(self, origin: str, host: str) -> bool:
        """Whether `origin` is the server itself as the browser reached it (and not through a rebound name)."""
        parsed = _parse_origin(origin)
        if parsed is None or not host or not self.trusted_host(host):
            return False
        return parsed == _parse_origin("http://" + host.strip())

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Whether a request with this `Origin` may be served (and, with CORS on, read by the page)."""
        if self.same_origin(origin, host):
            return True
        if not self.cors:
            return False
        parsed = _parse_origin(origin)
        if self.any_origin:
            return True
        if parsed is None:
            return False
        scheme, name, port = parsed
        if is_loopback_name(name):
            return True
        return parsed in self.origins or (scheme, name) in self.origin_any_port

    def refusal(self, method: str, path: str, headers: Mapping[str, str], has_body: bool) -> tuple[int, str] | None:
        """(status, message) when the request must be refused before any handler or key check; else None."""
        host = headers.get("host") or ""
        if not self.host_allowed(host):
            return 403, (f"Host {host!r} is not allowed: this server answers only to its loopback names; "
                         "start it with --allowed-hosts NAME to accept another name.")
        origin = headers.get("origin")
        cross = origin is not None and not self.same_origin(origin, host)
        if path in ADMIN_PATHS and (cross or headers.get("sec-fetch-site", "same-origin") not in
                                    ("same-origin", "none")):
            return 403, f"{path} is an admin endpoint: it does not answer cross-origin (browser) requests."
        if origin is not None and not self.origin_allowed(origin, host):
            return 403, (f"Origin {origin!r} is not allowed; start the server with --cors-origins {origin} "
                         "(or set LUCEBOX_CORS_ORIGINS) to let that page use it.")
        if method in JSON_METHODS and has_body:
            ctype = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json" and not ctype.endswith("+json"):
                got = f"got {ctype!r}" if ctype else "none was sent"
                return 415, (f"Content-Type must be application/json ({got}); with curl add "
                             "-H 'Content-Type: application/json'.")
        return None

    # -- response headers -------------------------------------------------------------------

    def cors_headers(self, path: str, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """The CORS headers every response to this request carries (none without an allowed Origin)."""
        origin = headers.get("origin")
        if origin is None or not self.cors or path in ADMIN_PATHS:
            return []
        if not self.origin_allowed(origin, headers.get("host") or ""):
            return []
        return [("access-control-allow-origin", origin), ("vary", "Origin")]

    def preflight_headers(self, path: str, headers: Mapping[str, str]) -> dict[str, str]:
        """Extra headers of a 204 preflight answer from an allowed origin (the caller checked it)."""
        if not self.cors_headers(path, headers):
            return {}
        out = {"access-control-allow-methods": ALLOW_METHODS, "access-control-max-age": "600"}
        # `Access-Control-Allow-Headers: *` does not cover Authorization in browsers (Fetch spec): name them.
        asked = headers.get("access-control-request-headers")
        out["access-control-allow-headers"] = "*, " + asked if asked else "*"
        if headers.get("access-control-request-private-network", "").lower() == "true":
            out["access-control-allow-private-network"] = "true"  # Chrome's Private Network Access
        return out
