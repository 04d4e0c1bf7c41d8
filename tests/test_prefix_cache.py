"""The tiered prefix cache inside the running server: hits give identical output, survive a restart,
and nothing bad is ever loaded from the cache folder."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import data_file
from tests.live_server import start_server


def chat(url: str, messages: list[dict], max_tokens: int = 12, **extra: object) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps({
        "model": "x", "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}).encode(),
        headers={"content-type": "application/json"}, method="POST")
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        body = json.loads(r.read())
    body["wall"] = time.monotonic() - t
    return body


def turn(user: str) -> list[dict]:
    system = data_file("agent_prompts/codex_gpt5_codex.md").read_text(encoding="utf-8")[:4000]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    s = start_server(smollm2_path, kv_cache_dir=tmp_path_factory.mktemp("kv"), kv_cache_min_tokens=16)
    yield s
    s.stop()


def test_repeated_prompt_hits_and_output_is_identical(server):
    cold = chat(server.url, turn("List the files you would read first."))
    warm = chat(server.url, turn("List the files you would read first."))
    assert cached(cold) == 0
    n = warm["usage"]["prompt_tokens"]
    assert cached(warm) >= 0.9 * n, "a repeated prompt should be served almost entirely from the cache"
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    print(f"[prefix cache] {n}-token prompt: cold {cold['timings']['ttft_ms']:.0f} ms, warm "
          f"{warm['timings']['ttft_ms']:.0f} ms, ratio {cold['timings']['ttft_ms'] / warm['timings']['ttft_ms']:.1f}x")


def test_next_turn_reuses_the_previous_one(server):
    first = turn("What does this agent do?")
    a = chat(server.url, first)
    second = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And how does it edit files?"}]
    b = chat(server.url, second)
    assert cached(b) > a["usage"]["prompt_tokens"] // 2


def test_ram_tiers_restore_after_the_gpu_blocks_are_gone(server):
    eng = server.ctx.engine
    cache = eng.engine.cache
    msgs = turn("Explain the sandbox rules in one sentence.")
    cold = chat(server.url, msgs)
    # Drop the GPU tier (engine thread), keep RAM snapshots: the next identical prompt restores tier 2.
    eng.call_in_engine(lambda: cache.evict(10**6)).result()
    before = cache.counters["exact"].hits
    warm = chat(server.url, msgs)
    assert cache.counters["exact"].hits == before + 1
    assert cached(warm) == warm["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def test_restart_with_the_disk_tier_hits_on_the_first_request(smollm2_path, tmp_path):
    msgs = turn("Which command runs the tests?")
    first = start_server(smollm2_path, kv_cache_dir=tmp_path, kv_cache_min_tokens=16)
    try:
        cold = chat(first.url, msgs)
    finally:
        first.stop()  # no flush: stopping the server writes out the snapshots still queued for the disk
    files = sorted(tmp_path.rglob("*.kv"))
    assert files, "nothing was persisted"
    second = start_server(smollm2_path, kv_cache_dir=tmp_path, kv_cache_min_tokens=16)
    try:
        warm = chat(second.url, msgs)
        assert cached(warm) >= warm["usage"]["prompt_tokens"] - 1
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    finally:
        second.stop()
    # Damage every file: a third server skips and removes them, counts them, and still answers the same.
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    third = start_server(smollm2_path, kv_cache_dir=tmp_path, kv_cache_min_tokens=16)
    try:
        again = chat(third.url, msgs)
        disk = third.ctx.engine.engine.cache.disk.stats()
        assert cached(again) == 0
        assert disk.corrupt_removed >= 1
        assert again["choices"][0]["message"] == cold["choices"][0]["message"]
    finally:
        third.stop()


def test_another_template_never_loads_this_cache(smollm2_path, tmp_path):
    msgs = turn("Say hi.")
    a = start_server(smollm2_path, kv_cache_dir=tmp_path, kv_cache_min_tokens=16)
    try:
        chat(a.url, msgs)
        a.ctx.engine.engine.cache.disk.flush()
    finally:
        a.stop()
    other = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    b = start_server(smollm2_path, kv_cache_dir=tmp_path, kv_cache_min_tokens=16, chat_template_file=other)
    try:
        assert b.ctx.engine.engine.cache.disk.stats().entries == 0  # its layout folder is a different one
        assert cached(chat(b.url, msgs)) == 0
    finally:
        b.stop()


def test_admin_clear_and_visibility(server):
    chat(server.url, turn("One more question."))
    with urllib.request.urlopen(server.url + "/props") as r:
        props = json.loads(r.read())["prefix_cache"]
    assert props["enabled"] and props["hits"] >= 1 and props["disk"]["dir"]
    with urllib.request.urlopen(server.url + "/metrics") as r:
        metrics = r.read().decode()
    assert "lucebox_prefix_cache_gpu_hits_total" in metrics
    req = urllib.request.Request(server.url + "/cache/clear", b"{}", method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        cleared = json.loads(r.read())
    assert cleared["cleared"] is True
    assert server.ctx.engine.engine.cache.blocks_held == 0
    assert cached(chat(server.url, turn("One more question."))) == 0


BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def test_a_tool_call_sent_back_replays_the_models_own_text_and_hits_the_cache(server):
    """API.md "multi-turn replay": the call comes back as JSON; rendered as the model wrote it, the next
    prompt extends the cached one token for token (this template cannot render tools: they are injected)."""
    def ask(messages: list[dict]) -> dict:
        req = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps({
            "model": "x", "messages": messages, "temperature": 0, "max_tokens": 40, "tools": [BASH_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "bash"}}}).encode(),
            headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    history = turn("List the files in the current directory.")
    first = ask(history)
    calls = first["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "bash"
    replayed_before = server.ctx.replay.replayed
    history += [{"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "README.md\nsetup.py\nlucebox"}]
    second = chat(server.url, history, tools=[BASH_TOOL])  # clients send the tools with every turn
    assert server.ctx.replay.replayed == replayed_before + 1
    # The replayed turn is the model's own text, so the second prompt extends the first (forced call prefix
    # and all), and the cache serves every whole 16-token block of the first prompt. (How far past it depends
    # on block alignment and on how the join of forced prefix and generated text retokenizes.)
    rewritten = server.ctx.replay.rewrite(history)
    replayed_before += 1  # this rewrite
    first_text = server.ctx.prompt.render(history[:2], tools=[BASH_TOOL])
    assert server.ctx.prompt.render(rewritten, tools=[BASH_TOOL]).startswith(first_text + rewritten[2]["content"])
    assert cached(second) >= first["usage"]["prompt_tokens"] // 16 * 16, cached(second)
    # A call the server never made (an id it does not know) is rendered by the template, not replayed.
    history[-2] = {"role": "assistant", "content": None, "tool_calls": [{**calls[0], "id": "call_unknown"}]}
    history[-1] = {**history[-1], "tool_call_id": "call_unknown"}
    chat(server.url, history)
    assert server.ctx.replay.replayed == replayed_before + 1
