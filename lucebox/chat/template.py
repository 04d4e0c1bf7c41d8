"""Chat templates: Hugging Face jinja templates rendered in a sandbox.

A model's chat template turns a conversation (Hugging Face style message dicts)
into the prompt text. Templates come from GGUF files and tokenizer_config.json,
which are untrusted input, so they run in jinja2's `ImmutableSandboxedEnvironment`
with the same settings and helpers as `transformers` (trim_blocks, lstrip_blocks,
loopcontrols, `{% generation %}`, `raise_exception`, `strftime_now`, `tojson`
with HF's keyword arguments, a guarded `namespace` and `dict`). For the same
input, `ChatTemplate.render` gives the same text as transformers'
`apply_chat_template(..., tokenize=False)`, apart from the message clean-up
described in `ChatTemplate.render`.

Every failure, from a syntax error to a sandbox escape attempt, is a one-line
`TemplateError` naming where the template came from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)


class TemplateError(LuceboxError):
    """A chat template is broken, refused the conversation, or broke the sandbox's rules."""


# ---------------------------------------------------------------------------
# The sandbox and the helpers Hugging Face templates call


class _Raised(Exception):
    """Carries the message of a template's own `raise_exception(...)` out of jinja."""


def _raise_exception(message: str) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF's signature. Jinja's own tojson HTML-escapes `<>&'`, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, as transformers' does (no reaching for internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same trick as jinja's Namespace: `self` is taken from args so that `namespace(self=...)` works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"set the underscore name {name!r} on a namespace")


