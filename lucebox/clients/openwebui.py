"""Open WebUI against Lucebox: one OpenAI connection, auth off, headless.

`open-webui serve` reads its settings from the environment: the connection
(`OPENAI_API_BASE_URL` = the server's `/v1`, `OPENAI_API_KEY`), no Ollama,
`WEBUI_AUTH=False` (single user, signed in as admin@localhost), its database
under the client's home (`DATA_DIR`), offline mode (no Hugging Face
downloads; the local embedding model it cannot fetch is only logged), no
update check or telemetry. Lean: title, tag, follow-up and autocomplete
generation are off, so a chat costs one generation.

The helpers below drive it the way its own frontend does: sign in, send a
chat through `POST /api/chat/completions` with `parent_id: null` (Open WebUI
then creates and stores the chat itself), and render the chat page in
headless Chromium (`screenshot`, `dump_dom`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from lucebox.clients import ClientError, ClientSpec, Launch, Target

SPEC = ClientSpec("openwebui", "pypi", "open-webui", "0.12.4", "open-webui",
                  pre=("torch==2.13.0",), check=("--help",),
                  note="large: ~2.9 GiB venv, ~13 min on 2 cores (torch CPU build installed first)")

DEFAULT_PORT = 3000


def env_for(target: Target) -> dict[str, str]:
    env = {
        "OPENAI_API_BASE_URL": target.base_url,
        "OPENAI_API_KEY": target.api_key,
        "ENABLE_OLLAMA_API": "False",
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": "lucebox-local",
        "DATA_DIR": str(target.home / "data"),
        "OFFLINE_MODE": "True",
        "HF_HUB_OFFLINE": "1",
        "ENABLE_VERSION_UPDATE_CHECK": "False",
        "ANONYMIZED_TELEMETRY": "False",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
    }
    if target.lean:
        for flag in ("TITLE", "TAGS", "FOLLOW_UP", "AUTOCOMPLETE"):
            env[f"ENABLE_{flag}_GENERATION"] = "False"
    return env


def launch(target: Target, args: list[str], exe: str) -> Launch:
    """Return how to start `open-webui serve` (default 127.0.0.1:3000) against the server."""
    (target.home / "data").mkdir(parents=True, exist_ok=True)
    argv = [exe, *(args or ["serve", "--host", "127.0.0.1", "--port", str(DEFAULT_PORT)])]
    return Launch(argv=argv, env=env_for(target), cwd=target.home,
                  notes=[f"OPENAI_API_BASE_URL={target.base_url}, WEBUI_AUTH=False, DATA_DIR={target.home / 'data'}"])


def api(base: str, path: str, body: dict | None = None, token: str | None = None, timeout: float = 600) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body is not None else None,
                                 method="POST" if body is not None else "GET")
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(base: str, timeout: float = 300, proc: subprocess.Popen | None = None) -> None:
    """Poll `/health` until Open WebUI answers (it takes ~1 min to start on 2 cores)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ClientError(f"open-webui exited with code {proc.returncode} before it was ready")
        try:
            if api(base, "/health", timeout=5).get("status") is True:
                return
        except OSError:
            pass
        time.sleep(1)
    raise ClientError(f"open-webui at {base} not ready after {timeout:.0f}s")


def signin(base: str) -> str:
    """With WEBUI_AUTH=False an empty sign-in makes (or logs in) the single admin user; returns its token."""
    token = api(base, "/api/v1/auths/signin", {"email": "", "password": ""})["token"]
    # the "What's new" dialog would cover the chat in screenshots
    api(base, "/api/v1/users/user/settings/update", {"ui": {"showChangelog": False, "showUpdateToast": False}}, token)
    return token


def chat(base: str, token: str, model: str, prompt: str, max_tokens: int = 48) -> tuple[str, str]:
    """Send a new chat through Open WebUI's own API; returns (chat id, the answer Open WebUI stored)."""
    before = {c["id"] for c in api(base, "/api/v1/chats/", token=token)}
    out = api(base, "/api/chat/completions", {  # as the frontend sends it: ids for both turns of the new chat
        "model": model, "stream": False, "max_tokens": max_tokens, "parent_id": None, "id": str(uuid.uuid4()),
        "messages": [{"role": "user", "content": prompt}],
        "user_message": {"id": str(uuid.uuid4()), "role": "user", "content": prompt},
    }, token)
    answer = out["choices"][0]["message"]["content"]
    new = [c["id"] for c in api(base, "/api/v1/chats/", token=token) if c["id"] not in before]
    if len(new) != 1:
        raise ClientError(f"open-webui stored {len(new)} new chats for one completion")
    deadline = time.monotonic() + 60  # Open WebUI writes the turn into the chat in a background task
    current: dict = {}
    while time.monotonic() < deadline:
        stored = api(base, f"/api/v1/chats/{new[0]}", token=token)["chat"].get("history") or {}
        current = (stored.get("messages") or {}).get(stored.get("currentId") or "", {})
        if current.get("role") == "assistant" and current.get("done"):
            break
        time.sleep(0.5)
    if current.get("role") != "assistant" or current.get("content") != answer:
        raise ClientError(f"open-webui stored {current.get('content')!r}, the API answered {answer!r}")
    return new[0], answer


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise ClientError("no Chromium on PATH (Debian: apt-get install chromium)")


def headless(url: str, *extra: str, budget_ms: int = 20000) -> subprocess.CompletedProcess:
    """Run headless Chromium on `url` with a fresh profile, no network chatter of its own."""
    with tempfile.TemporaryDirectory(prefix="lucebox-chromium-") as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
               "--window-size=1280,800", f"--virtual-time-budget={budget_ms}", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def screenshot(base: str, chat_id: str, png: Path) -> Path:
    """A PNG of the chat page as a user sees it."""
    png.parent.mkdir(parents=True, exist_ok=True)
    proc = headless(f"{base}/c/{chat_id}", f"--screenshot={png}")
    if not png.exists() or png.stat().st_size == 0:
        raise ClientError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
    return png


def dump_dom(base: str, chat_id: str) -> str:
    """The chat page's DOM after its scripts ran (to check the answer is really on the page)."""
    return headless(f"{base}/c/{chat_id}", "--dump-dom").stdout
