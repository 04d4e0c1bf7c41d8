"""Chat templates: real Hugging Face templates render exactly as transformers renders them.

The templates under tests/data/templates/ are the real ones (see SOURCES.md there);
SmolLM2's is read from the GGUF file itself. The reference for every comparison
is transformers' own renderer, `render_jinja_template`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime
from pathlib import Path

import gguf
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from lucebox.chat.template import FALLBACK_CHATML, ChatTemplate, TemplateError, resolve_chat_template

DATA = Path(__file__).parent / "data" / "templates"
FILES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "gemma3": "google-gemma-3-it.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}
TOKENS = {
    "qwen3": ("", "<|im_end|>"),
    "qwen2.5": ("", "<|im_end|>"),
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": ("<bos>", "<eos>"),
    "mistral-nemo": ("<s>", "</s>"),
    "smollm2": ("<|im_start|>", "<|im_end|>"),
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

# System prompt, tools, an assistant tool call, its result, and a follow-up turn. Mistral wants 9-char call ids.
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
    ]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "21 °C & sunny."},
    {"role": "user", "content": "Thanks <3"},
]
PLAIN_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path: Path) -> str:
    """SmolLM2's real template, straight from the GGUF metadata."""
    return gguf.GGUFReader(smollm2_path).fields["tokenizer.chat_template"].contents()


def source(name: str) -> str:
    return (DATA / FILES[name]).read_text(encoding="utf-8")


def ours(src: str, messages: list[dict], name: str = "test", **kwargs) -> str:
    bos, eos = TOKENS.get(name, ("", ""))
    return ChatTemplate(src, bos_token=bos, eos_token=eos, origin=name).render(messages, **kwargs)


def hf(src: str, messages: list[dict], name: str = "test", *, tools=None, add_generation_prompt=True, **kwargs) -> str:
    """transformers' rendering of the same template, tokens and variables."""
    bos, eos = TOKENS.get(name, ("", ""))
    variables = {"bos_token": bos, "eos_token": eos, **kwargs}
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=src,
                                        add_generation_prompt=add_generation_prompt, **variables)
    return rendered[0]


# ---------------------------------------------------------------------------
# Identical to transformers on real templates


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "llama3.1", "llama3.2", "mistral-nemo"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tool_conversation_matches_transformers(name: str, add_generation_prompt: bool) -> None:
    src = source(name)
    got = ours(src, TOOL_CHAT, name, tools=TOOLS, add_generation_prompt=add_generation_prompt)
    assert got == hf(src, TOOL_CHAT, name, tools=TOOLS, add_generation_prompt=add_generation_prompt)
    assert "get_weather" in got and "Zürich" in got and "Thanks <3" in got  # nothing escaped or dropped


@pytest.mark.parametrize("name", list(FILES))
def test_plain_conversation_matches_transformers(name: str) -> None:
    src = source(name)
    assert ours(src, PLAIN_CHAT, name) == hf(src, PLAIN_CHAT, name)


def test_smollm2_from_gguf_matches_transformers(smollm2_template: str) -> None:
    assert smollm2_template == (DATA / "HuggingFaceTB-SmolLM2-135M-Instruct.jinja").read_text(encoding="utf-8")
    template = resolve_chat_template(gguf_template=smollm2_template, bos_token="<|im_start|>",
                                     eos_token="<|im_end|>")
    assert template.origin == "gguf"
    for chat in (PLAIN_CHAT, TOOL_CHAT):  # with tools, they are injected (tests/test_tool_injection.py)
        assert template.render(chat) == hf(smollm2_template, chat, "smollm2")
    # Its default system prompt appears when the conversation has none.
    got = template.render(PLAIN_CHAT[1:])
    assert got == hf(smollm2_template, PLAIN_CHAT[1:], "smollm2")
    assert got.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_gemma3_refuses_tool_role_like_transformers() -> None:
    """Without tools declared; with them, the tool turns are injected as text (tests/test_tool_injection.py)."""
    src = source("gemma3")
    with pytest.raises(Exception) as ref:
        hf(src, TOOL_CHAT, "gemma3")
    with pytest.raises(TemplateError) as err:
        ours(src, TOOL_CHAT, "gemma3")
    assert str(ref.value) in str(err.value)
    assert "gemma3" in str(err.value)


