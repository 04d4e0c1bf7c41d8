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

A template is also a program from an untrusted file, so every render is
bounded in time, steps and the size of what it builds (`RenderLimits`; a
runaway render fails inside itself, so no thread is left behind), and a model's
template is probed once at load (`ChatTemplate.probe`). A template that cannot
show tools to the model gets them injected into the messages (`inject_tools`).

Every failure, from a syntax error to a sandbox escape attempt or a runaway
render, is a one-line `TemplateError` naming where the template came from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import string
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

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


# ---------------------------------------------------------------------------
# Bounds: a chat template is a program from an untrusted file
#
# jinja's sandbox stops a template from reaching Python internals, not from
# looping for hours or building a 10 GB string. Every render here runs under a
# `_Budget`: loop iterations, calls, filters, operators and output chunks each
# take a step and check a deadline, so a runaway template fails inside the
# render (the worker thread unwinds, none is left behind); and every operation
# that can make a value much bigger than its inputs (`*`, `**`, `+`, `%`, `~`,
# padding, replace, join, format, indent ...) is sized before it runs.

_MAX_SOURCE_CHARS = 1 << 20  # real templates are a few KB (the largest known ~30 KB)


@dataclass(frozen=True)
class RenderLimits:
    """How much one render may cost; the size and step bounds grow with the conversation."""

    seconds: float = 5.0
    steps: int = 1_000_000  # plus `steps_per_item` per JSON item in the input
    steps_per_item: int = 64
    chars: int = 8 << 20  # any one value and the output; plus `chars_per_input_char` per input character
    chars_per_input_char: int = 4
    allocated_per_char: int = 16  # everything produced over a render, as a multiple of `chars`
    width: int = 1 << 16  # largest padding, indent, batch or slice argument
    int_bits: int = 1 << 16  # largest integer a template may compute


LIMITS = RenderLimits()


class TemplateLimitError(TemplateError):
    """A chat template ran past its time, step or size bounds (a runaway or hostile template)."""


class _Exceeded(Exception):
    """Raised inside a render when it runs past a bound; becomes a TemplateLimitError."""


