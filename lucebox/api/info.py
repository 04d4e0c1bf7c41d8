"""The server's own endpoints: health, model list, tokenizer, props, metrics and the status page.

    GET  /health, /            {"status": "ok"}; 503 {"status": "loading"} until the engine runs
    GET  /v1/models            OpenAI model list; with ?client_version= the Codex form
    POST /tokenize, /detokenize  llama.cpp convention: {"content"} <-> {"tokens"}
    GET  /props                everything the server knows about itself (model, card, settings, counters)
    GET  /metrics              Prometheus text (lucebox/metrics.py)
    GET  /status, /status/json a live HTML page (no external assets) and the JSON it polls

Each handler is a small function of (ctx, request, response); what it answers is
built by a pure function of the context (`props_body`, `status_body`,
`codex_models`) so it can be read and tested on its own. Speculative decoding,
PFlash and the prefix cache report themselves through `ctx.props` keys
`speculative`, `pflash` and `prefix_cache` (a dict, or a callable returning one
for live counters); until they exist the defaults below say "off".
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from typing import Any

from lucebox.api.common import ServerContext, field_of, require_object, sampling_from_body
from lucebox.chat.request import bad_field
from lucebox.chat.run import DEFAULT_MAX_TOKENS
from lucebox.engine.tokenizer import Tokenizer
from lucebox.http import Request, Response, Router

SPECULATIVE_OFF = {"enabled": False, "drafter": None, "block_size": None, "ddtree": False, "ddtree_budget": None}
PFLASH_OFF = {"mode": "off", "threshold": None, "keep_ratio": None, "scorer": None}
PREFIX_CACHE_OFF = {"slots": 0, "in_use": 0, "hits": 0, "exact_slots": 0,
                    "disk": {"dir": None, "bytes": 0, "budget": 0}}
SPARK_OFF = {"enabled": False}  # Spark expert offload (lucebox/engine/spark): its placement and counters when on
FEATURES = {"speculative": SPECULATIVE_OFF, "pflash": PFLASH_OFF, "prefix_cache": PREFIX_CACHE_OFF,
            "spark": SPARK_OFF}

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

# Codex (codex-rs/protocol/src/openai_models.rs, ModelInfo) rejects the whole list when a field it
# requires is missing, and uses `base_instructions` as the model's system prompt.
CODEX_EFFORTS = (("low", "low"), ("medium", "medium"), ("high", "high"), ("xhigh", "x-high"))  # Codex -> card tier
CODEX_BASE_INSTRUCTIONS = (
    "You are a coding agent running in the Codex CLI on the user's computer, served by a local model. "
    "Use the tools you are given to read and change files and to run commands; keep your answers short."
)


def register(router: Router, ctx: ServerContext) -> None:
    def bind(handler: Any) -> Any:
        return functools.partial(handler, ctx)

    router.add("GET", "/health", bind(health))
    router.add("GET", "/", bind(health))
    router.add("GET", "/v1/models", bind(models))
    router.add("POST", "/tokenize", bind(tokenize))
    router.add("POST", "/detokenize", bind(detokenize))
    router.add("GET", "/props", functools.partial(props, ctx, router))
    router.add("GET", "/v1/props", functools.partial(props, ctx, router))  # Hermes asks here first
    router.add("GET", "/metrics", bind(metrics))
    router.add("GET", "/status", bind(status_page))
    router.add("GET", "/status/json", bind(status_json))
    router.add("POST", "/cache/clear", bind(cache_clear))
    m = ctx.metrics
    m.gauge("lucebox_model_loaded", "1 once the model is loaded and the engine runs", lambda: ctx.engine is not None)
    m.gauge("lucebox_prefill_tokens_per_second", "Prompt tokens/s over the recent generations",
            lambda: recent_rates(ctx)["prefill_tokens_per_second"] or 0)
    m.gauge("lucebox_decode_tokens_per_second", "Generated tokens/s over the recent generations",
            lambda: recent_rates(ctx)["decode_tokens_per_second"] or 0)


# ----- handlers ------------------------------------------------------------------------


async def health(ctx: ServerContext, request: Request, response: Response) -> None:
    if ctx.engine is None:
        await response.send_json(503, {"status": "loading"}, headers={"Retry-After": "2"})
    else:
        await response.send_json(200, {"status": "ok"})


async def models(ctx: ServerContext, request: Request, response: Response) -> None:
    ctx.ready()
    if "client_version" in request.query:
        await response.send_json(200, codex_models(ctx))
        return
    n_ctx = ctx.n_ctx
    model = {"id": ctx.model_id, "object": "model", "created": int(ctx.started_at), "owned_by": "lucebox",
             "context_length": n_ctx, "max_context_length": n_ctx}
    await response.send_json(200, {"object": "list", "data": [model]})


async def tokenize(ctx: ServerContext, request: Request, response: Response) -> None:
    _, builder = ctx.ready()
    body = require_object(request.json())
    content = field_of(body, "content", str)
    if content is None:
        raise bad_field("content", "is required: the text to tokenize")
    add_special = field_of(body, "add_special", bool, False)
    with_pieces = field_of(body, "with_pieces", bool, False)
    tokens = await asyncio.to_thread(tokenize_text, builder.tokenizer, content, add_special, with_pieces)
    request.log_fields["tokens"] = len(tokens)
    await response.send_json(200, {"tokens": tokens})


async def detokenize(ctx: ServerContext, request: Request, response: Response) -> None:
    _, builder = ctx.ready()
    tok = builder.tokenizer
    body = require_object(request.json())
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad_field("tokens", "must be an array of token ids (integers)")
    bad = next((n for n, i in enumerate(ids) if not 0 <= i < tok.vocab_size), None)
    if bad is not None:
        raise bad_field("tokens", f"[{bad}] = {ids[bad]} is not a token id (the vocabulary has {tok.vocab_size})")
    request.log_fields["tokens"] = len(ids)
    content = await asyncio.to_thread(detokenize_ids, tok, ids)
    await response.send_json(200, {"content": content})


async def props(ctx: ServerContext, router: Router, request: Request, response: Response) -> None:
    await response.send_json(200, props_body(ctx, router))


async def metrics(ctx: ServerContext, request: Request, response: Response) -> None:
    await response.send_text(200, ctx.metrics.render(), content_type=PROMETHEUS_TEXT)


async def cache_clear(ctx: ServerContext, request: Request, response: Response) -> None:
    """Admin: drop every prefix-cache entry (GPU index, RAM snapshots, disk files)."""
    engine, _ = ctx.ready()
    cache = engine.engine.cache
    if cache is None:
        await response.send_json(200, {"cleared": False, "reason": "the prefix cache is off"})
        return
    # The engine thread owns the GPU index: clear between two steps, on that thread.
    done = await asyncio.wrap_future(engine.call_in_engine(cache.clear))
    await response.send_json(200, {"cleared": True, **done})


async def status_page(ctx: ServerContext, request: Request, response: Response) -> None:
    await response.send_text(200, STATUS_HTML, content_type="text/html; charset=utf-8",
                             headers={"Cache-Control": "no-cache"})


async def status_json(ctx: ServerContext, request: Request, response: Response) -> None:
    await response.send_json(200, status_body(ctx), headers={"Cache-Control": "no-cache"})


# ----- /v1/models, Codex form ----------------------------------------------------------------


def codex_models(ctx: ServerContext) -> dict[str, Any]:
    """`{"models": [ModelInfo]}` as Codex parses it (every field its ModelInfo requires is present)."""
    default, levels = codex_reasoning_levels(ctx)
    name = display_name(ctx)
    model = {
        "slug": ctx.model_id,
        "display_name": name,
        "description": f"{name}, served locally by Lucebox ({ctx.n_ctx} tokens of context)",
        "default_reasoning_level": default,
        "supported_reasoning_levels": levels,
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 1,
        "upgrade": None,
        "base_instructions": CODEX_BASE_INSTRUCTIONS,
        "supports_reasoning_summaries": False,
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "supports_parallel_tool_calls": False,
        "context_window": ctx.n_ctx,
        "max_context_window": ctx.n_ctx,
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }
    return {"models": [model]}


def codex_reasoning_levels(ctx: ServerContext) -> tuple[str, list[dict[str, str]]]:
    """(default effort, [{effort, description}]) in Codex's effort names.

    A template that thinks gets low/medium/high/xhigh with the card's budgets
    (just medium without a card: efforts then change nothing). One that does
    not gets the single level "minimal", which every Codex version parses.
    """
    template = ctx.prompt.template if ctx.prompt else None
    if template is None or not template.supports_thinking:
        return "minimal", [{"effort": "minimal", "description": "Answers directly: this model does not think first"}]
    if ctx.card is None:
        return "medium", [{"effort": "medium", "description": "Thinks before answering (no model card: no budget)"}]
    tiers = ctx.card.tiers(ctx.n_ctx)
    return "medium", [{"effort": effort, "description": f"Thinks for up to {tiers[tier]} tokens"}
                      for effort, tier in CODEX_EFFORTS]


def display_name(ctx: ServerContext) -> str:
    if ctx.card is not None:
        return ctx.card.name
    model = ctx.props.get("model") or {}
    return model.get("name") or ctx.model_id


# ----- /tokenize -----------------------------------------------------------------------------


def tokenize_text(tok: Tokenizer, text: str, add_special: bool, with_pieces: bool) -> list:
    """Token ids, or llama.cpp's `[{id, piece}]` where a piece that is not whole UTF-8 is a list of bytes.

    The same ids as `tok.encode`, but through `encode_batch`, which releases the GIL
    (`encode` holds it: a 100K-token text would stall the event loop even from a worker thread).
    """
    ids = tok.hf.encode_batch([text], add_special_tokens=False)[0].ids
    if add_special and tok.add_bos:
        ids.insert(0, tok.bos_id)
    if not with_pieces:
        return ids
    return [{"id": i, "piece": token_piece(tok, i)} for i in ids]


def detokenize_ids(tok: Tokenizer, ids: list[int]) -> str:
    """`tok.decode(ids)` with special tokens kept, through `decode_batch`, which releases the GIL."""
    return tok.hf.decode_batch([ids], skip_special_tokens=False)[0]


def token_piece(tok: Tokenizer, token_id: int) -> str | list[int]:
    text = tok.decode([token_id])
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tok, token_id)
    if raw is None:
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def token_bytes(tok: Tokenizer, token_id: int) -> bytes | None:
    """The raw bytes a token stands for: `<0xNN>` byte-fallback tokens and byte-level BPE spellings."""
    spelling = tok.id_to_token(token_id) or ""
    match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", spelling)
    if match:
        return bytes([int(match.group(1), 16)])
    table = _byte_level_decoder()
    if type(tok.hf.decoder).__name__ == "ByteLevel" and spelling and all(c in table for c in spelling):
        return bytes(table[c] for c in spelling)
    return None


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


# ----- /props --------------------------------------------------------------------------------


def props_body(ctx: ServerContext, router: Router) -> dict[str, Any]:
    """`ctx.props` (model, model_card, server, features) plus what is computed live."""
    body: dict[str, Any] = {"status": "ok" if ctx.engine is not None else "loading", "model_id": ctx.model_id,
                            "model": None, "model_card": None}
    body.update({k: (v() if callable(v) else v) for k, v in ctx.props.items()})
    for name, off in FEATURES.items():
        body.setdefault(name, off)
    template = ctx.prompt.template if ctx.prompt else None
    body.update(
        default_generation_settings=default_generation_settings(ctx),
        chat_template=template.source if template else None,
        chat_template_info=template_info(template),
        endpoints=[{"method": method, "path": path} for method, path in router.routes],
        engine=engine_counters(ctx),
        uptime_s=round(time.time() - ctx.started_at, 1),
    )
    return body


def default_generation_settings(ctx: ServerContext) -> dict[str, Any]:
    """What a request that sets nothing gets: the card's values, else the built-in ones (greedy)."""
    p = sampling_from_body({}, ctx.card)
    card = ctx.card
    thinks = bool(ctx.prompt and ctx.prompt.template.supports_thinking)
    return {
        "n_ctx": ctx.n_ctx,
        "max_tokens": card.max_tokens if card else DEFAULT_MAX_TOKENS,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "repeat_penalty": p.repetition_penalty,  # llama.cpp's name
        "seed": p.seed,
        "source": f"model card {card.path}" if card else "built-in",
        "thinking": {"supported": thinks, "reply_budget": card.hard_limit_reply_budget if card else None,
                     "effort_tiers": card.tiers(ctx.n_ctx) if card and thinks else None},
    }