def test_qwen3_enable_thinking_matches_transformers() -> None:
    src = source("qwen3")
    chat = PLAIN_CHAT
    outputs = {}
    for flag in (None, True, False):
        kwargs = {} if flag is None else {"enable_thinking": flag}
        outputs[flag] = ours(src, chat, "qwen3", **kwargs)
        assert outputs[flag] == hf(src, chat, "qwen3", **kwargs)
    assert outputs[False].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert outputs[True].endswith("<|im_start|>assistant\n")
    assert outputs[None] == outputs[True]  # not passed at all, so `enable_thinking is defined` is false


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_qwen3_reasoning_of_current_turn_matches_transformers(key: str) -> None:
    src = source("qwen3")
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", key: "I should call the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    got = ours(src, chat, "qwen3", tools=TOOLS)
    assert "<think>\nI should call the tool.\n</think>" in got
    # transformers gets arguments already parsed; a JSON string is parsed to the same dict here.
    reference = [dict(m) for m in chat]
    reference[1]["tool_calls"] = [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert got == hf(src, reference, "qwen3", tools=TOOLS)
    assert '"arguments": {"city": "Paris"}' in got


def test_llama31_date_string_kwarg_and_llama32_strftime_now() -> None:
    chat = PLAIN_CHAT
    src31 = source("llama3.1")
    got = ours(src31, chat, "llama3.1", date_string="01 Jan 2030")
    assert "Today Date: 01 Jan 2030\n" in got
    assert got == hf(src31, chat, "llama3.1", date_string="01 Jan 2030")
    assert "Today Date: 26 Jul 2024\n" in ours(src31, chat, "llama3.1")  # the template's own default

    before = datetime.now().strftime("%d %b %Y")
    got = ours(source("llama3.2"), chat, "llama3.2")
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in got or f"Today Date: {after}\n" in got


def test_null_content_beside_tool_calls_renders_as_empty() -> None:
    # OpenAI clients send content null with tool_calls; templates concatenate content as a string.
    src = source("qwen3")
    with_null = [dict(m) for m in TOOL_CHAT]
    with_null[2] = {**TOOL_CHAT[2], "content": None}
    assert ours(src, with_null, "qwen3", tools=TOOLS) == hf(src, TOOL_CHAT, "qwen3", tools=TOOLS)


def test_text_parts_are_joined_unless_the_template_reads_them() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    chat = [{"role": "user", "content": parts}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    src = source("qwen2.5")
    assert ours(src, chat, "qwen2.5") == hf(src, joined, "qwen2.5")
    # Gemma 3 iterates content parts itself: they are passed through unchanged.
    src = source("gemma3")
    got = ours(src, chat, "gemma3")
    assert got == hf(src, chat, "gemma3")
    assert "firstsecond" in got
    with pytest.raises(TemplateError, match="message 0 has a content part of type 'image_url'"):
        ours(source("qwen2.5"), [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_arguments_string_that_is_not_a_json_object_is_kept() -> None:
    chat = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    got = ChatTemplate(FALLBACK_CHATML).render(chat, add_generation_prompt=False)
    assert got.endswith('<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call><|im_end|>\n')


def test_block_whitespace_like_transformers() -> None:
    # trim_blocks + lstrip_blocks, as transformers sets them: block tags leave no blank lines or indents.
    src = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% endif %}\n"
           "{% endfor %}\n")
    assert ours(src, PLAIN_CHAT) == hf(src, PLAIN_CHAT) == "  U: Hi!\n  U: 2+2?\n"


def test_helpers_and_aliases_like_transformers() -> None:
    src = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}"
           "{% continue %}{% endif %}{{ m.role }}:{{ m.thinking }}/{{ m.reasoning_content }};{% endfor %}"
           "{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x']) | tojson }}"
           "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "reasoning": "r"},
            {"role": "assistant", "content": "a", "thinking": "t"}]
    got = ours(src, chat)
    assert got == hf(src, chat) == 'user:r/r;{"a": 1, "b": [2]}{"x": null}3'


def test_generation_block_renders_its_body_like_transformers() -> None:
    src = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
           "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    chat = PLAIN_CHAT[1:3]
    assert ours(src, chat) == hf(src, chat) == "Hi![Hello.]"


def test_variables_seen_by_the_template() -> None:
    src = ("{{ tools is none }}{{ tools[0].function.name if tools }}|{{ enable_thinking is defined }}|"
           "{{ bos_token }}{{ eos_token }}|{{ custom }}|{{ add_generation_prompt }}")
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    assert t.render([]) == "True|False|<s></s>||True"
    assert t.render([], tools=TOOLS, enable_thinking=False, custom="x", add_generation_prompt=False) == \
        "Falseget_weather|True|<s></s>|x|False"
    assert t.render([]) == hf(src, [], bos_token="<s>", eos_token="</s>")


