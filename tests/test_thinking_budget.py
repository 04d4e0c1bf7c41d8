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


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "ahead"])
def server(request, smollm2_path, tmp_path_factory):
    """The server with plain decode steps, and with greedy steps launched one ahead (CUDA's default)."""
    template = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    template.write_text(THINKING_CHATML)
    s = start_server(smollm2_path, chat_template_file=template, ahead=request.param)
    yield s
    s.stop()


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture
def generations(server, monkeypatch) -> list:
    """The engine's generations of the requests the test makes (their output token ids)."""
    engine = server.ctx.engine
    seen = []
    submit = engine.submit

    def recording(*args, **kwargs):
        gen = submit(*args, **kwargs)
        seen.append(gen)
        return gen

    monkeypatch.setattr(engine, "submit", recording)
    return seen


BUDGET = 12
ASK = {"model": "x", "max_tokens": 60, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": BUDGET},
       "messages": [{"role": "user", "content": "What is 2 + 2? Think it through."}]}


def test_anthropic_thinking_budget_forces_the_answer(server, generations):
    reply = post(server.url, "/v1/messages", ASK)
    kinds = [b["type"] for b in reply["content"]]
    assert kinds[0] == "thinking" and "text" in kinds, reply
    assert "</think>" not in reply["content"][0]["thinking"]
    # The engine holds the sequence at the budget (Sequence.hold_at) until the run decides there, so the
    # forced close is the output's tokens right after the first BUDGET, whatever the timing.
    card = server.ctx.card
    close = (card.thinking_terminator_hint if card else None) or "\n</think>\n\n"
    close_ids = server.ctx.prompt.tokenizer.encode(close, add_special=False)
    (gen,) = generations
    out = gen.seq.output_ids
    assert out[BUDGET:BUDGET + len(close_ids)] == close_ids, out
    assert gen.seq.hold_at is None  # the forced tokens lifted the hold


def test_thinking_budget_replies_are_the_same_every_time(server):
    """Greedy output is reproducible with a thinking budget: the same request three times, the same reply."""
    replies = [post(server.url, "/v1/messages", ASK) for _ in range(3)]
    contents = [r["content"] for r in replies]
    assert contents[0] == contents[1] == contents[2], contents
    assert [r["usage"]["output_tokens"] for r in replies] == [replies[0]["usage"]["output_tokens"]] * 3


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