def template_info(template: Any) -> dict[str, Any] | None:
    if template is None:
        return None
    tool = template.tool_template
    return {"origin": template.origin, "sha1": template.sha1, "supports_tools": template.supports_tools,
            "supports_thinking": template.supports_thinking,
            "tool_template": {"origin": tool.origin, "sha1": tool.sha1} if tool else None}


def engine_counters(ctx: ServerContext) -> dict[str, Any] | None:
    eng = ctx.engine
    if eng is None:
        return None
    llm = eng.engine
    pool = llm.kv.pool
    return {"running": eng.num_running, "waiting": eng.num_waiting, "max_num_seqs": llm.scheduler.max_num_seqs,
            "max_queue": eng.max_queue, "kv_blocks_used": pool.num_used, "kv_blocks_free": pool.num_free,
            "kv_blocks_total": pool.num_blocks - 1, "kv_block_size": llm.kv.block_size, "steps": eng.steps,
            "preemptions": llm.scheduler.num_preemptions, "disconnects": eng.num_disconnects}


def feature(ctx: ServerContext, name: str) -> dict[str, Any]:
    value = ctx.props.get(name, FEATURES[name])
    return value() if callable(value) else value


# ----- /status -------------------------------------------------------------------------------


def status_body(ctx: ServerContext) -> dict[str, Any]:
    """What the status page shows: phase, requests, recent speed, acceptance, cache hits."""
    eng = ctx.engine
    spec, cache = feature(ctx, "speculative"), feature(ctx, "prefix_cache")
    return {
        "status": "ok" if eng is not None else "loading",
        "phase": phase(ctx),
        "model": ctx.model_id,
        "n_ctx": ctx.n_ctx,
        "uptime_s": round(time.time() - ctx.started_at, 1),
        "requests": {"running": eng.num_running if eng else 0, "waiting": eng.num_waiting if eng else 0},
        "kv_blocks": {"used": eng.engine.kv.pool.num_used, "free": eng.engine.kv.pool.num_free} if eng else None,
        "recent": recent_rates(ctx),
        "acceptance": spec.get("acceptance") if spec.get("enabled") else None,
        "cache_hits": cache.get("hits") if cache.get("slots") else None,
        "totals": {"prompt_tokens": ctx.metrics.prompt_tokens, "generated_tokens": ctx.metrics.generated_tokens,
                   "generations": sum(ctx.metrics.finish_reasons.values())},
    }