def test_message_content_is_data_not_template_code() -> None:
    got = ours(source("qwen2.5"), [{"role": "user", "content": "{{ 7 * 7 }}{% raw %}"}], "qwen2.5")
    assert "{{ 7 * 7 }}{% raw %}" in got and "49" not in got


# ---------------------------------------------------------------------------
# Helpers: tojson, raise_exception


def test_tojson_keyword_arguments_and_no_html_escaping() -> None:
    value = {"b": "Zürich <tag> & 'q'", "a": [1, 2]}
    cases = {
        "{{ v | tojson }}": json.dumps(value, ensure_ascii=False),
        "{{ v | tojson(indent=2, sort_keys=True) }}": json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True),
        "{{ v | tojson(separators=(',', ':')) }}": json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        "{{ v | tojson(ensure_ascii=True) }}": json.dumps(value, ensure_ascii=True),
    }
    for src, expected in cases.items():
        got = ours(src, [], v=value)
        assert got == expected == hf(src, [], v=value), src
    assert "Zürich <tag> & 'q'" in ours("{{ v | tojson }}", [], v=value)


@pytest.mark.parametrize("name,chat,message", [
    ("mistral-nemo", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."),
    ("gemma3", [{"role": "assistant", "content": "a"}],
     "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("llama3.2", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}},
        {"id": "2", "type": "function", "function": {"name": "f", "arguments": {}}}]}],
     "This model only supports single tool-calls at once!"),
])
def test_raise_exception_surfaces_as_template_error(name: str, chat: list[dict], message: str) -> None:
    with pytest.raises(TemplateError) as err:
        ours(source(name), chat, name)
    assert str(err.value) == f"chat template ({name}) refused the conversation: {message}"


