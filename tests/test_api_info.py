"""The server's own endpoints over real sockets: /health, /v1/models, /tokenize, /detokenize, /props,
/metrics, /status, /status/json.

Two servers, both the real SmolLM2-135M-Instruct behind the real HttpServer:
the shared `live_server`, and `booting` here, started the way `python -m
lucebox` starts (bind first, load after) with an API key and a broken
`--model-card`, so its answers while the model loads, its auth and a bad card
at start-up can be checked. Generation for the metrics tests goes through
`GenerationRun` on the server's own loop (no dependency on a dialect module).
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lucebox.api.common import ServerContext
from lucebox.api.info import codex_models, token_piece
from lucebox.chat.prompt import PromptBuilder
from lucebox.chat.request import ChatRequest
from lucebox.chat.run import GenerationRun
from lucebox.chat.template import ChatTemplate
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.tokenizer import tokenizer_from_gguf
from lucebox.engine.weights.gguf_loader import open_gguf
from lucebox.http import HttpServer
from lucebox.metrics import thread_cpu_counter
from lucebox.model_cards import ModelCard
from lucebox.serve import ServerConfig, http_options, make_app, start_engine
from tests.memory import release_memory

API_KEY = "test-key-123"
RARE_TEXT = "ꙮ𝔘 漢字 🦜 ℵ Ӂ ᚠ ⵣ 𓀀"  # characters byte-level BPE splits into partial UTF-8 tokens
API_ROUTES = {("GET", "/health"), ("GET", "/"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/props"), ("GET", "/metrics"), ("GET", "/status"), ("GET", "/status/json")}
# Fields Codex's ModelInfo (codex-rs/protocol/src/openai_models.rs) requires: no Option, no serde default.
# Missing one makes Codex drop the whole list. Value: the JSON type each must have.
CODEX_REQUIRED = {"slug": str, "display_name": str, "supported_reasoning_levels": list, "shell_type": str,
                  "visibility": str, "supported_in_api": bool, "priority": int, "base_instructions": str,
                  "supports_reasoning_summaries": bool, "support_verbosity": bool, "truncation_policy": dict,
                  "supports_parallel_tool_calls": bool, "experimental_supported_tools": list}
CODEX_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh"}  # Codex's ReasoningEffort, lower-case


# ----- a small HTTP client (http.client: one connection per call) ------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, method: str = "GET", path: str = "/", body: Any = None, headers: dict | None = None,
         raw: bytes | None = None, timeout: float = 60) -> Reply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"content-type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def bearer(key: str = API_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ----- a server started like `python -m lucebox`: socket first, model after --------------------------


@dataclass
class BootingServer:
    url: str
    ctx: ServerContext
    cfg: ServerConfig
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event
    thread: threading.Thread
    while_loading: dict[str, Reply] = field(default_factory=dict)
    health_during_load: list[int] = field(default_factory=list)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout=30)
        self.ctx = None  # type: ignore[assignment]  # the engine goes with it (see live_server.release_memory)
        release_memory()


@pytest.fixture(scope="module")
def booting(smollm2_path, tmp_path_factory):
    bad_card = tmp_path_factory.mktemp("cards") / "bad.json"
    bad_card.write_text('{"name": "broken", "source": "https://example.com", "verified_at": "2026-01-01"}')
    cfg = ServerConfig(model=str(smollm2_path), port=0, device="cpu", dtype="float32", api_key=API_KEY,
                       model_card=bad_card, prefill_compression="off", kv_tokens=4096)  # not ~1 GiB sized from RAM
    ctx = ServerContext(model_id=str(smollm2_path), n_ctx=0)
    bound = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        router = make_app(ctx)
        server = HttpServer(router, **http_options(ctx, cfg, router))
        await server.start()
        box.update(loop=asyncio.get_running_loop(), port=server.port, stop=asyncio.Event())
        bound.set()
        await box["stop"].wait()
        await server.shutdown(2.0)
        if ctx.engine is not None:
            await ctx.engine.stop()

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="booting-server", daemon=True)
    thread.start()
    assert bound.wait(30)
    srv = BootingServer(f"http://127.0.0.1:{box['port']}", ctx, cfg, box["loop"], box["stop"], thread)
    try:
        # The model is not loading yet: ctx is exactly what a loading server has (no engine, no tokenizer).
        for method, path, body in [("GET", "/health", None), ("GET", "/", None), ("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"content": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/props", None), ("GET", "/status/json", None), ("GET", "/metrics", None)]:
            srv.while_loading[path] = call(srv.url, method, path, body, headers=bearer())
        srv.while_loading["/health without key"] = call(srv.url, "GET", "/health")
        # Now load it, as serve.main's startup task does, and watch /health flip.
        loading = asyncio.run_coroutine_threadsafe(start_engine(ctx, cfg), srv.loop)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = call(srv.url, "GET", "/health").status
            srv.health_during_load.append(status)
            if status == 200:
                break
        loading.result(timeout=60)
        yield srv
    finally:
        srv.stop()


def run_on_loop(server: Any, coro: Any, timeout: float = 120) -> Any:
    """Run `coro` on the server's event loop (where the engine's asyncio side lives)."""
    return asyncio.run_coroutine_threadsafe(coro, server.loop).result(timeout)


async def generate(ctx: ServerContext, req: ChatRequest) -> GenerationRun:
    run = await GenerationRun.start(ctx, req)
    await run.collect()
    return run


# ----- /health ---------------------------------------------------------------------------


def test_health_when_loaded(live_server):
    for path in ("/health", "/"):
        reply = call(live_server.url, "GET", path)
        assert reply.status == 200 and reply.json() == {"status": "ok"}
        assert reply.headers["content-type"] == "application/json"


def test_health_is_503_loading_before_the_model_is_loaded(booting):
    for path in ("/health", "/", "/health without key"):
        reply = booting.while_loading[path]
        assert reply.status == 503 and reply.json() == {"status": "loading"}, path
        assert reply.headers["retry-after"] == "2"
    seen = booting.health_during_load
    assert seen[0] == 503 and seen[-1] == 200  # the load takes seconds; the first poll comes at once
    assert seen == sorted(seen, key=lambda s: s == 200), "never back to 503 once ok"


def test_other_endpoints_while_loading(booting):
    for path in ("/v1/models", "/tokenize", "/detokenize"):
        reply = booting.while_loading[path]
        assert reply.status == 503, path
        assert reply.json()["error"]["type"] == "overloaded_error" and "loading" in reply.json()["error"]["message"]
    props = booting.while_loading["/props"]
    assert props.status == 200
    body = props.json()
    assert body["status"] == "loading" and body["model"] is None and body["engine"] is None
    assert body["speculative"]["enabled"] is False and {"method": "GET", "path": "/health"} in body["endpoints"]
    status = booting.while_loading["/status/json"].json()
    assert status["phase"] == "loading" and status["requests"] == {"running": 0, "waiting": 0}
    metrics = parse_prometheus(booting.while_loading["/metrics"].body.decode())
    assert sample(metrics, "lucebox_model_loaded") == 0


# ----- auth --------------------------------------------------------------------------------


def test_api_key_guards_everything_but_health(booting):
    url = booting.url
    assert call(url, "GET", "/health").status == 200
    assert call(url, "GET", "/").status == 200
    assert call(url, "GET", "/status").status == 200  # a static page holding no data: it asks for the key
    for method, path, body in [("GET", "/props", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                               ("POST", "/tokenize", {"content": "x"}), ("GET", "/status/json", None)]:
        for headers in ({}, bearer("wrong"), {"x-api-key": "wrong"}):
            reply = call(url, method, path, body, headers=headers)
            assert reply.status == 401, (path, headers)
            assert reply.json()["error"]["type"] == "authentication_error"
        assert call(url, method, path, body, headers=bearer()).status == 200, path
        assert call(url, method, path, body, headers={"x-api-key": API_KEY}).status == 200, path


def test_bad_model_card_does_not_stop_start_up(booting):
    assert booting.ctx.engine is not None and booting.ctx.card is None
    props = call(booting.url, "GET", "/props", headers=bearer()).json()
    assert props["model_card"] is None
    assert props["default_generation_settings"]["source"] == "built-in"
    assert props["default_generation_settings"]["temperature"] == 0.0  # greedy without a card


# ----- /v1/models ---------------------------------------------------------------------------


def test_models_list(live_server):
    reply = call(live_server.url, "GET", "/v1/models")
    assert reply.status == 200
    body = reply.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert set(model) == {"id", "object", "created", "owned_by", "context_length", "max_context_length"}
    assert model["id"] == live_server.ctx.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert model["object"] == "model" and model["owned_by"] == "lucebox"
    assert model["context_length"] == model["max_context_length"] == live_server.ctx.n_ctx == 8192
    assert isinstance(model["created"], int) and abs(model["created"] - time.time()) < 24 * 3600


def test_models_codex_form(live_server):
    reply = call(live_server.url, "GET", "/v1/models?client_version=0.1.0")
    assert reply.status == 200
    models = reply.json()["models"]
    assert len(models) == 1
    m = models[0]
    for name, kind in CODEX_REQUIRED.items():
        assert isinstance(m.get(name), kind), f"Codex requires {name} ({kind.__name__})"
    assert m["slug"] == live_server.ctx.model_id and m["display_name"] == "SmolLM2 135M Instruct"
    assert isinstance(m["description"], str) and m["description"]
    assert (m["shell_type"], m["visibility"], m["supported_in_api"]) == ("shell_command", "list", True)
    assert m["priority"] == 1
    assert m["context_window"] == live_server.ctx.n_ctx
    assert m["supports_reasoning_summaries"] is False and m["supports_parallel_tool_calls"] is False
    assert m["truncation_policy"]["mode"] in ("bytes", "tokens") and isinstance(m["truncation_policy"]["limit"], int)
    levels = m["supported_reasoning_levels"]
    assert levels and all(set(level) == {"effort", "description"} for level in levels)
    assert {level["effort"] for level in levels} <= CODEX_EFFORTS
    assert m["default_reasoning_level"] in {level["effort"] for level in levels}
    # SmolLM2's template does not think: one level, no fake budgets.
    assert [level["effort"] for level in levels] == ["minimal"]


def test_codex_levels_for_a_thinking_template(live_server):
    source = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    template = ChatTemplate(source.read_text(encoding="utf-8"), origin="test")
    assert template.supports_thinking
    card = ModelCard(name="Qwen3", source="https://huggingface.co/Qwen/Qwen3-0.6B", verified_at="2026-01-01",
                     max_tokens=32768, complex_problem_max_tokens=81920, hard_limit_reply_budget=512)
    builder = PromptBuilder(template, live_server.ctx.prompt.tokenizer)
    ctx = ServerContext(model_id="qwen3", n_ctx=262144, prompt=builder, card=card)
    m = codex_models(ctx)["models"][0]
    assert m["display_name"] == "Qwen3" and m["default_reasoning_level"] == "medium"
    efforts = [level["effort"] for level in m["supported_reasoning_levels"]]
    assert efforts == ["low", "medium", "high", "xhigh"]
    tiers = card.tiers(262144)
    for level, tier in zip(m["supported_reasoning_levels"], ("low", "medium", "high", "x-high")):
        assert str(tiers[tier]) in level["description"]
    ctx.card = None  # efforts change nothing without a card: offer only the default
    assert [lv["effort"] for lv in codex_models(ctx)["models"][0]["supported_reasoning_levels"]] == ["medium"]


# ----- /tokenize, /detokenize ------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(live_server):
    tok = live_server.ctx.prompt.tokenizer
    text = "Hello, wörld! <|im_start|>user\nnaïve café 🙂 " + RARE_TEXT
    for add_special in (False, True):
        reply = call(live_server.url, "POST", "/tokenize", {"content": text, "add_special": add_special})
        assert reply.status == 200
        assert reply.json() == {"tokens": tok.encode(text, add_special=add_special)}
    tokens = call(live_server.url, "POST", "/tokenize", {"content": text}).json()["tokens"]
    assert tok.token_to_id("<|im_start|>") in tokens  # special-token text becomes the special token
    back = call(live_server.url, "POST", "/detokenize", {"tokens": tokens})
    assert back.status == 200 and back.json() == {"content": tok.decode(tokens)} == {"content": text}
    assert call(live_server.url, "POST", "/tokenize", {"content": ""}).json() == {"tokens": []}
    assert call(live_server.url, "POST", "/detokenize", {"tokens": []}).json() == {"content": ""}


def test_tokenize_with_pieces(live_server):
    tok = live_server.ctx.prompt.tokenizer
    text = "Hi there " + RARE_TEXT
    pieces = call(live_server.url, "POST", "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode(text, add_special=False)
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert pieces[0]["piece"] == "Hi" and all(isinstance(p["piece"], (str, list)) for p in pieces)
    assert any(isinstance(p["piece"], list) for p in pieces), "partial UTF-8 pieces come as byte lists"
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw == text.encode()


def test_token_pieces_of_a_byte_fallback_vocabulary(gemma3_path):
    tok = tokenizer_from_gguf(open_gguf(gemma3_path))  # SentencePiece with <0xNN> tokens, not byte-level BPE
    ids = tok.encode(RARE_TEXT, add_special=False)
    pieces = [token_piece(tok, i) for i in ids]
    assert any(isinstance(p, list) for p in pieces) and any(isinstance(p, str) for p in pieces)
    assert b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces) == RARE_TEXT.encode()


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a"]}, "content"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "a", "with_pieces": 1}, "with_pieces"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
])
def test_tokenizer_bad_input_names_the_field(live_server, path, body, param):
    reply = call(live_server.url, "POST", path, body)
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"", b"{nope", b"[1, 2]", b'"text"'])
def test_tokenizer_body_not_an_object(live_server, raw):
    for path in ("/tokenize", "/detokenize"):
        reply = call(live_server.url, "POST", path, raw=raw, headers={"content-type": "application/json"})
        assert reply.status == 400 and reply.json()["error"]["message"]


class GatedTokenizer:
    """The server's real Hugging Face tokenizer, with long encodes held at a gate until the test opens it.

    While the gate is closed the long /tokenize request is provably still being processed, so a /health
    answer in that window shows the loop serving other requests meanwhile: an ordering, not a timing.
    """

    def __init__(self, hf: Any, long: int) -> None:
        self.hf, self.long = hf, long
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        if any(len(t) >= self.long for t in texts):
            self.entered.set()
            assert self.release.wait(120), "the test never opened the gate"
        return self.hf.encode_batch(texts, **kwargs)


def test_long_text_does_not_block_the_loop(live_server, monkeypatch):
    """/health answers while a ~280K-token /tokenize is in progress (tokenizing runs off the event loop,
    through `encode_batch`, which releases the GIL)."""
    corpus = (Path(__file__).parent / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    text = (corpus * (600_000 // len(corpus) + 1))[:600_000]
    tok = live_server.ctx.prompt.tokenizer
    gate = GatedTokenizer(tok.hf, long=len(text))
    monkeypatch.setattr(tok, "hf", gate)
    result: dict[str, Any] = {}

    def big() -> None:
        result["reply"] = call(live_server.url, "POST", "/tokenize", {"content": text}, timeout=300)

    worker = threading.Thread(target=big)
    worker.start()
    try:
        assert gate.entered.wait(120), "the long request never reached the tokenizer"
        health = call(live_server.url, "GET", "/health", timeout=60)  # the tokenizer is still held at the gate
        assert health.status == 200 and "reply" not in result
    finally:
        gate.release.set()
        worker.join(300)
    assert result["reply"].status == 200
    assert len(result["reply"].json()["tokens"]) > 250_000


# ----- /props --------------------------------------------------------------------------------


def test_props(live_server):
    ctx = live_server.ctx
    live_server.wait_idle()
    reply = call(live_server.url, "GET", "/props")
    assert reply.status == 200
    props = reply.json()
    assert props["status"] == "ok"
    model = props["model"]
    assert {"path", "arch", "name", "n_ctx", "n_params", "quant"} <= set(model)
    assert model["arch"] == "llama" and model["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert model["n_ctx"] == ctx.n_ctx and model["quant"] == "Q4_1" and model["n_params"] > 100_000_000
    assert props["model_card"] == json.loads(ctx.card.path.read_text(encoding="utf-8"))  # verbatim
    settings = props["default_generation_settings"]
    assert settings["max_tokens"] == ctx.card.max_tokens and settings["n_ctx"] == ctx.n_ctx
    sampling = ctx.card.sampling
    assert (settings["temperature"], settings["top_p"]) == (sampling["temperature"], sampling["top_p"])
    assert settings["top_k"] == 0 and settings["repetition_penalty"] == settings["repeat_penalty"] == 1.0
    assert settings["thinking"]["supported"] is False
    template = ctx.prompt.template
    assert props["chat_template"] == template.source
    info = props["chat_template_info"]
    assert info["origin"] == "gguf" and info["sha1"] == hashlib.sha1(template.source.encode()).hexdigest()
    assert props["speculative"] == {"enabled": False, "drafter": None, "block_size": None, "ddtree": False,
                                    "ddtree_budget": None}
    pflash = props["pflash"]  # auto by default: prompts over 32000 tokens, the model scoring its own prompt
    assert (pflash["mode"], pflash["threshold"], pflash["keep_ratio"]) == ("auto", 32000, 0.05)
    assert pflash["scorer_is_target"] is True and pflash["compressed_requests"] == 0
    cache = props["prefix_cache"]  # on by default: tier 0 (GPU blocks) and the RAM tiers, no disk
    assert cache["enabled"] is True and cache["slots"] == 32 and cache["exact_slots"] == 4
    assert cache["disk"]["dir"] is None and cache["tiers"]["gpu"]["enabled"] is True
    endpoints = {(e["method"], e["path"]) for e in props["endpoints"]}
    assert API_ROUTES <= endpoints
    engine = props["engine"]
    pool = ctx.engine.engine.kv.pool
    assert engine["kv_blocks_total"] == pool.num_blocks - 1 == engine["kv_blocks_used"] + engine["kv_blocks_free"]
    assert engine["running"] == engine["waiting"] == 0 and engine["steps"] >= 0 and engine["preemptions"] >= 0
    assert props["server"]["api_key"] is None and props["uptime_s"] >= 0


def test_props_reads_features_from_ctx(booting):
    """Later work (DFlash, prefix cache) reports through ctx.props; callables give live counters."""
    hits = iter(range(100))
    spec = {"enabled": True, "drafter": "z-lab/d", "block_size": 16, "ddtree": True, "ddtree_budget": 64,
            "acceptance": 0.71}
    booting.ctx.props["speculative"] = spec
    booting.ctx.props["prefix_cache"] = lambda: {"slots": 4, "in_use": 1, "hits": next(hits), "exact_slots": 1,
                                                 "disk": {"dir": "/tmp/x", "bytes": 10, "budget": 100}}
    try:
        first = call(booting.url, "GET", "/props", headers=bearer()).json()
        second = call(booting.url, "GET", "/props", headers=bearer()).json()
        assert first["speculative"] == spec and first["pflash"]["mode"] == "off"
        assert first["prefix_cache"]["slots"] == 4 and second["prefix_cache"]["hits"] > first["prefix_cache"]["hits"]
        status = call(booting.url, "GET", "/status/json", headers=bearer()).json()
        assert status["acceptance"] == 0.71 and isinstance(status["cache_hits"], int)
    finally:
        del booting.ctx.props["speculative"], booting.ctx.props["prefix_cache"]
    status = call(booting.url, "GET", "/status/json", headers=bearer()).json()
    assert status["acceptance"] is None and status["cache_hits"] is None


# ----- /metrics ------------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(\{{(.*)\}})? (\S+)( -?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\[\\"n])*)"\s*(,|$)')


def parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    """A strict parser of the Prometheus text format 0.0.4: family -> {type, help, samples}.

    Checks: every line is a comment, TYPE/HELP, or a well-formed sample; a family's
    TYPE comes before its samples and once; samples of a family are contiguous and
    named after it (histograms: _bucket/_sum/_count); histogram buckets ascend with
    cumulative counts ending in +Inf == _count; the text ends with a newline.
    """
    assert text.endswith("\n"), "exposition must end with a newline"
    families: dict[str, dict[str, Any]] = {}
    current: str | None = None
    closed: set[str] = set()
    for n, line in enumerate(text.split("\n")[:-1], 1):
        where = f"line {n}: {line!r}"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                assert re.fullmatch(_NAME, name), where
                fam = families.setdefault(name, {"type": None, "help": None, "samples": []})
                key = parts[1].lower()
                assert fam[key] is None, f"second {parts[1]} for {name}: {where}"
                assert not fam["samples"], f"{parts[1]} after samples: {where}"
                value = parts[3] if len(parts) == 4 else ""
                if key == "type":
                    assert value in ("counter", "gauge", "histogram", "summary", "untyped"), where
                fam[key] = value
                if current is not None and current != name:
                    closed.add(current)
                current = name
            continue
        assert line.strip(), f"blank line: {where}"
        m = _SAMPLE.match(line)
        assert m, f"malformed sample: {where}"
        name, label_text, value = m.group(1), m.group(3) or "", m.group(4)
        labels: dict[str, str] = {}
        pos = 0
        while pos < len(label_text):
            lm = _LABEL.match(label_text, pos)
            assert lm and lm.end() > pos, f"malformed labels: {where}"
            assert lm.group(1) not in labels, f"repeated label: {where}"
            labels[lm.group(1)] = lm.group(2).replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
            pos = lm.end()
        number = float(value)  # accepts NaN, +Inf, -Inf as the format does
        family = next((f for f in (name, re.sub(r"_(bucket|sum|count)$", "", name)) if f in families), None)
        assert family is not None, f"sample without TYPE: {where}"
        assert family == current and family not in closed, f"samples of {family} are not contiguous: {where}"
        if family != name:
            assert families[family]["type"] in ("histogram", "summary"), f"suffix on a {family} sample: {where}"
        families[family]["samples"].append((name, labels, number))
    for name, fam in families.items():
        assert fam["type"] is not None, f"{name} has no TYPE"
        if fam["type"] == "histogram":
            buckets = [(float(lb["le"]), v) for s, lb, v in fam["samples"] if s == name + "_bucket"]
            count = [v for s, _, v in fam["samples"] if s == name + "_count"]
            assert buckets and count and [s for s, _, _ in fam["samples"] if s == name + "_sum"], name
            assert [b for b, _ in buckets] == sorted(b for b, _ in buckets) and math.isinf(buckets[-1][0]), name
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name} buckets not cumulative"
            assert buckets[-1][1] == count[0], f"{name}: +Inf bucket != _count"
    return families


def sample(families: dict, name: str, **labels: str) -> float:
    """The value of one sample (0 when a labelled counter has not appeared yet)."""
    family = families.get(name) or families[re.sub(r"_(bucket|sum|count)$", "", name)]
    values = [v for s, lb, v in family["samples"] if s == name and all(lb.get(k) == x for k, x in labels.items())]
    assert len(values) <= 1, f"{name}{labels} is ambiguous"
    return values[0] if values else 0.0


def scrape(url: str, headers: dict | None = None) -> dict[str, dict[str, Any]]:
    reply = call(url, "GET", "/metrics", headers=headers)
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_prometheus(reply.body.decode("utf-8"))


def test_metrics_parse_and_cover_the_spec(live_server):
    families = scrape(live_server.url)
    expected = {
        "lucebox_requests_total": "counter",  # by route and status
        "lucebox_requests_waiting": "gauge",  # queue depth
        "lucebox_requests_running": "gauge",
        "lucebox_prompt_tokens_total": "counter",
        "lucebox_generated_tokens_total": "counter",
        "lucebox_ttft_seconds": "histogram",
        "lucebox_kv_blocks_used": "gauge",
        "lucebox_kv_blocks_free": "gauge",
        "lucebox_prefill_tokens_per_second": "gauge",
        "lucebox_decode_tokens_per_second": "gauge",
        "lucebox_model_loaded": "gauge",
        "lucebox_event_loop_cpu_seconds_total": "counter",  # where a token's host time goes (bench serve)
        "lucebox_engine_thread_cpu_seconds_total": "counter",
    }
    for name, kind in expected.items():
        assert name in families and families[name]["type"] == kind, name
        assert families[name]["help"], name
    assert all(set(lb) == {"route", "status"} for _, lb, _ in families["lucebox_requests_total"]["samples"])
    assert families["lucebox_requests_total"]["samples"], "this very scrape's predecessors are counted"
    pool = live_server.ctx.engine.engine.kv.pool
    assert sample(families, "lucebox_kv_blocks_used") + sample(families, "lucebox_kv_blocks_free") == \
        pool.num_blocks - 1
    assert sample(families, "lucebox_model_loaded") == 1


def test_strict_parser_rejects_bad_exposition():
    good = "# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
    assert sample(parse_prometheus(good), "a_total") == 1
    for bad in ("a_total 1\n",  # no TYPE
                "# TYPE a_total counter\na_total{x=1} 1\n",  # unquoted label
                "# TYPE a_total counter\na_total one\n",  # not a number
                "# TYPE a counter\na 1",  # no final newline
                "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"):
        with pytest.raises((AssertionError, ValueError)):
            parse_prometheus(bad)


def test_metrics_count_a_generation(live_server):
    ctx = live_server.ctx
    live_server.wait_idle()
    before = scrape(live_server.url)
    req = ChatRequest(messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
                      params=SamplingParams(temperature=0.0))
    run = run_on_loop(live_server, generate(ctx, req))
    after = scrape(live_server.url)
    usage = run.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("lucebox_prompt_tokens_total") == usage.prompt_tokens
    assert delta("lucebox_generated_tokens_total") == usage.completion_tokens
    assert delta("lucebox_ttft_seconds_count") == 1 and delta("lucebox_ttft_seconds_sum") > 0
    assert delta("lucebox_generations_total", reason=run.gen.finish_reason) == 1
    assert delta("lucebox_engine_steps_total") >= usage.completion_tokens
    # the engine thread ran the steps and the loop served the requests: each thread's own CPU clock moved
    assert delta("lucebox_engine_thread_cpu_seconds_total") > 0
    assert delta("lucebox_event_loop_cpu_seconds_total") > 0
    total = lambda fams: sum(v for _, _, v in fams["lucebox_requests_total"]["samples"])  # noqa: E731
    assert total(after) - total(before) >= 1  # the first scrape itself
    assert sample(after, "lucebox_requests_running") == 0
    # Idle: every block still in use is one the prefix cache keeps for later requests.
    assert sample(after, "lucebox_kv_blocks_used") == sample(after, "lucebox_prefix_cache_gpu_blocks")
    if usage.completion_tokens > 1:
        assert sample(after, "lucebox_decode_tokens_per_second") > 0
    assert sample(after, "lucebox_prefill_tokens_per_second") > 0
    status = call(live_server.url, "GET", "/status/json").json()
    assert status["recent"]["generations"] >= 1 and status["recent"]["prefill_tokens_per_second"] > 0
    assert status["totals"]["generated_tokens"] >= usage.completion_tokens


def test_metrics_requests_by_route_and_status(live_server):
    before = scrape(live_server.url)
    assert call(live_server.url, "GET", "/health").status == 200
    assert call(live_server.url, "POST", "/tokenize", {"content": 1}).status == 400
    assert call(live_server.url, "GET", "/no/such/route").status == 404
    after = scrape(live_server.url)
    for route, status in (("/health", "200"), ("/tokenize", "400"), ("/metrics", "200"), ("other", "404")):
        assert sample(after, "lucebox_requests_total", route=route, status=status) - \
            sample(before, "lucebox_requests_total", route=route, status=status) == 1, (route, status)


# ----- /status -------------------------------------------------------------------------------


def test_status_page_is_self_contained(live_server):
    reply = call(live_server.url, "GET", "/status")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/html")
    page = reply.body.decode("utf-8")
    assert page.lstrip().lower().startswith("<!doctype html>") and "</html>" in page
    assert not re.search(r"(src|href)\s*=|@import|url\(|https?://", page), "no external assets"
    assert "<style>" in page and "<script>" in page
    assert 'fetch("status/json"' in page and "setInterval(poll, 1000)" in page
    for key in ("phase", "requests", "prefill_tokens_per_second", "decode_tokens_per_second", "acceptance",
                "cache_hits", "uptime_s"):
        assert key in page, f"the page does not show {key}"


def test_status_json_follows_a_running_generation(live_server):
    ctx = live_server.ctx
    live_server.wait_idle()
    idle = call(live_server.url, "GET", "/status/json").json()
    assert idle["status"] == "ok" and idle["phase"] == "idle" and idle["model"] == ctx.model_id
    assert idle["requests"] == {"running": 0, "waiting": 0} and idle["n_ctx"] == ctx.n_ctx
    assert idle["acceptance"] is None and idle["cache_hits"] is not None and idle["uptime_s"] > 0  # cache on
    req = ChatRequest(prompt="1, 2, 3, 4,", max_tokens=24, params=SamplingParams(ignore_eos=True))
    running = asyncio.run_coroutine_threadsafe(generate(ctx, req), live_server.loop)
    seen = []
    while not running.done():
        status = call(live_server.url, "GET", "/status/json").json()
        if status["requests"]["running"]:
            seen.append(status)
    run = running.result(120)
    assert run.usage.completion_tokens == 24
    assert seen, "the status never showed the running request"
    assert all(s["phase"] in ("prefill", "decode") and s["requests"]["running"] == 1 for s in seen)
    assert any(s["phase"] == "decode" for s in seen) and any(s["kv_blocks"]["used"] > 0 for s in seen)
    after = call(live_server.url, "GET", "/status/json").json()
    assert after["phase"] == "idle" and after["requests"]["running"] == 0
    assert after["recent"]["decode_tokens_per_second"] > 0 and after["recent"]["last_ttft_ms"] > 0


def test_thread_cpu_counter_reads_a_threads_own_clock_and_never_goes_back():
    """The reader behind the two thread-CPU counters: a busy thread's CPU seconds grow, a sleeping one's barely
    move, and once the thread has ended (ident None) the last value stays."""
    if not hasattr(time, "pthread_getcpuclockid"):
        pytest.skip("no pthread CPU clocks on this platform")
    alive = threading.Event()
    stop = threading.Event()

    def spin() -> None:
        alive.set()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    alive.wait()
    read = thread_cpu_counter(lambda: t.ident if t.is_alive() else None)
    first = read()
    time.sleep(0.3)
    busy = read()
    stop.set()
    t.join()
    assert busy - first > 0.05  # it spun for most of 0.3 s
    assert read() == busy  # ended: the last value read while it ran, not 0
    mine = thread_cpu_counter(threading.get_ident)
    before = mine()
    time.sleep(0.2)
    assert mine() - before < 0.05  # sleeping costs no CPU