def phase(ctx: ServerContext) -> str:
    """loading | idle | prefill (a running sequence still has prompt to process, or one waits) | decode."""
    eng = ctx.engine
    if eng is None:
        return "loading"
    running = list(eng.engine.scheduler.running)
    if any(seq.num_computed < seq.num_prompt for seq in running):
        return "prefill"
    if running:
        return "decode"
    return "prefill" if eng.num_waiting else "idle"


def recent_rates(ctx: ServerContext) -> dict[str, Any]:
    """Token rates over the last generations (ctx.metrics.recent), weighted by tokens."""
    recent = list(ctx.metrics.recent)
    prefill = [r for r in recent if r.get("prefill_ms")]
    decode = [r for r in recent if r.get("decode_ms") and r["completion_tokens"] > 1]
    prefill_ms = sum(r["prefill_ms"] for r in prefill)
    decode_ms = sum(r["decode_ms"] for r in decode)
    return {
        "generations": len(recent),
        "prefill_tokens_per_second": (round(sum(r["prompt_tokens"] for r in prefill) / prefill_ms * 1000, 1)
                                      if prefill_ms else None),
        "decode_tokens_per_second": (round(sum(r["completion_tokens"] - 1 for r in decode) / decode_ms * 1000, 1)
                                     if decode_ms else None),
        "last_ttft_ms": recent[-1].get("ttft_ms") if recent else None,
    }


