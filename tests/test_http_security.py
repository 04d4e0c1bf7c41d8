"""What a web page may do to the server, over real sockets (issue 11, section 4).

A page the user visits can send simple cross-site requests (no preflight: `text/plain` or form bodies)
and, after a DNS rebinding, requests whose Host is its own name. These tests send exactly what such a
browser sends (Origin, Host, Sec-Fetch-Site, Content-Type) to a live server and check that it is refused
in the dialect's error shape, while what real clients send (no Origin, Host 127.0.0.1:PORT, JSON) works.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import pytest

from lucebox import procs
from lucebox.api.common import ServerContext
from lucebox.http import HttpServer
from lucebox.serve import ServerConfig, http_options, make_app

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
EVIL = "http://evil.example"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         content_type: str | None = "application/json") -> Reply:
    """One request with exactly these headers (http.client adds Host only when none is given)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        hdrs = dict(headers or {})
        if data is not None and content_type is not None:
            hdrs.setdefault("Content-Type", content_type)
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def no_cors(reply: Reply) -> bool:
    return not [h for h in reply.headers if h.startswith("access-control-")]


@contextmanager
def policy_server(**overrides: Any) -> Iterator[str]:
    """The real app and HttpServer options (`http_options`), with no model loaded: enough for every rule that
    decides before a handler runs, and for the endpoints that answer while loading (/status, /status/json)."""
    cfg = ServerConfig(model="unused", port=0, **overrides)
    ctx = ServerContext(model_id="unused", n_ctx=0)
    box: dict[str, Any] = {}
    bound = threading.Event()

    async def main() -> None:
        router = make_app(ctx)
        server = HttpServer(router, **http_options(ctx, cfg, router))
        await server.start()
        box.update(loop=asyncio.get_running_loop(), port=server.port, stop=asyncio.Event())
        bound.set()
        await box["stop"].wait()
        await server.shutdown(1.0)

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="policy-server", daemon=True)
    thread.start()
    assert bound.wait(30)
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(timeout=30)


# ----- Origin -------------------------------------------------------------------------------------


def test_foreign_origin_is_refused_on_chat_props_and_cache_clear(live_server):
    url = live_server.url
    evil = {"Origin": EVIL}
    chat = call(url, "POST", "/v1/chat/completions", CHAT, evil)
    messages = call(url, "POST", "/v1/messages", MESSAGES, evil)
    props = call(url, "GET", "/props", headers=evil)
    clear = call(url, "POST", "/cache/clear", {}, evil)
    preflight = call(url, "OPTIONS", "/v1/chat/completions", headers={
        **evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    for reply in (chat, props, clear, preflight):
        assert reply.status == 403, reply
        assert reply.json()["error"]["type"] == "permission_error"
        assert no_cors(reply), reply.headers  # the page cannot even read the refusal
    assert "evil.example" in chat.json()["error"]["message"] and "--cors-origins" in chat.json()["error"]["message"]
    assert messages.status == 403 and messages.json()["type"] == "error"  # Anthropic's shape on its path
    assert messages.json()["error"]["type"] == "permission_error"
    assert call(url, "GET", "/props").status == 200  # and the same requests without an Origin are served


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8000",
                                    "https://localhost", "http://app.localhost:8080"])