class _Budget:
    """What is left of one render's bounds."""

    __slots__ = ("limits", "deadline", "steps", "max_chars", "allocated", "max_allocated", "output")

    def __init__(self, limits: RenderLimits, input_chars: int, input_items: int) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.steps = limits.steps + limits.steps_per_item * input_items
        self.max_chars = limits.chars + limits.chars_per_input_char * input_chars
        self.allocated = 0
        self.max_allocated = limits.allocated_per_char * self.max_chars
        self.output = 0

    def tick(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Exceeded("it took more steps (loop iterations, calls, outputs) than the limit allows")
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"it ran longer than {self.limits.seconds:g} s")

    def fits(self, n: int, what: str) -> None:
        """Refuse, before it is built, a value of `n` characters (or items)."""
        if n > self.max_chars:
            raise _Exceeded(f"{what} would build a value of {n} characters or items (limit {self.max_chars})")

    def width(self, value: Any, what: str) -> None:
        if isinstance(value, int) and abs(value) > self.limits.width:
            raise _Exceeded(f"{what} is given {value} (limit {self.limits.width})")

    def produced(self, value: Any) -> Any:
        """Count a value a template operation made; refuse it past the per-value or per-render bound."""
        n = _size(value)
        self.fits(n, "an operation")
        self.allocated += n
        if self.allocated > self.max_allocated:
            raise _Exceeded(f"it built more than {self.max_allocated} characters of values in all")
        return value

    def emit(self, chunk: str) -> None:
        self.tick()
        self.output += len(chunk)
        if self.output > self.max_chars:
            raise _Exceeded(f"its output is longer than {self.max_chars} characters")

    # -- sizing operations before they run ------------------------------------------

    def binop(self, op: str, left: Any, right: Any) -> None:
        if op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                self.fits(len(seq) * max(n, 0), "a repetition (*)")
            elif isinstance(left, int) and isinstance(right, int):
                self._bits(left.bit_length() + right.bit_length(), "a product (*)")
        elif op == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                self._bits(left.bit_length() * right, "a power (**)")
        elif op == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                self.fits(len(left) + len(right), "a sum (+)")
        elif op == "%" and isinstance(left, str):
            self.fits(_percent_size(left, right), "a %-format")

    def _bits(self, bits: int, what: str) -> None:
        if bits > self.limits.int_bits:
            raise _Exceeded(f"{what} would build an integer of {bits} bits (limit {self.limits.int_bits})")

    def str_method(self, s: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple:
        """Size a str/bytes method call; returns the args to call it with (an iterable made a list)."""
        if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
            for a in (*args, *kwargs.values()):
                self.width(a, f"str.{name}")
            if name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                self.fits(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * int(tab), "str.expandtabs")
        elif name == "replace" and len(args) >= 2:
            self.fits(_replace_size(s, args[0], args[1]), "str.replace")
        elif name == "join" and args:
            items = list(args[0])
            self.fits(sum(len(x) for x in items if isinstance(x, (str, bytes))) + len(s) * len(items),
                      "str.join")
            return (items, *args[1:])
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
            self.fits(len(s) * max(longest, 1), "str.translate")
        elif name in ("format", "format_map") and isinstance(s, str):
            values = list(args) + list(kwargs.values())
            if name == "format_map" and args and isinstance(args[0], Mapping):
                values = list(args[0].values())
            self.fits(_format_size(s, values), f"str.{name}")
        return args

    def filter(self, name: str, value: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
        """Size a filter call; returns (value, args) to call it with (an iterable made a list)."""
        if name in ("center", "batch", "slice"):
            for a in (*args, *kwargs.values()):
                self.width(a, f"the {name} filter")
        elif name == "tojson":
            indent = args[1] if len(args) > 1 else kwargs.get("indent")
            if isinstance(indent, str) and len(indent) > 16 or isinstance(indent, int) and indent > 16:
                raise _Exceeded(f"the tojson filter is given indent {indent!r} (limit 16)")
        elif name == "replace" and len(args) >= 2 and isinstance(value, str):
            self.fits(_replace_size(value, args[0], args[1]), "the replace filter")
        elif name == "indent" and isinstance(value, str):
            width = args[0] if args else kwargs.get("width", 4)
            self.width(width, "the indent filter")
            pad = len(width) if isinstance(width, str) else int(width) if isinstance(width, int) else 4
            self.fits(len(value) + (value.count("\n") + 1) * pad, "the indent filter")
        elif name == "wordwrap" and isinstance(value, str):
            wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring")
            self.fits(len(value) * (1 + (len(wrap) if isinstance(wrap, str) else 1)), "the wordwrap filter")
        elif name == "format" and isinstance(value, str):
            self.fits(_percent_size(value, kwargs or args), "the format filter")
        elif name in ("join", "sum") and not isinstance(value, (str, Mapping)):
            value = list(value)
            sep = args[0] if args else kwargs.get("d", "")
            total = sum(len(x) for x in value if isinstance(x, (str, bytes, list, tuple)))
            self.fits(total + (len(sep) * len(value) if isinstance(sep, str) else 0), f"the {name} filter")
        elif isinstance(value, str):  # any other filter with text arguments: bound by their product
            extra = sum(len(a) for a in (*args, *kwargs.values()) if isinstance(a, str))
            if extra:
                self.fits(len(value) + (len(value) + 1) * extra, f"the {name} filter")
        return value, args


_BUDGET: ContextVar[_Budget | None] = ContextVar("lucebox_template_budget", default=None)


def _size(value: Any) -> int:
    """Characters or items in a value, one level into containers (what an operation just allocated)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        children = value.values() if isinstance(value, dict) else value
        return len(value) + sum(len(c) for c in children if isinstance(c, (str, bytes, list, tuple, dict)))
    if isinstance(value, int):
        return value.bit_length() // 8
    return 1


def _measure(value: Any) -> tuple[int, int]:
    """(characters in strings, JSON items) of a render's input: the bounds scale with it."""
    chars = items = 0
    stack = [value]
    while stack:
        v = stack.pop()
        items += 1
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return chars, items


def _replace_size(s: str | bytes, old: Any, new: Any) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return len(s)
    count = len(s) + 1 if not old else s.count(old)
    return len(s) + count * max(len(new) - len(old), 0)


def _longest_text(values: list) -> int:
    """Longest `str()` of the values (each distinct object once): what one format field can print."""
    distinct = {id(v): v for v in values}.values()
    return max((len(v) if isinstance(v, str) else len(str(v)) for v in distinct), default=0)


def _percent_size(fmt: str, args: Any) -> int:
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widest = max((int(d) for d in re.findall(r"\d{1,12}", fmt)), default=0)
    if "*" in fmt:
        widest = max([widest, *(abs(v) for v in values if isinstance(v, int))])
    return len(fmt) + fmt.count("%") * (_longest_text(values) + widest)


def _format_size(fmt: str, values: list) -> int:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)
    widest = max((int(d) for d in re.findall(r"\d{1,12}", fmt)), default=0)
    widest = max([widest, *(abs(v) for v in values if isinstance(v, int))])
    return len(fmt) + sum(1 for f in fields if f[1] is not None) * (_longest_text(values) + widest)


class _Ticking:
    """A for loop's iterable, taking one step per iteration (wrapped around every `{% for %}` at parse time)."""

    __slots__ = ("items",)

    def __init__(self, items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        budget = _BUDGET.get()
        for item in self.items:
            if budget is not None:
                budget.tick()
            yield item


_LOOP_FILTER = "lucebox_loop"  # the filter name the parser wraps around loop iterables


@jinja2.pass_context
def _loop_filter(context: Any, items: Any) -> _Ticking:
    return _Ticking(items)  # pass_context: never folded at compile time


def _bounded_filter(name: str, func: Callable) -> Callable:
    """`func` (a jinja filter) sized before it runs and counted after."""
    passes = _PassArg.from_obj(func)

    @jinja2.pass_context
    def bounded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            value, args = budget.filter(name, value, args, kwargs)
        if passes is _PassArg.context:
            result = func(context, value, *args, **kwargs)
        elif passes is _PassArg.eval_context:
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif passes is _PassArg.environment:
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return budget.produced(result) if budget is not None else result

    bounded.__name__ = getattr(func, "__name__", name)
    return bounded


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    if not all(isinstance(v, int) and 0 <= v <= 100 for v in (n, min, max)):
        raise _Exceeded("lipsum() is given more than 100 paragraphs or words")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with `~` (concatenation) going through the budget."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, made strict: touching an unsafe attribute fails at once.

    Jinja by default returns an undefined value for, say, `x|attr('__globals__')`,
    which prints as '' and only fails when used further. Failing at the first
    touch means an escape attempt always surfaces as an error.
    """

    intercepted_binops = frozenset({"+", "*", "**", "%"})  # also keeps them from being folded at compile time
    code_generator_class = _CodeGenerator

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """Parse, then make every for loop's iterable take a budget step per iteration."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.iter.lineno)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        budget.tick()
        budget.binop(operator, left, right)
        return budget.produced(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Every call a template makes (methods, macros, globals): a step, str methods sized, the result counted."""
        budget = _BUDGET.get()
        if budget is None:
            return super().call(context, obj, *args, **kwargs)
        budget.tick()
        target = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
        owner = getattr(target, "__self__", None)
        if isinstance(owner, (str, bytes)) and isinstance(getattr(target, "__name__", None), str):
            args = budget.str_method(owner, target.__name__, args, kwargs)
        return budget.produced(super().call(context, obj, *args, **kwargs))

    def bounded_concat(self, context: Any, parts: tuple) -> str:
        """`a ~ b ~ ...`, sized before it is joined (the code generator emits calls to this)."""
        budget = _BUDGET.get()
        if context.eval_ctx.autoescape:
            result = markup_join(parts)
        else:
            texts = [str(p) for p in parts]
            if budget is not None:
                budget.fits(sum(map(len, texts)), "a concatenation (~)")
            result = "".join(texts)
        if budget is not None:
            budget.tick()
            budget.produced(result)
        return result


def _make_environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_DictFactory(), lipsum=_lipsum)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_LOOP_FILTER] = _loop_filter
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
        except (ValueError, RecursionError):  # not JSON (or nested past the parser): rendered as the text
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
    transformers does. Every render runs under `limits` (see RenderLimits).
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "",
                 limits: RenderLimits = LIMITS) -> None:
        self.origin = origin
        self._where = f"chat template ({origin})" if origin else "chat template"  # how errors name it
        if not isinstance(source, str):
            raise TemplateError(f"{self._where} is a {type(source).__name__}, not text")
        if len(source) > _MAX_SOURCE_CHARS:
            raise TemplateError(f"{self._where} is {len(source)} characters long (limit {_MAX_SOURCE_CHARS})")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
        self.sha1 = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.tool_template: ChatTemplate | None = None
        self._keep_parts = bool(_READS_PARTS.search(source))
        try:
            self._compiled = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{self._where} has a syntax error on line {e.lineno}: "
                                f"{_one_line(e.message)}") from None
        except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting: one line, no traceback
            raise TemplateError(f"{self._where} cannot be compiled: {type(e).__name__}: {_one_line(e)}") from None

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders declared tools itself, found by rendering a sentinel tool.

        When it does not, `render` describes the tools in a system message
        instead (see `inject_tools`), so they still reach the model.
        """
        if self.tool_template is not None:  # tokenizer_config.json's "tool_use" template is made for them
            return True
        probe = [_normalise_message({"role": "user", "content": "Hello"}, 0, self._keep_parts)]
        try:
            text = self._render(probe, [_PROBE_TOOL], True, None, {})
        except TemplateLimitError:
            raise
        except TemplateError:  # e.g. a template that raises on tools it cannot show
            return False
        return _PROBE_TOOL_NAME in text

    @property
    def supports_thinking(self) -> bool:
        """Whether the template knows about thinking (`enable_thinking` switch or `<think>` blocks)."""
        return "enable_thinking" in self.source or "<think>" in self.source

    def probe(self) -> None:
        """Render sample conversations once, at load: a template that runs past its bounds fails the load
        (not every request), and whether it renders tools is known before the first request."""
        samples = ([{"role": "user", "content": "Hello"}],
                   [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}])
        try:
            for messages in samples:
                try:
                    self.render(messages, add_generation_prompt=True)
                except TemplateLimitError:
                    raise
                except TemplateError:  # templates may refuse a conversation shape (no system role, say)
                    pass
            self.supports_tools  # noqa: B018 - renders the tool probe
            if self.tool_template is not None:
                self.tool_template.probe()
        except TemplateLimitError as e:
            raise TemplateLimitError(f"{e}; refusing to load it (give another with --chat-template-file)") from None

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
        passed through as template variables. Tools given to a template that
        cannot render them are injected into the messages (`inject_tools`).
        A render past the template's limits raises TemplateLimitError.
        """
        if tools and self.tool_template is not None:
            return self.tool_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, **extra)
        normalised = [_normalise_message(m, i, self._keep_parts) for i, m in enumerate(messages)]
        plain_tools = _plain(tools) if tools is not None else None  # None, not [], as transformers passes it
        if plain_tools and not self.supports_tools:
            normalised, plain_tools = inject_tools(normalised, plain_tools), None
        return self._render(normalised, plain_tools, add_generation_prompt, enable_thinking, extra)

    def _render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool,
                enable_thinking: bool | None, extra: dict) -> str:
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None,
                                     **_plain(extra)}
        variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        budget = _Budget(self.limits, *_measure(variables))
        token = _BUDGET.set(budget)
        try:
            out = []
            for chunk in self._compiled.generate(variables):
                budget.emit(chunk)
                out.append(chunk)
            return "".join(out)
        except _Exceeded as e:
            raise TemplateLimitError(f"{self._where} is too costly to render: {e}") from None
        except _Raised as e:
            raise TemplateError(f"{self._where} refused the conversation: {_one_line(e)}") from None
        except SecurityError as e:
            detail = _one_line(e).rstrip(".")
            raise TemplateError(f"{self._where} tried something the sandbox forbids: {detail}") from None
        except Exception as e:  # noqa: BLE001 - whatever else a broken template raises: one line, no traceback
            raise TemplateError(f"{self._where} failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _BUDGET.reset(token)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, sha1={self.sha1[:12]})"


# ---------------------------------------------------------------------------
# Tools for a template that cannot render them
#
# As llama-server does for such templates: the tools go into a system message
# and past calls and results into the messages, in one generic format. It is
# the Hermes one the fallback template also uses (FALLBACK_CHATML), which the
# streaming tool-call parser reads: calls as <tool_call> JSON, results as
# <tool_response> in a user turn.

_PROBE_TOOL_NAME = "lucebox_probe_tool_b7f1"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_TOOL_NAME, "description": "Checks whether the chat template shows tools.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}

TOOLS_SECTION = ("# Tools\n\nYou may call one or more of these functions. "
                 "Their signatures are inside <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
                 "To call a function, reply with a JSON object holding its name and arguments inside "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _text_of(content: Any) -> str:
    if isinstance(content, list):  # parts kept for a template that reads them: text parts only
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def _with_text(content: Any, text: str, sep: str) -> Any:
    """`content` with `text` appended (as a text part when the template reads parts)."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}{sep}{text}" if content else text


def _format_tool_call(name: str, arguments: Any) -> str:
    """One call in the generic format (what the model is told to write)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def inject_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Normalised messages with `tools` described in the system message, assistant tool calls written as
    <tool_call> text, and each run of tool results as one user message of <tool_response> blocks."""
    section = TOOLS_SECTION.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict] = []
    if messages and messages[0].get("role") == "system":
        out.append({**messages[0], "content": _with_text(messages[0].get("content", ""), section, "\n\n")})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": section})
    results: dict | None = None  # the user message collecting the current run of tool results
    for msg in messages:
        if msg.get("role") == "tool":
            block = f"<tool_response>\n{_text_of(msg.get('content', ''))}\n</tool_response>"
            if results is None:
                results = {"role": "user", "content": block}
                out.append(results)
            else:
                results["content"] += "\n" + block
            continue
        results = None
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        if calls:
            msg = {k: v for k, v in msg.items() if k != "tool_calls"}
            for call in calls:
                f = call.get("function", call) if isinstance(call, dict) else {}
                text = _format_tool_call(str(f.get("name", "")), f.get("arguments", {}))
                msg["content"] = _with_text(msg.get("content", ""), text, "\n")
        out.append(msg)
    return out


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
    tokenizer_config.json `chat_template` > the ChatML fallback (with a warning).

    The template is probed once (`ChatTemplate.probe`): one that runs past its
    bounds is refused here, as a load error; one that cannot render tools is
    logged, as its requests with tools get them injected.
    """
    template = _pick_template(override_file, gguf_template, tokenizer_config, bos_token, eos_token)
    template.probe()
    if not template.supports_tools:
        log.info("the %s cannot show tools to the model: requests with tools get them in a system message, "
                 "with calls as <tool_call> JSON", template._where)
    return template


def _pick_template(override_file: Path | None, gguf_template: str | None, tokenizer_config: dict | None,
                   bos_token: str, eos_token: str) -> ChatTemplate:
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
            template.tool_template.supports_tools = True  # made for tools: never inject into it
        return template
    log.warning("the model has no chat template; using the fallback ChatML template")
    return ChatTemplate(FALLBACK_CHATML, origin="fallback ChatML", **tokens)