STATUS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Lucebox status</title>
<style>
body{font:15px/1.4 system-ui,sans-serif;margin:2rem auto;max-width:44rem;padding:0 1rem;color:#222;background:#fafafa}
h1{font-size:1.3rem;margin:0 0 .2rem}#model{color:#666;margin-bottom:1rem;word-break:break-all}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(10rem,1fr));gap:.6rem}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6rem .8rem}
.k{color:#777;font-size:.8rem;text-transform:uppercase;letter-spacing:.04em}.v{font-size:1.3rem;margin-top:.1rem}
.loading{color:#b60}.idle{color:#666}.prefill{color:#06c}.decode{color:#080}#err{color:#b00;margin-top:1rem}
</style></head><body>
<h1>Lucebox</h1><div id="model">&hellip;</div>
<div class="grid">
<div class="card"><div class="k">phase</div><div class="v" id="phase">&hellip;</div></div>
<div class="card"><div class="k">running / waiting</div><div class="v" id="requests">&ndash;</div></div>
<div class="card"><div class="k">prefill tok/s</div><div class="v" id="prefill">&ndash;</div></div>
<div class="card"><div class="k">decode tok/s</div><div class="v" id="decode">&ndash;</div></div>
<div class="card"><div class="k">last TTFT ms</div><div class="v" id="ttft">&ndash;</div></div>
<div class="card"><div class="k">KV blocks used / free</div><div class="v" id="kv">&ndash;</div></div>
<div class="card"><div class="k">draft acceptance</div><div class="v" id="acceptance">&ndash;</div></div>
<div class="card"><div class="k">cache hits</div><div class="v" id="cache">&ndash;</div></div>
<div class="card"><div class="k">generations</div><div class="v" id="gens">&ndash;</div></div>
<div class="card"><div class="k">uptime</div><div class="v" id="uptime">&ndash;</div></div>
</div><div id="err"></div>
<script>
const $ = id => document.getElementById(id);
const show = v => (v === null || v === undefined) ? "n/a" : String(v);
function uptime(s) {
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), r = Math.floor(s % 60);
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
}
// With --api-key the page (public: it holds no data) sends the key on its polls. The key comes from the URL
// fragment (/status#key=K: never sent to the server, so it is in no log or Referer), else from a prompt, and is
// kept in sessionStorage (this tab only); the fragment is then removed from the address bar.
const KEY = "lucebox-api-key";
const fragment = new URLSearchParams(location.hash.slice(1)).get("key");
if (fragment) { sessionStorage.setItem(KEY, fragment); history.replaceState(null, "", location.pathname); }
let asked = false;
async function poll() {
  try {
    const key = sessionStorage.getItem(KEY);
    const r = await fetch("status/json", {cache: "no-store", headers: key ? {"Authorization": "Bearer " + key} : {}});
    if (r.status === 401 && !asked) {
      asked = true;
      const given = prompt("This server needs its API key (--api-key) to show its status:");
      if (given) { sessionStorage.setItem(KEY, given); return poll(); }
      throw new Error("HTTP 401: open /status#key=YOUR_KEY");
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    $("model").textContent = s.model + " \\u00b7 " + s.n_ctx + " tokens of context";
    $("phase").textContent = s.phase; $("phase").className = "v " + s.phase;
    $("requests").textContent = s.requests.running + " / " + s.requests.waiting;
    $("prefill").textContent = show(s.recent.prefill_tokens_per_second);
    $("decode").textContent = show(s.recent.decode_tokens_per_second);
    $("ttft").textContent = show(s.recent.last_ttft_ms);
    $("kv").textContent = s.kv_blocks ? s.kv_blocks.used + " / " + s.kv_blocks.free : "n/a";
    $("acceptance").textContent = show(s.acceptance);
    $("cache").textContent = show(s.cache_hits);
    $("gens").textContent = s.totals.generations;
    $("uptime").textContent = uptime(s.uptime_s);
    $("err").textContent = "";
  } catch (e) {
    $("err").textContent = "cannot reach the server: " + e.message;
  }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""