def test_loopback_origin_is_allowed_with_its_own_acao(live_server, origin):
    chat = call(live_server.url, "POST", "/v1/chat/completions", CHAT, {"Origin": origin})
    assert chat.status == 200, chat
    assert chat.headers["access-control-allow-origin"] == origin and chat.headers["vary"] == "Origin"
    preflight = call(live_server.url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    assert preflight.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"


def test_admin_endpoint_never_answers_a_cross_origin_request(live_server):
    url = live_server.url
    port = urlsplit(url).port
    allowed_page = call(url, "POST", "/cache/clear", {}, {"Origin": "http://localhost:5173"})
    preflight = call(url, "OPTIONS", "/cache/clear", headers={"Origin": "http://localhost:5173",
                                                              "Access-Control-Request-Method": "POST"})
    fetch_metadata = call(url, "POST", "/cache/clear", {}, {"Sec-Fetch-Site": "cross-site"})
    for reply in (allowed_page, preflight, fetch_metadata):
        assert reply.status == 403, reply
        assert "admin endpoint" in reply.json()["error"]["message"] and no_cors(reply)
    same_origin = call(url, "POST", "/cache/clear", {}, {"Origin": f"http://127.0.0.1:{port}"})
    assert same_origin.status == 200 and no_cors(same_origin)
    assert call(url, "POST", "/cache/clear", {}).status == 200  # curl, scripts
    assert call(url, "POST", "/cache/clear").status == 200  # no body at all needs no Content-Type


# ----- Content-Type ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_body_that_is_not_declared_json_is_refused(live_server, content_type):
    # text/plain, forms, and a body without a type are what a browser sends cross-site without a preflight.
    body = json.dumps(CHAT).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    reply = call(live_server.url, "POST", "/v1/chat/completions", body, headers, content_type=None)
    assert reply.status == 415, reply
    assert "application/json" in reply.json()["error"]["message"]
    anthropic_reply = call(live_server.url, "POST", "/v1/messages", json.dumps(MESSAGES).encode(), headers,
                           content_type=None)
    assert anthropic_reply.status == 415 and anthropic_reply.json()["type"] == "error"


def test_json_with_charset_and_real_sdks_are_served(live_server):
    ok = call(live_server.url, "POST", "/v1/chat/completions", CHAT, content_type="application/json; charset=utf-8")
    assert ok.status == 200, ok
    client = openai.OpenAI(base_url=live_server.base_url, api_key="none", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].finish_reason in ("stop", "length")
    claude = anthropic.Anthropic(base_url=live_server.url, api_key="none", max_retries=0)
    assert claude.messages.create(**MESSAGES).stop_reason in ("end_turn", "max_tokens")


# ----- Host (DNS rebinding) ------------------------------------------------------------------------


def test_rebound_host_is_refused(live_server):
    url = live_server.url
    port = urlsplit(url).port
    for host in (f"evil.example:{port}", "evil.example", f"192.168.1.20:{port}", f"localhost.evil.example:{port}"):
        reply = call(url, "GET", "/props", headers={"Host": host})
        assert reply.status == 403, (host, reply)
        assert "Host" in reply.json()["error"]["message"] and "--allowed-hosts" in reply.json()["error"]["message"]
    # the rebinding attack proper: the page's own origin, through its own (rebound) name
    rebound = call(url, "POST", "/v1/chat/completions", CHAT, {"Host": f"evil.example:{port}",
                                                              "Origin": f"http://evil.example:{port}"})
    assert rebound.status == 403 and no_cors(rebound)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LocalHost:{port}", "127.0.0.2",
                 f"host.docker.internal:{port}"):  # Docker Desktop reaches the host's loopback by that name
        assert call(url, "GET", "/props", headers={"Host": host}).status == 200, host


