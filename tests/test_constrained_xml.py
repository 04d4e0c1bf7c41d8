"""Constrained decoding with the XML call format (Qwen3-Coder, Qwen3.5 templates) through a live server of its own.

A module apart from test_constrained_api.py: it starts its own servers, so the shared one is stopped first
(tests/conftest.py) and the suite never holds two at once.
"""

from __future__ import annotations

import json
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
        for name, _, params, ask in (TOOLS[0], TOOLS[3]):
            if thinking:  # Anthropic's thinking budget closes the reasoning the small model would never close
                an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
                msg = an.messages.create(model="m", max_tokens=320, messages=[{"role": "user", "content": ask}],
                                         tools=[{"name": n, "description": d, "input_schema": p}
                                                for n, d, p, _ in TOOLS],
                                         tool_choice={"type": "tool", "name": name},
                                         thinking={"type": "enabled", "budget_tokens": 48},
                                         extra_body={"temperature": 0})
                calls = [(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"]
                text = "".join(b.text for b in msg.content if b.type == "text")
                finish = {"tool_use": "tool_calls"}.get(msg.stop_reason, msg.stop_reason)
                assert any(b.type == "thinking" for b in msg.content), msg.content
            else:
                extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
                r = oa.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": ask}], max_tokens=160, temperature=0,
                    tools=openai_tools(), tool_choice={"type": "function", "function": {"name": name}},
                    extra_body=extra)
                calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
                text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
            assert [c[0] for c in calls] == [name], (calls, text, finish)
            jsonschema.validate(json.loads(calls[0][1]), params)
            assert finish == "tool_calls" and not any(m in text for m in RAW)
    finally:
        server.stop()
