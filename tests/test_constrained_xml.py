"""Constrained decoding in the models' own call formats, XML (Qwen3-Coder, Qwen3.5) and Gemma 4's `call:N{…}`,
through live servers of their own.

A module apart from test_constrained_api.py: it starts its own servers, so the shared one is stopped first
(tests/conftest.py) and the suite never holds two at once.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.test_constrained_api import RAW, TOOLS, openai_tools

TEMPLATES = Path(__file__).parent / "data" / "templates"


@pytest.mark.parametrize("template, thinking", [("Qwen-Qwen3-Coder.jinja", None), ("Qwen-Qwen3.5-4B.jinja", False),
                                                ("Qwen-Qwen3.5-4B.jinja", True)])
def test_xml_templates_get_xml_calls_that_validate(smollm2_path, template, thinking):
    """Qwen3-Coder / Qwen3.5 templates: the forced call is written in their XML format (the model's own), and comes
    back as a JSON call whose arguments validate; with thinking on the reasoning comes first, free."""
    from tests.live_server import start_server

    server = start_server(smollm2_path, chat_template_file=str(TEMPLATES / template), kv_tokens=4096)
    try:
        oa = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        assert httpx.get(server.url + "/props").json()["constrained_decoding"]["call_format"] == "xml"
        def one(tool: tuple) -> tuple[list, str, str | None]:
            name, _, _, ask = tool
            if thinking:  # Anthropic's thinking budget closes the reasoning the small model would never close
                an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
                msg = an.messages.create(model="m", max_tokens=320, messages=[{"role": "user", "content": ask}],
                                         tools=[{"name": n, "description": d, "input_schema": p}
                                                for n, d, p, _ in TOOLS],
                                         tool_choice={"type": "tool", "name": name},
                                         thinking={"type": "enabled", "budget_tokens": 48},
                                         extra_body={"temperature": 0})
                assert any(b.type == "thinking" for b in msg.content), msg.content
                return ([(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"],
                        "".join(b.text for b in msg.content if b.type == "text"),
                        {"tool_use": "tool_calls"}.get(msg.stop_reason, msg.stop_reason))
            extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
            r = oa.chat.completions.create(
                model="m", messages=[{"role": "user", "content": ask}], max_tokens=160, temperature=0,
                tools=openai_tools(), tool_choice={"type": "function", "function": {"name": name}},
                extra_body=extra)
            return ([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []],
                    r.choices[0].message.content or "", r.choices[0].finish_reason)

        tools = (TOOLS[0], TOOLS[3])
        with ThreadPoolExecutor(len(tools)) as pool:  # at once: they share the engine's batches
            results = list(pool.map(one, tools))
        for (name, _, params, _), (calls, text, finish) in zip(tools, results):
            assert [c[0] for c in calls] == [name], (calls, text, finish)
            jsonschema.validate(json.loads(calls[0][1]), params)
            assert finish == "tool_calls" and not any(m in text for m in RAW)
    finally:
        server.stop()


def test_gemma4_template_gets_gemma_calls_that_validate(smollm2_path):
    """The Gemma 4 template: a forced call is written `<|tool_call>call:N{k:<|"|>v<|"|>,…}<tool_call|>` (keys sorted,
    strings delimited, numbers bare) and comes back, streamed and not, as a JSON call whose arguments validate."""
    from tests.live_server import start_server

    server = start_server(smollm2_path, chat_template_file=str(TEMPLATES / "google-gemma-4-31B-it.jinja"),
                          kv_tokens=4096)
    try:
        oa = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        assert httpx.get(server.url + "/props").json()["constrained_decoding"]["call_format"] == "gemma"
        def one(ask: str, stream: bool) -> tuple[list, str, str | None]:
            # room for the nested create_event call: this model, shown a format it never learnt, writes ~175 tokens
            kw = dict(model="m", messages=[{"role": "user", "content": ask}], max_tokens=320, temperature=0,
                      tools=openai_tools(), tool_choice="required")
            if not stream:
                r = oa.chat.completions.create(**kw)
                return ([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []],
                        r.choices[0].message.content or "", r.choices[0].finish_reason)
            args: dict[int, list[str]] = {}
            names, text, finish = {}, "", None
            for chunk in oa.chat.completions.create(stream=True, **kw):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                    for c in choice.delta.tool_calls or []:
                        if c.function.name:
                            names[c.index] = c.function.name
                        args.setdefault(c.index, []).append(c.function.arguments or "")
            return [(names[i], "".join(args[i])) for i in sorted(names)], text, finish

        with ThreadPoolExecutor(4) as pool:  # at once: they share the engine's batches
            results = list(pool.map(one, [ask for _, _, _, ask in TOOLS[:4]], (False, True, False, True)))
        for calls, text, finish in results:
            assert len(calls) == 1, (calls, text, finish)
            schema = next(p for n, _, p, _ in TOOLS if n == calls[0][0])
            jsonschema.validate(json.loads(calls[0][1]), schema)
            assert finish == "tool_calls" and not any(m in text for m in RAW + ("call:", '<|"|>')), text
    finally:
        server.stop()