def test_configured_origins_and_hosts():
    with policy_server(cors_origins=["https://app.example", "http://dev.example:*"],
                       allowed_hosts=["box.lan"]) as url:
        app = call(url, "GET", "/status/json", headers={"Origin": "https://app.example"})
        dev = call(url, "GET", "/status/json", headers={"Origin": "http://dev.example:4321"})
        other = call(url, "GET", "/status/json", headers={"Origin": "https://other.example"})
        wrong_port = call(url, "GET", "/status/json", headers={"Origin": "https://app.example:8443"})
        pna = call(url, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Private-Network": "true"})
        box = call(url, "GET", "/status/json", headers={"Host": "box.lan:8080"})
        same_origin = call(url, "POST", "/cache/clear", {}, {"Host": "box.lan:8080", "Origin": "http://box.lan:8080"})
        unknown = call(url, "GET", "/status/json", headers={"Host": "other.lan"})
    assert app.status == 200 and app.headers["access-control-allow-origin"] == "https://app.example"
    assert dev.status == 200 and dev.headers["access-control-allow-origin"] == "http://dev.example:4321"
    assert other.status == 403 and wrong_port.status == 403
    assert pna.status == 204 and pna.headers["access-control-allow-private-network"] == "true"
    assert box.status == 200 and unknown.status == 403
    assert same_origin.status == 503  # past the policy (an admin call from its own page); the model is not loaded


def test_star_origin_allows_any_page_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="lucebox.http"), policy_server(cors_origins=["*"]) as url:
        reply = call(url, "GET", "/status/json", headers={"Origin": EVIL})
        admin = call(url, "POST", "/cache/clear", {}, {"Origin": EVIL})
    assert reply.status == 200 and reply.headers["access-control-allow-origin"] == EVIL
    assert admin.status == 403  # `*` never opens the admin endpoints
    assert any("every web page" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_bad_cors_origin_entry_is_one_line_and_exit_2():
    proc = run_lucebox(["serve", "--cors-origins", "ftp://x,not an origin"], {})
    assert proc.returncode == 2 and "--cors-origins entry" in proc.stderr and "Traceback" not in proc.stderr


# ----- API key --------------------------------------------------------------------------------------


def run_lucebox(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m lucebox ARGS` with a clean LUCEBOX_API_KEY; fails before any model is loaded."""
    base = {k: v for k, v in os.environ.items() if k != "LUCEBOX_API_KEY"}
    return procs.run([sys.executable, "-m", "lucebox", *args], capture_output=True, text=True, timeout=120,
                     env={**base, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)


@pytest.mark.parametrize("args, env", [(["serve", "--api-key", ""], {}), (["serve", "--api-key", "  "], {}),
                                       (["serve"], {"LUCEBOX_API_KEY": ""})])
def test_empty_api_key_is_refused_not_taken_as_no_auth(args, env):
    proc = run_lucebox([*args, "--port", "0", "--model", "/nonexistent.gguf"], env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "empty" in lines[-1] and ("--api-key" in lines[-1] or "LUCEBOX_API_KEY" in lines[-1])
    assert "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="empty"):
        HttpServer(make_app(ServerContext(model_id="x", n_ctx=0)), api_key="")


def test_status_page_works_in_a_browser_with_an_api_key():
    with policy_server(api_key="sekret") as url:
        page = call(url, "GET", "/status")
        data_without = call(url, "GET", "/status/json")
        data_with = call(url, "GET", "/status/json", headers={"Authorization": "Bearer sekret"})
        props_without = call(url, "GET", "/props")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    html = page.body.decode()
    # The page takes the key from the fragment (never sent to the server) or a prompt, and sends it as a bearer.
    assert 'location.hash' in html and 'get("key")' in html and "prompt(" in html
    assert '"Authorization": "Bearer " + key' in html and "sessionStorage" in html
    assert data_without.status == 401 and data_with.status == 200
    assert data_with.json()["status"] == "loading"
    assert props_without.status == 401  # the page is public, nothing else is


NODE_HARNESS = r"""
// The status page's own <script>, run by node with a minimal DOM; fetch is node's, against the live server.
const [base, hash, answer, script] = process.argv.slice(1);  // node -e CODE ARGS: no script path
const elements = {};
const record = {prompts: 0, replaced: null, sent: []};
globalThis.document = {getElementById: id => (elements[id] ??= {textContent: "", className: ""})};
globalThis.location = {hash, pathname: "/status"};
globalThis.history = {replaceState: (s, t, url) => { record.replaced = url; }};
const store = new Map();
globalThis.sessionStorage = {getItem: k => store.get(k) ?? null, setItem: (k, v) => store.set(k, String(v))};
globalThis.prompt = () => { record.prompts += 1; return answer === "-" ? null : answer; };
globalThis.setInterval = () => 0;
const realFetch = globalThis.fetch;
globalThis.fetch = (url, init) => {
  record.sent.push(init.headers);
  return realFetch(new URL(url, base + "/status"), init);
};
eval(script);
setTimeout(() => {
  const text = Object.fromEntries(Object.entries(elements).map(([k, v]) => [k, v.textContent]));
  console.log(JSON.stringify({...record, text}));
}, 1500);
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (it runs the status page's script)")
@pytest.mark.parametrize("hash, answer, expect", [("#key=sekret", "-", "fragment"), ("", "sekret", "prompt"),
                                                   ("", "-", "refused")])
def test_status_page_script_sends_the_key_from_fragment_or_prompt(hash, answer, expect):
    with policy_server(api_key="sekret") as url:
        html = call(url, "GET", "/status").body.decode()
        script = html.split("<script>", 1)[1].split("</script>", 1)[0]
        out = procs.run(["node", "-e", NODE_HARNESS, url, hash, answer, script], capture_output=True, text=True,
                        timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    if expect == "refused":
        assert seen["prompts"] == 1 and "401" in seen["text"]["err"]
        return
    assert seen["text"].get("phase") == "loading" and seen["text"]["err"] == "", seen  # /status/json answered
    assert {"Authorization": "Bearer sekret"} in seen["sent"]
    assert seen["prompts"] == (1 if expect == "prompt" else 0)
    if expect == "fragment":
        assert seen["replaced"] == "/status"  # the key leaves the address bar
