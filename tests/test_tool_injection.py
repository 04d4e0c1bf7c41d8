"""Tools for a chat template that cannot render them (the default SmolLM2 one ignores `tools`).

As llama-server does for such templates, the tools go into a system message and
tool turns into the messages, in the Hermes format the streaming tool-call
parser reads: calls as `<tool_call>` JSON, results as `<tool_response>` blocks.
Templates that render tools themselves are left alone (tests/test_chat_template.py
checks them against transformers).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import openai
import pytest

from lucebox.chat.events import ToolCallEnd
from lucebox.chat.template import TOOLS_SECTION, ChatTemplate, resolve_chat_template
from lucebox.chat.toolcalls import ToolCallParser

TEMPLATES = Path(__file__).parent / "data" / "templates"
SMOLLM2 = (TEMPLATES / "HuggingFaceTB-SmolLM2-135M-Instruct.jinja").read_text(encoding="utf-8")
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "(second result)"},
]


def smollm2() -> ChatTemplate:
    return ChatTemplate(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_smollm2_cannot_render_tools_and_gets_them_injected() -> None:
    template = smollm2()
    assert not template.supports_tools
    got = template.render([{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL])
    section = TOOLS_SECTION.format(tools="\n" + json.dumps(TOOL, ensure_ascii=False))
    assert got == (f"<|im_start|>system\n{section}<|im_end|>\n"
                   "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "get_weather"' in got and '"required": ["city"]' in got  # the schema, whole
    without = template.render([{"role": "user", "content": "Weather in Paris?"}])
    assert "get_weather" not in without and "You are a helpful AI assistant named SmolLM" in without


def test_a_system_message_keeps_its_text_and_gains_the_tools() -> None:
    got = smollm2().render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                           tools=[TOOL])
    assert got.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n") and got.count("<|im_start|>system") == 1


def test_tool_calls_and_results_render_in_the_generic_format() -> None:
    got = smollm2().render(TOOL_TURNS, tools=[TOOL])
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n" in got
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n(second result)\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in got
    assert "<|im_start|>tool" not in got


def test_injected_call_format_is_what_the_parser_reads() -> None:
    """The format the model is shown (and past calls are written in) parses back into the same call."""
    parser = ToolCallParser([TOOL])
    events = [e for piece in CALL_TEXT.split(" ") for e in parser.push(piece + " ")] + parser.finish()
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [("get_weather", {"city": "Paris"})]


def test_replayed_call_text_renders_verbatim_in_the_same_format() -> None:
    """A replayed turn (ToolCallReplay: the model's own text) is plain content: it renders as written."""
    raw = "Let me check.\n" + CALL_TEXT
    got = smollm2().render([TOOL_TURNS[0], {"role": "assistant", "content": raw}, TOOL_TURNS[2]], tools=[TOOL])
    assert f"<|im_start|>assistant\n{raw}<|im_end|>\n" in got


def test_templates_that_render_tools_are_left_alone() -> None:
    qwen3 = ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
    assert qwen3.supports_tools
    got = qwen3.render(TOOL_TURNS, tools=[TOOL])
    assert "one or more of these functions" not in got  # no injected section: Qwen's own tools text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in got  # Qwen's own rendering of the result


def test_gemma3_tool_conversation_renders_with_injection() -> None:
    """Gemma 3's template refuses a `tool` role; with the tools injected, the turns alternate and render."""
    gemma = ChatTemplate((TEMPLATES / "google-gemma-3-it.jinja").read_text(encoding="utf-8"), bos_token="<bos>")
    got = gemma.render(TOOL_TURNS, tools=[TOOL])
    assert "get_weather" in got and CALL_TEXT in got and "<tool_response>\n18 C, sunny" in got


def test_the_log_says_so_once_at_load(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="lucebox.chat.template"):
        template = resolve_chat_template(gguf_template=SMOLLM2)
        for _ in range(3):
            template.render([{"role": "user", "content": "hi"}], tools=[TOOL])
        resolve_chat_template(gguf_template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
    notes = [r.getMessage() for r in caplog.records if "cannot show tools" in r.getMessage()]
    assert notes == ["the chat template (gguf) cannot show tools to the model: requests with tools get them in a "
                     "system message, with calls as <tool_call> JSON"]


# ----- the default model's server -----------------------------------------------------------------------


def test_default_server_shows_tools_to_the_model(live_server) -> None:
    """The prompt of a request with tools holds them (it did not: SmolLM2's template drops `tools`)."""
    client = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    builder = live_server.ctx.prompt
    with_tools = builder.render_ids(messages, tools=[TOOL], add_generation_prompt=True)
    assert "get_weather" in builder.tokenizer.decode(with_tools)
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=1, temperature=0)
    reply = client.chat.completions.create(model="m", messages=messages, tools=[TOOL], max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == len(with_tools) > plain.usage.prompt_tokens + 40


def test_default_server_makes_a_forced_call_and_takes_its_result(live_server) -> None:
    """A required call comes back as a parsed tool call; the result turn renders and is answered."""
    client = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model="m", messages=messages, tools=[TOOL], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]
    text = live_server.ctx.prompt.render(messages, tools=[TOOL], add_generation_prompt=True)
    assert "<tool_call>\n" in text and "<tool_response>\n18 C, sunny\n</tool_response>" in text
    follow = client.chat.completions.create(model="m", messages=messages, tools=[TOOL], max_tokens=8,
                                            temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_with_one_tool_streams_a_call_of_that_tool_over_two_turns(live_server) -> None:
    """tool_choice "required" with one declared tool is that tool: the streamed call names it (the model alone
    named a city and the markup leaked into the text), and the streamed second turn answers the result."""
    client = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    calls: dict[int, dict[str, str]] = {}
    text, finish = "", None
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[TOOL], tool_choice="required",
                                                stream=True, max_tokens=48, temperature=0):
        delta = chunk.choices[0].delta if chunk.choices else None
        for tc in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["args"] += tc.function.arguments or ""
        text += (delta.content or "") if delta else ""
        finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
    assert "<tool_call>" not in text
    assert [c["name"] for c in calls.values()] == ["get_weather"] and finish == "tool_calls"
    assert isinstance(json.loads(calls[0]["args"]), dict)
    messages += [{"role": "assistant", "tool_calls": [{"id": calls[0]["id"], "type": "function", "function": {
                     "name": "get_weather", "arguments": calls[0]["args"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C, sunny"}]
    stream = client.chat.completions.create(model="m", messages=messages, tools=[TOOL], stream=True, max_tokens=12,
                                            temperature=0, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "the second turn reuses the first's prompt"
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


@pytest.mark.parametrize("choice", ["auto", "tool"])
def test_anthropic_dialect_gets_the_tools_too(live_server, choice: str) -> None:
    """count_tokens sees the injected tools; a named tool choice comes back as a tool_use block."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=live_server.url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "description": "Current weather in a city",
            "input_schema": TOOL["function"]["parameters"]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    count = client.messages.count_tokens(model="m", messages=messages, tools=[tool]).input_tokens
    plain = client.messages.count_tokens(model="m", messages=messages).input_tokens
    assert count > plain + 40
    reply = client.messages.create(model="m", messages=messages, tools=[tool], max_tokens=48,
                                   tool_choice={"type": "tool", "name": "get_weather"} if choice == "tool"
                                   else {"type": "auto"})
    if choice == "tool":
        assert reply.stop_reason == "tool_use"
        assert [b.name for b in reply.content if b.type == "tool_use"] == ["get_weather"]
