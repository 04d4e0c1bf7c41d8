"""Real agent clients against a running Lucebox: install them, launch them, probe what they need.

`python -m lucebox clients install|run|probe`. Each client has one small module
here (codex, claude, opencode, hermes, llm, openwebui) holding its `SPEC`
(what to install, pinned) and `launch(target, args)` (the config files and
environment that point it at Lucebox). `install.py` installs into a
project-local folder (`./.clients`, or `$LUCEBOX_CLIENTS_DIR`): npm packages
under `.clients/npm`, each Python client in its own venv under
`.clients/venvs/<name>`. `run.py` starts one configured against a server;
`probe.py` checks, with plain HTTP, the protocol features each client relies on.
"""

from __future__ import annotations

import importlib
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from lucebox.errors import LuceboxError

CLIENT_NAMES = ("codex", "claude", "opencode", "hermes", "llm", "openwebui")
DEFAULT_URL = "http://127.0.0.1:8080"
DUMMY_KEY = "lucebox"  # sent when the server needs no key: clients refuse to start without one
LEAN_BELOW = 32768  # a server context under this many tokens gets each client's lean settings


class ClientError(LuceboxError):
    """A client is not installed, or cannot be configured against the server."""


@dataclass(frozen=True)
class ClientSpec:
    """What to install for one client, pinned to a version that was checked against Lucebox."""

    name: str
    kind: str  # "npm" | "pypi"
    package: str
    version: str
    command: str  # the executable the package provides
    extra: tuple[str, ...] = ()  # more pinned requirements installed with it (pip) or beside it (npm)
    pre: tuple[str, ...] = ()  # pip: installed first, alone (e.g. the CPU build of torch)
    check: tuple[str, ...] = ("--version",)  # arguments that must exit 0 once it is installed
    note: str = ""


@dataclass
class Target:
    """The server a client is pointed at, and where the client keeps its own state."""

    url: str  # http://host:port, no /v1
    model: str
    api_key: str
    context_length: int
    home: Path  # the client's config/state folder (created by launch)
    lean: bool  # trim prompts and tools so they fit a small context

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/") + "/v1"


@dataclass
class Launch:
    """How to start a configured client: argv, environment additions, working folder."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    notes: list[str] = field(default_factory=list)  # what was configured, shown by `clients run`

    def full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def clients_dir() -> Path:
    """Where clients are installed: `$LUCEBOX_CLIENTS_DIR`, else `./.clients`."""
    return Path(os.environ.get("LUCEBOX_CLIENTS_DIR") or ".clients").resolve()


def client_module(name: str) -> ModuleType:
    """The module of one client (`lucebox.clients.codex`, ...); ClientError for an unknown name."""
    if name not in CLIENT_NAMES:
        raise ClientError(f"unknown client {name!r}; known: {', '.join(CLIENT_NAMES)}")
    return importlib.import_module(f"lucebox.clients.{name}")


def spec(name: str) -> ClientSpec:
    return client_module(name).SPEC


def parse_names(text: str) -> list[str]:
    """`codex,claude` or `all` -> names, in the registry's order; ClientError names the unknown one."""
    if text.strip() == "all":
        return list(CLIENT_NAMES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ClientError("--clients is empty; give names (codex,claude,...) or 'all'")
    for n in names:
        client_module(n)
    return [n for n in CLIENT_NAMES if n in names]


def http_json(url: str, body: dict | None = None, api_key: str | None = None, timeout: float = 30) -> dict:
    """GET (or POST `body`) and decode the JSON answer; ClientError on any HTTP or network failure."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")
    req.add_header("content-type", "application/json")
    if api_key:
        req.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ClientError(f"{url}: HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ClientError(f"{url}: cannot connect ({reason}); is `python -m lucebox serve` running?") from None
    except json.JSONDecodeError:
        raise ClientError(f"{url}: the answer is not JSON") from None


# Where a client finds the server when --url is not given: the variables the README has users export,
# Anthropic's first for Claude Code (it reads ANTHROPIC_BASE_URL itself), OpenAI's first for everything else.
SERVER_ENV = {"openai": (("OPENAI_BASE_URL", "OPENAI_API_KEY"), ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")),
              "anthropic": (("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"), ("OPENAI_BASE_URL", "OPENAI_API_KEY"))}


def server_from_env(url: str | None, api_key: str | None, prefer: str = "openai",
                    env: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(server URL without /v1, key): `url`, else $OPENAI_BASE_URL / $ANTHROPIC_BASE_URL, else DEFAULT_URL.

    The key is `api_key`, else $LUCEBOX_API_KEY, else the key variable exported beside the URL variable used.
    """
    env = os.environ if env is None else env
    key = api_key or env.get("LUCEBOX_API_KEY") or None
    if not url:
        for url_var, key_var in SERVER_ENV[prefer]:
            if env.get(url_var):
                url, key = env[url_var], key or env.get(key_var) or None
                if not url.startswith(("http://", "https://")):
                    raise ClientError(f"${url_var}={url!r} is not an http:// or https:// URL")
                break
    url = (url or DEFAULT_URL).rstrip("/")
    return (url[:-3] if url.endswith("/v1") else url), key


def discover(url: str, api_key: str | None = None, home: Path | None = None, name: str = "",
             lean: bool | None = None) -> Target:
    """Ask the server for its model (`/v1/models`) and build the Target a client is configured with."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    listing = http_json(url + "/v1/models", api_key=api_key)
    data = listing.get("data") if isinstance(listing, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ClientError(f"{url}/v1/models lists no model: {str(listing)[:200]}")
    model = data[0]
    n_ctx = int(model.get("context_length") or model.get("max_context_length") or 0)
    return Target(
        url=url,
        model=str(model["id"]),
        api_key=api_key or DUMMY_KEY,
        context_length=n_ctx,
        home=(home or clients_dir() / "home" / name).resolve(),
        lean=(0 < n_ctx < LEAN_BELOW) if lean is None else lean,
    )