class _DictFactory:
    """The `dict` global: builds dicts, but is not the `dict` type (no `mro()` or other type internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, like transformers', so `set` inside keeps the same scope rules.
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, made strict: touching an unsafe attribute fails at once.

    Jinja by default returns an undefined value for, say, `x|attr('__globals__')`,
    which prints as '' and only fails when used further. Failing at the first
    touch means an escape attempt always surfaces as an error.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _make_environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_DictFactory())
    return env


_ENV = _make_environment()


# ---------------------------------------------------------------------------
# Messages in, prompt out

# A template "iterates content parts" when it looks at a part's type, e.g. Gemma 3's `item['type'] == 'text'`.
_READS_PARTS = re.compile(r"""(\[\s*['"]type['"]\s*\]|\.type)\s*==\s*['"]text['"]""")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """A deep copy made only of JSON types, so the template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"a chat template can only be given JSON data, not {type(value).__name__}")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _join_text_parts(content: list, index: int) -> str:
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"message {index} has a content part of type {kind!r}; this model takes text only")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        if isinstance(parsed, dict):
            return parsed
    return arguments


def _normalise_message(message: Any, index: int, keep_parts: bool) -> dict:
    if not isinstance(message, Mapping):
        raise TemplateError(f"message {index} is a {type(message).__name__}, not an object")
    msg = {k: v for k, v in _plain(message).items() if v is not None}
    content = msg.get("content", "")
    if isinstance(content, list) and not keep_parts:
        content = _join_text_parts(content, index)
    msg["content"] = content
    reasoning = next((msg[k] for k in _REASONING_KEYS if k in msg), None)
    if reasoning is not None:  # templates read `reasoning_content` (gpt-oss reads `thinking`)
        msg.setdefault("thinking", reasoning)
        msg["reasoning_content"] = reasoning
    for call in msg.get("tool_calls") or []:
        if isinstance(call, dict) and isinstance(call.get("function"), dict) and "arguments" in call["function"]:
            call["function"]["arguments"] = _parse_arguments(call["function"]["arguments"])
    return msg


class ChatTemplate:
    """One compiled chat template, with where it came from.

    `tool_template` is an optional second template (tokenizer_config.json's
    "tool_use" entry) that `render` switches to when tools are given, as
    transformers does.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "") -> None:
        self.source = source
        self.origin = origin
        self._where = f"chat template ({origin})" if origin else "chat template"  # how errors name it
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.sha1 = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.tool_template: ChatTemplate | None = None
        self._keep_parts = bool(_READS_PARTS.search(source))
        try:
            self._compiled = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{self._where} has a syntax error on line {e.lineno}: "
                                f"{_one_line(e.message)}") from None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads the `tools` variable at all (else declared tools never reach the model)."""
        return re.search(r"\btools\b", self.source) is not None

    @property
    def supports_thinking(self) -> bool:
        """Whether the template knows about thinking (`enable_thinking` switch or `<think>` blocks)."""
        return "enable_thinking" in self.source or "<think>" in self.source

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **extra: Any) -> str:
        """Render the conversation to prompt text.

        Messages are Hugging Face style dicts. Before rendering, each is cleaned
        up the way OpenAI-style clients need:
        - keys whose value is None are dropped (as transformers does), but a
          missing or null `content` becomes "" (clients send `content: null`
          beside `tool_calls`, and most templates concatenate content);
        - list-of-parts content `[{"type": "text", "text": ...}]` is joined with
          "\\n" into one string, unless the template itself looks at part types
          (Gemma 3 does); a non-text part is refused;
        - `function.arguments` given as a JSON object string is parsed to a dict
          (templates expect a dict; a string that is not a JSON object is kept);
        - reasoning under `reasoning_content`, `thinking` or `reasoning` is
          copied to `reasoning_content` and `thinking`.
        `enable_thinking` is passed only when set, so `enable_thinking is
        defined` checks keep their meaning; `extra` (chat_template_kwargs) is
        passed through as template variables.
        """
        if tools and self.tool_template is not None:
            return self.tool_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, **extra)
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None,
                                     **_plain(extra)}
        variables.update(
            messages=[_normalise_message(m, i, self._keep_parts) for i, m in enumerate(messages)],
            tools=_plain(tools) if tools is not None else None,  # None, not [], as transformers passes it
            add_generation_prompt=add_generation_prompt,
        )
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._compiled.render(variables)
        except _Raised as e:
            raise TemplateError(f"{self._where} refused the conversation: {_one_line(e)}") from None
        except SecurityError as e:
            detail = _one_line(e).rstrip(".")
            raise TemplateError(f"{self._where} tried something the sandbox forbids: {detail}") from None
        except Exception as e:  # noqa: BLE001 - whatever else a broken template raises: one line, no traceback
            raise TemplateError(f"{self._where} failed: {type(e).__name__}: {_one_line(e)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, sha1={self.sha1[:12]})"


# ---------------------------------------------------------------------------
# Where a model's template comes from

# Used when a model has none. Tools go Hermes/Qwen style: JSON signatures in <tools> in the system
# turn, calls as <tool_call> JSON, results as <tool_response> in a user turn.
FALLBACK_CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more of these functions. '
        'Their signatures are inside <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and arguments inside '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
        '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- for call in message.tool_calls or [] %}
            {%- set f = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": ' + f.name | tojson + ', "arguments": ' }}
            {{- f.arguments if f.arguments is string else f.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _pick_named(templates: list, where: str) -> tuple[str, str | None]:
    """tokenizer_config.json may hold [{name, template}, ...]: return the "default" and "tool_use" ones."""
    named = {}
    for entry in templates:
        if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise TemplateError(f"{where}: chat_template list entries must be {{name, template}} objects")
        named[entry["name"]] = entry["template"]
    if "default" not in named:
        raise TemplateError(f"{where}: chat_template has templates {sorted(named)} but none named 'default'")
    return named["default"], named.get("tool_use")


def resolve_chat_template(*, override_file: Path | None = None, gguf_template: str | None = None,
                          tokenizer_config: dict | None = None, bos_token: str = "",
                          eos_token: str = "") -> ChatTemplate:
    """Pick the model's chat template: override file > GGUF `tokenizer.chat_template` >
    tokenizer_config.json `chat_template` > the ChatML fallback (with a warning)."""
    tokens = {"bos_token": bos_token, "eos_token": eos_token}
    if override_file is not None:
        path = Path(override_file)
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TemplateError(f"chat template file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"chat template file {path} cannot be read: {e}") from None
        return ChatTemplate(source, origin=f"--chat-template-file {path}", **tokens)
    if gguf_template:
        return ChatTemplate(gguf_template, origin="gguf", **tokens)
    config_template = (tokenizer_config or {}).get("chat_template")
    if config_template:
        where = "tokenizer_config.json"
        if isinstance(config_template, str):
            return ChatTemplate(config_template, origin=where, **tokens)
        if not isinstance(config_template, list):
            raise TemplateError(f"{where}: chat_template is a {type(config_template).__name__}, not text or a list")
        default, tool_use = _pick_named(config_template, where)
        template = ChatTemplate(default, origin=where, **tokens)
        if tool_use is not None:
            template.tool_template = ChatTemplate(tool_use, origin=f"{where} (tool_use)", **tokens)
        return template
    log.warning("the model has no chat template; using the fallback ChatML template")
    return ChatTemplate(FALLBACK_CHATML, origin="fallback ChatML", **tokens)