# ---------------------------------------------------------------------------
# Sandbox, syntax and runtime errors


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ (cycler | attr('__init__') | attr('__globals__'))['os'].system('touch CANARY') }}",
    "{{ joiner | attr('__init__') }}",
    "{{ lipsum.__globals__['os'].popen('touch CANARY').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ '{0.__class__.__base__}'.format(messages) }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ self._TemplateReference__context }}",
])
def test_sandbox_escapes_raise_and_never_execute(attack: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    template = ChatTemplate(attack.replace("CANARY", str(canary)), origin="gguf")
    with pytest.raises(TemplateError) as err:
        template.render([{"role": "user", "content": "hi"}])
    message = str(err.value)
    assert message.startswith("chat template (gguf) tried something the sandbox forbids: ")
    assert "\n" not in message
    assert not canary.exists()


@pytest.mark.parametrize("src,line", [
    ("{% for m in messages %}{{ m.content }}", 1),
    ("ok\n{{ messages[0] ", 2),
    ("{% if x %}\n{% endfor %}", 2),
    ("{% generation %}unclosed", 1),
    ("\n\n{{ messages | no_such_filter }}", 3),
])
def test_syntax_errors(src: str, line: int) -> None:
    pattern = rf"^chat template \(tokenizer_config.json\) has a syntax error on line {line}: "
    with pytest.raises(TemplateError, match=pattern):
        ChatTemplate(src, origin="tokenizer_config.json")


@pytest.mark.parametrize("src", [
    "{{ messages[0].content + 1 }}",
    "{{ undefined_function() }}",
    "{{ messages | tojson(bogus=1) }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
])
def test_runtime_errors_name_the_origin(src: str) -> None:
    with pytest.raises(TemplateError) as err:
        ChatTemplate(src, origin="gguf").render([{"role": "user", "content": "hi"}])
    assert str(err.value).startswith("chat template (gguf) failed: ")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_multi_line_messages_become_one_line() -> None:
    with pytest.raises(TemplateError) as err:
        ChatTemplate("{{ raise_exception('first line\\n  second line') }}", origin="gguf").render([])
    assert str(err.value) == "chat template (gguf) refused the conversation: first line second line"


def test_bad_messages() -> None:
    with pytest.raises(TemplateError, match="message 1 is a str, not an object"):
        ChatTemplate(FALLBACK_CHATML).render([{"role": "user", "content": "a"}, "b"])


# ---------------------------------------------------------------------------
# Properties and resolution


def test_properties() -> None:
    qwen3 = ChatTemplate(source("qwen3"), origin="gguf")
    assert qwen3.source == source("qwen3")
    assert qwen3.sha1 == hashlib.sha1(source("qwen3").encode()).hexdigest()
    assert qwen3.origin == "gguf"
    assert qwen3.supports_tools and qwen3.supports_thinking
    qwen25 = ChatTemplate(source("qwen2.5"))
    assert qwen25.supports_tools and not qwen25.supports_thinking
    gemma = ChatTemplate(source("gemma3"))
    assert not gemma.supports_tools and not gemma.supports_thinking
    assert ChatTemplate(FALLBACK_CHATML).supports_tools
    assert qwen3.sha1 != qwen25.sha1


def test_resolution_precedence(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    override = tmp_path / "override.jinja"
    override.write_text("OVERRIDE", encoding="utf-8")
    config = {"chat_template": "CONFIG"}
    everything = {"gguf_template": "GGUF", "tokenizer_config": config}

    t = resolve_chat_template(override_file=override, **everything)
    assert (t.render([]), t.origin) == ("OVERRIDE", f"--chat-template-file {override}")
    t = resolve_chat_template(**everything)
    assert (t.render([]), t.origin) == ("GGUF", "gguf")
    t = resolve_chat_template(gguf_template="", tokenizer_config=config)
    assert (t.render([]), t.origin) == ("CONFIG", "tokenizer_config.json")

    with caplog.at_level(logging.WARNING, logger="lucebox.chat.template"):
        t = resolve_chat_template(tokenizer_config={"bos_token": "<s>"}, eos_token="</s>")
    assert (t.source, t.origin, t.eos_token) == (FALLBACK_CHATML, "fallback ChatML", "</s>")
    assert any("fallback ChatML" in r.getMessage() for r in caplog.records)


def test_missing_or_bad_override_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jinja"
    with pytest.raises(TemplateError, match=f"chat template file {missing} does not exist"):
        resolve_chat_template(override_file=missing, gguf_template="GGUF")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}", encoding="utf-8")
    with pytest.raises(TemplateError, match=rf"^chat template \(--chat-template-file {broken}\) has a syntax error"):
        resolve_chat_template(override_file=broken)


def test_named_templates_in_tokenizer_config() -> None:
    config = {"chat_template": [
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
        {"name": "default", "template": "DEFAULT {{ bos_token }}"},
    ]}
    t = resolve_chat_template(tokenizer_config=config, bos_token="<s>")
    assert t.render([]) == "DEFAULT <s>"
    assert t.render([], tools=TOOLS) == "TOOLS 1"
    assert t.tool_template is not None and t.tool_template.origin == "tokenizer_config.json (tool_use)"

    only_default = resolve_chat_template(tokenizer_config={"chat_template": [{"name": "default", "template": "D"}]})
    assert only_default.tool_template is None and only_default.render([], tools=TOOLS) == "D"

    with pytest.raises(TemplateError, match=r"templates \['rag', 'tool_use'\] but none named 'default'"):
        resolve_chat_template(tokenizer_config={"chat_template": [{"name": "rag", "template": "R"},
                                                                  {"name": "tool_use", "template": "T"}]})
    with pytest.raises(TemplateError, match="entries must be"):
        resolve_chat_template(tokenizer_config={"chat_template": ["just text"]})


# ---------------------------------------------------------------------------
# The fallback


def test_fallback_renders_tools_calls_and_results() -> None:
    chat = [dict(m) for m in TOOL_CHAT]
    chat[2] = {**TOOL_CHAT[2], "content": None, "tool_calls": [
        {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'}},
        {"id": "call67890", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
    ]}
    chat.insert(4, {"role": "tool", "tool_call_id": "call67890", "name": "get_weather", "content": '{"temp_c": 18}'})
    expected = (
        "<|im_start|>system\n"
        "You are terse.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more of these functions. Their signatures are inside <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        "</tools>\n"
        "\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call>\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Bern"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        '{"temp_c": 21}\n'
        "</tool_response>\n"
        "<tool_response>\n"
        '{"temp_c": 18}\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "21 °C & sunny.<|im_end|>\n"
        "<|im_start|>user\n"
        "Thanks <3<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    fallback = resolve_chat_template()
    assert fallback.render(chat, tools=TOOLS) == expected
    assert hf(FALLBACK_CHATML, chat[:2], tools=TOOLS) == fallback.render(chat[:2], tools=TOOLS)


def test_fallback_without_tools_is_plain_chatml() -> None:
    fallback = ChatTemplate(FALLBACK_CHATML)
    assert fallback.render(PLAIN_CHAT) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fallback.render(PLAIN_CHAT[1:2], add_generation_prompt=False) == "<|im_start|>user\nHi!<|im_end|>\n"
    with_text = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]
    assert fallback.render(with_text, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\n")
