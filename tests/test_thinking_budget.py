"""Thinking budgets: when reasoning runs past its budget the close tag is forced in and the answer follows."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.live_server import start_server

# ChatML whose generation prompt opens a reasoning block (DeepSeek-R1 / Qwen3-thinking style).
THINKING_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    template.write_text(THINKING_CHATML)
    s = start_server(smollm2_path, chat_template_file=template)
    yield s
    s.stop()


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_anthropic_thinking_budget_forces_the_answer(server):
    reply = post(server.url, "/v1/messages", {
        "model": "x", "max_tokens": 60, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 12},
        "messages": [{"role": "user", "content": "What is 2 + 2? Think it through."}]})
    kinds = [b["type"] for b in reply["content"]]
    assert kinds[0] == "thinking" and "text" in kinds, reply
    tok = server.ctx.prompt.tokenizer
    n_thinking = len(tok.encode(reply["content"][0]["thinking"], add_special=False))
    # The budget counts generated tokens; the forced close lands within a step or two of it.
    assert 8 <= n_thinking <= 16, n_thinking
    assert "</think>" not in reply["content"][0]["thinking"]


def test_chat_reasoning_effort_from_the_card_and_disabled_thinking(server):
    off = post(server.url, "/v1/chat/completions", {
        "model": "x", "max_tokens": 16, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert not off["choices"][0]["message"].get("reasoning_content")
    assert off["choices"][0]["message"]["content"]
    on = post(server.url, "/v1/chat/completions", {
        "model": "x", "max_tokens": 24, "temperature": 0, "reasoning_effort": "low",
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert on["choices"][0]["message"].get("reasoning_content"), on
    assert on["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
