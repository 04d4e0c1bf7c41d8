"""What a request's answer is held to: the grammar of its forced tool calls, JSON mode or JSON schema.

Each dialect parses its own fields into the ChatRequest (`tool_choice`; `output_format`, {"type":
"json_object"} or {"type": "json_schema", "schema": ...}); `plan_output` turns them into one Lark grammar
for llguidance (engine/runtime/grammar.py), written in the model's own call format:
- JSON (the generic format the server injects, Qwen3, Hermes):
  `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, the arguments valid for the tool's schema;
- Llama 3 JSON (templates that ask for `"parameters"` and have no `<tool_call>`): `{"name": N, "parameters": {...}}`
  as the whole answer (with tool_choice auto such a model is left free: a bare call has no marker to wait for);
- XML (templates that write `<function=`: Qwen3.5/3.6, Qwen3-Coder):
  `<tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n...</function>\\n</tool_call>`, required
  parameters always present, non-string values valid JSON for their schema;
- Gemma (Gemma 4 `<|tool_call>call:N{k:v,…}<tool_call|>`, FunctionGemma `<start_function_call>…`): keys in sorted
  order as the templates write them, strings between the template's delimiter (`<|"|>`, `<escape>`), numbers and
  booleans bare, nested objects and arrays in the same syntax; the schema's types, enums and required keys held.

Policy:
- tool_choice "required" (Anthropic "any"): one call of a declared tool and nothing else; a named tool: one
  call of it. With a JSON output format as well, the call wins (there is no text). One call, because a small
  model forced to call repeats the call until its token limit, and the call cut there is no call; parallel
  calls come with "auto", where the model opens each one itself.
- "auto" with tools: any text, but each call the model opens is held to the format: a declared tool's name
  and a JSON object of arguments, closed before the answer may end (one call only when the request turns
  parallel calls off); with a JSON output format the answer is a call or that JSON. Not to the tools'
  schemas: llguidance writes an object's keys in the schema's order and offers its optional keys first, and
  a small model steered off its own order (OpenCode's bash tool: `timeout`, `workdir` before the
  `description` it meant to copy) looped inside a string until its token limit, where unconstrained it had
  made the call. A forced call, which must validate, is held to the schema.
- Objects of tool arguments and strict schemas take no keys they do not list (`closed`).
- "none" or no tools: only the output format, if any: JSON, compact or pretty-printed, with bounded
  whitespace between its tokens (`BOUNDED`).
- A thinking model whose turn is open for reasoning (or may open `<think>`) reasons freely up to `</think>`.
A marker that is one special token of the tokenizer is written as that token (`<[id]>`), else as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lucebox.chat.reasoning import ReasoningConfig
from lucebox.chat.toolcalls.schema import is_plain_string, normalize_tools
from lucebox.errors import LuceboxError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class OutputPlan:
    """The grammar a request's answer follows, and why (for /props, the log and error messages)."""

    lark: str
    kind: str  # tool_choice_required | tool_choice_named | tools_auto | json_object | json_schema
    reason: str
    param: str  # the request field a compile error names


GEMMA_WRAPPERS = {"<|tool_call>": ("<tool_call|>", '<|"|>'),
                  "<start_function_call>": ("<end_function_call>", "<escape>")}
"""Gemma call wrappers: open marker -> (close marker, string delimiter): Gemma 4, FunctionGemma."""


def call_format(template_source: str) -> str:
    """"xml" for templates that write `<function=NAME>` calls, "gemma" for Gemma's `call:NAME{…}`, "llama" for
    Llama 3's bare JSON calls (`{"name": N, "parameters": {...}}`), else "json" (`<tool_call>` JSON: the generic
    format, Qwen3, Hermes)."""
    if "<function=" in template_source:
        return "xml"
    if any(f"{marker}call:" in template_source for marker in GEMMA_WRAPPERS):
        return "gemma"
    if '"parameters": ' in template_source and OPEN not in template_source:
        return "llama"
    return "json"


class _Lark:
    """Builds the grammar's rules; literal markers become special tokens where the tokenizer has them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.rules: list[str] = []
        self.n = 0

    def literal(self, text: str) -> str:
        tid = self.tok.token_to_id(text)
        if tid is not None and tid in self.tok.special_ids:
            return f"<[{tid}]>"
        return json.dumps(text, ensure_ascii=False)

    def rule(self, body: str, attrs: str = "") -> str:
        self.n += 1
        name = f"r{self.n}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def lazy_until(self, text: str) -> str:
        """Any text, up to and including the first `text` (a marker): free text, or reasoning."""
        lit = self.literal(text)
        if lit.startswith("<["):  # a special token ends the free text
            return self.rule(f"FREE {lit}")
        return self.rule("/(?s:.*)" + _regex_escape(text) + "/", "[lazy]")

    def build(self, start: str) -> str:
        return "\n".join([f"start: {start}", *_TERMINALS, *self.rules]) + "\n"


_TERMINALS = ("FREE: /(?s:.*)/", "WS: /[ \\t\\r\\n]+/", "NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
              "KEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/")


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust regex syntax: `\\<` would be a word boundary)."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/-" else "\\n" if c == "\n" else c for c in text)


COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Call arguments written as the templates' `tojson` writes them: what the model was shown, and what renders
back identically on the next turn (the prefix cache keeps its hit)."""

BOUNDED = {"whitespace_flexible": True,
           "whitespace_pattern": r"(?:[ \t]{1,2}|[ \t]{0,2}\r?\n(?:\r?\n)?[ \t]{0,32})"}
"""JSON answers (response_format) may be compact or pretty-printed, but each gap between two JSON tokens holds
at most one blank line and 32 columns of indent: with free whitespace a sampled answer can spend its whole
token budget on newlines the grammar allows, and never close its object (llama.cpp's JSON grammars bound
their whitespace the same way)."""


def _json_rule(g: _Lark, schema: Any, layout: dict) -> str:
    """A `%json` rule for `schema`, written with `layout` (llguidance's options; a request's own are replaced)."""
    schema = {**(schema if isinstance(schema, dict) else {}), "x-guidance": layout}
    return g.rule("%json " + json.dumps(schema, ensure_ascii=False))


def unreadable_tools(tools: list[dict] | None, compiles: Any) -> dict[str, str]:
    """Declared tools whose parameter schema does not compile (`compiles(lark) -> error or ""`), with the error:
    their calls are held to the format with any JSON object as arguments, rather than failing the request
    (agents send whatever schemas their tools declare)."""
    out = {}
    for name, params in normalize_tools(tools or []).items():
        error = compiles("start: %json " + json.dumps(_object_schema(params), ensure_ascii=False))
        if error:
            out[name] = error
    return out


def _json_call(g: _Lark, tools: dict[str, dict]) -> str:
    """After the open marker: `\\n{"name": N, "arguments": {...}}\\n</tool_call>` for any of `tools`."""
    alts = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _object_schema(params)},
             "required": ["name", "arguments"], "additionalProperties": False} for name, params in tools.items()]
    body = _json_rule(g, alts[0] if len(alts) == 1 else {"anyOf": alts}, COMPACT)
    return g.rule(f'"\\n" {body} "\\n" {g.literal(CLOSE)}')


def _llama_call(g: _Lark, tools: dict[str, dict]) -> str:
    """A bare `{"name": N, "parameters": {...}}` for any of `tools` (Llama 3's JSON tool calling)."""
    alts = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _object_schema(params)},
             "required": ["name", "parameters"], "additionalProperties": False} for name, params in tools.items()]
    return _json_rule(g, alts[0] if len(alts) == 1 else {"anyOf": alts}, COMPACT)


def _object_schema(params: dict) -> dict:
    """A tool's parameters as an object schema (a declaration without one takes any object), closed."""
    if not params:
        return {"type": "object"}
    return closed(params) if params.get("type") in ("object", None) else {"type": "object"}


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_MAX_DEPTH = 32


def closed(schema: Any, depth: int = 0) -> Any:
    """A copy of `schema` whose objects that list their properties take no others (unless they say so).

    Tool arguments and strict schemas are read this way (as OpenAI's strict mode does): a small model left
    free to add keys invents nested junk until its token limit, and a call cut there is no call."""
    if depth > _MAX_DEPTH or not isinstance(schema, (dict, list)):
        return schema
    if isinstance(schema, list):
        return [closed(x, depth + 1) for x in schema]
    out = {k: closed(v, depth + 1) if k in _NESTED else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed(v, depth + 1) for k, v in out["properties"].items()}
        if not any(k in out for k in _OPEN_KEYS):
            out["additionalProperties"] = False
    for defs in ("$defs", "definitions"):
        if isinstance(out.get(defs), dict):
            out[defs] = {k: closed(v, depth + 1) for k, v in out[defs].items()}
    return out


_NESTED = ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not", "if", "then", "else")


def _xml_call(g: _Lark, tools: dict[str, dict]) -> str:
    """After the open marker: `\\n<function=N>\\n` parameters `</function>\\n</tool_call>` for any of `tools`."""
    alts = []
    for name, params in tools.items():
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = [r for r in params.get("required") or [] if isinstance(r, str)] \
            if isinstance(params.get("required"), list) else []
        names = list(props) + [r for r in required if r not in props]
        if not names:  # no declared parameters (or tool_choice auto): any parameters, raw text each
            any_param = g.rule('"<parameter=" /[^>\\n]+/ ">\\n" ' + g.rule("/(?s:.*)\\n<\\/parameter>\\n/", "[lazy]"))
            fn = json.dumps(f"\n<function={name}>\n", ensure_ascii=False)
            alts.append(g.rule(f'{fn} {any_param}* "</function>\\n" {g.literal(CLOSE)}'))
            continue
        parts = []
        for key in names:
            schema = props.get(key) if isinstance(props.get(key), dict) else {"type": "string"}
            head = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)
            choices = schema.get("enum") if isinstance(schema.get("enum"), list) else \
                [schema["const"]] if "const" in schema else None
            if choices and all(isinstance(c, str) for c in choices):  # written raw, as the templates write strings
                alts_ = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                value = g.rule(f'({alts_}) "\\n</parameter>\\n"')
            elif is_plain_string(schema) and not choices:  # raw text up to the closing tag, within its lengths
                value = g.rule(f"/(?s:.{_length(schema)})\\n<\\/parameter>\\n/", "[lazy]")
            else:
                value = g.rule(f'{_json_rule(g, closed(schema), COMPACT)} "\\n</parameter>\\n"')
            item = g.rule(f"{head} {value}")
            parts.append(item if key in required else f"{item}?")
        fn = json.dumps(f"\n<function={name}>\n", ensure_ascii=False)
        alts.append(g.rule(f'{fn} {" ".join(parts)} "</function>\\n" {g.literal(CLOSE)}'))
    return g.rule(" | ".join(alts))


class _GemmaValues:
    """Lark rules for values in Gemma's call syntax: `<|"|>text<|"|>`, bare numbers and booleans, `{k:v,…}` with
    bare keys in sorted order (the templates' `dictsort`), `[v,…]`. Schemas are untrusted: past `_MAX_DEPTH`, and
    for what this does not read (`$ref`, `not`, …), any value."""

    def __init__(self, g: _Lark, quote: str) -> None:
        self.g, self.quote = g, quote
        self.q = g.literal(quote)
        self._any: str | None = None

    def text(self, schema: dict | None = None) -> str:
        """A delimited string within its lengths (its pattern and format are not held)."""
        length = _length(schema or {})
        if self.q.startswith("<["):  # a special token: the text cannot contain it, so it ends the string
            return self.g.rule(f"{self.q} /(?s:.{length})/ {self.q}")
        return self.g.rule(f"{self.q} " + self.g.rule(f"/(?s:.{length})" + _regex_escape(self.quote) + "/", "[lazy]"))

    def literal(self, value: Any) -> str:
        """A constant as the template's format_argument writes it."""
        if isinstance(value, str):
            return f"{self.q} {json.dumps(value, ensure_ascii=False)} {self.q}"
        if isinstance(value, bool):
            return '"true"' if value else '"false"'
        if isinstance(value, (int, float)):
            return json.dumps(json.dumps(value))
        return self.any()

    def any(self) -> str:
        """Any value (recursive)."""
        if self._any is None:
            self._any = name = f"r{self.g.n + 1}"
            self.g.n += 1
            member = f'KEY ":" {name}'
            self.g.rules.append(f'{name}: {self.text()} | NUMBER | "true" | "false" | "[" ({name} ("," {name})*)? "]"'
                                f' | "{{" ({member} ("," {member})*)? "}}"')
        return self._any

    def value(self, schema: Any, depth: int = 0) -> str:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return self.any()
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else \
            [schema["const"]] if "const" in schema else None
        if choices:
            return self.g.rule(" | ".join(self.literal(c) for c in choices))
        alts = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(alts, list) and alts:
            return self.g.rule(" | ".join(self.value(a, depth + 1) for a in alts))
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return self.g.rule(" | ".join(self.value({**schema, "type": k}, depth + 1) for k in kind))
        if kind == "string":
            return self.text(schema)
        if kind in ("integer", "number", "boolean"):  # written bare, as JSON writes them: JSON's rule holds ranges
            return _json_rule(g=self.g, schema={k: v for k, v in schema.items() if k not in ("description", "title")},
                              layout=COMPACT)
        if kind == "array":
            item = self.value(schema.get("items"), depth + 1)
            lo, hi = _bounds(schema, "minItems", "maxItems")
            if hi == 0:
                return self.g.rule('"[" "]"')
            more = f'("," {item}){{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}'
            return self.g.rule(f'"[" {item} {more} "]"' if lo else f'"[" ({item} {more})? "]"')
        if kind == "object" or "properties" in schema:
            return self.members(schema, depth)
        return self.any()

    def members(self, schema: dict, depth: int = 0) -> str:
        """`{k:v,…}`: the declared keys in sorted order, the required ones always there; an object that declares
        none takes any members."""
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not props:
            member = f'KEY ":" {self.any()}'
            return self.g.rule(f'"{{" ({member} ("," {member})*)? "}}"')
        required = set(r for r in schema.get("required") or [] if isinstance(r, str)) \
            if isinstance(schema.get("required"), list) else set()
        # after(i, first): the members from key i on, `first` when none has been written yet (no comma before).
        rest_first, rest_more = '""', '""'
        for key in sorted(props, reverse=True):
            item = f'{json.dumps(key + ":", ensure_ascii=False)} {self.value(props[key], depth + 1)}'
            more = self.g.rule(f'"," {item} {rest_more}' + ("" if key in required else f" | {rest_more}"))
            first = self.g.rule(f"{item} {rest_more}" + ("" if key in required else f" | {rest_first}"))
            rest_first, rest_more = first, more
        return self.g.rule(f'"{{" {rest_first} "}}"')


def _gemma_call(g: _Lark, tools: dict[str, dict], quote: str, close: str) -> str:
    """After the open marker: `call:N{k:v,…}` and the close marker, for any of `tools`."""
    values = _GemmaValues(g, quote)
    alts = [g.rule(f'{json.dumps("call:" + name, ensure_ascii=False)} {values.members(_object_schema(params))}')
            for name, params in tools.items()]
    return g.rule(f"({' | '.join(alts)}) {g.literal(close)}")


def _bounds(schema: dict, low: str, high: str) -> tuple[int, int | None]:
    """A schema's (minLength, maxLength)-like pair, sane or left out (untrusted: at most 100,000)."""
    lo, hi = schema.get(low), schema.get(high)
    lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and 0 <= lo <= 100_000 else 0
    hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and lo <= hi <= 100_000 else None
    return lo, hi


def _length(schema: dict) -> str:
    """A string schema's minLength / maxLength as a regex repetition (`*` when it sets none)."""
    lo, hi = _bounds(schema, "minLength", "maxLength")
    return "*" if not lo and hi is None else f"{{{lo},{'' if hi is None else hi}}}"


def plan_output(tokenizer: Any, template_source: str, tools: list[dict] | None, tool_choice: Any,
                output_format: dict | None, reasoning: ReasoningConfig | None,
                parallel: bool = True, loose: frozenset[str] = frozenset()) -> OutputPlan | None:
    """The grammar this request's answer must follow, or None when it is free (`parallel`: with tool_choice
    auto, several calls may follow each other; `loose`: tools whose arguments are any object, see
    `unreadable_tools`). LuceboxError for a tool declaration that cannot be read."""
    declared = normalize_tools(tools) if tools and tool_choice != "none" else {}
    declared = {name: {} if name in loose else params for name, params in declared.items()}
    forced: str | None = None  # a tool name, "required", or None
    if declared and tool_choice not in ("auto", None):
        forced = tool_choice["name"] if isinstance(tool_choice, dict) else "required"
        if forced != "required" and forced not in declared:
            raise LuceboxError(f"tool_choice names {forced!r}, which is not among the declared tools")
    if not declared and output_format is None:
        return None
    g = _Lark(tokenizer)
    fmt = call_format(template_source)
    body: str
    if declared:
        chosen = {forced: declared[forced]} if forced not in (None, "required") else declared
        if forced is None:  # auto: a well-formed call of a declared tool, its arguments the model's own object
            chosen = {name: {} for name in chosen}
        if fmt == "llama":  # no marker: a call is the whole answer (auto: the model is free, the parser reads it)
            call = _llama_call(g, chosen)
            if forced is None and output_format is None:
                return None
            body = call if forced is not None else g.rule(f"{call} | {_format_rule(g, output_format)}")
        else:
            opener, rest = _call_rule(g, fmt, template_source, chosen)  # a call's open marker, and the rest of it
            if forced is None and output_format is None:  # auto: free text; each opened call follows the format
                body = g.rule(f"({g.lazy_until(opener)} {rest}){'*' if parallel else '?'} FREE")
            else:  # a forced answer is one call (see the module docstring), or a call or the JSON format
                call = g.rule(f"{g.literal(opener)} {rest}")
                body = call if forced is not None else g.rule(f"{call} | {_format_rule(g, output_format)}")
    else:
        body = _format_rule(g, output_format)
    start = body
    if reasoning is not None and reasoning.enabled:  # free reasoning first, up to its end marker
        think = g.lazy_until(reasoning.close_tag)
        start = (f"{think} WS? {body}" if reasoning.start_in_reasoning
                 else f"({g.literal(reasoning.open_tag)} {think} WS?)? {body}")
    kind, reason, param = _why(forced, bool(declared), output_format)
    return OutputPlan(g.build(start), kind, reason, param)


def _call_rule(g: _Lark, fmt: str, template_source: str, tools: dict[str, dict]) -> tuple[str, str]:
    """(the open marker of a call in format `fmt`, the rule for the rest of the call)."""
    if fmt == "gemma":
        opener = next(m for m in GEMMA_WRAPPERS if f"{m}call:" in template_source)
        close, quote = GEMMA_WRAPPERS[opener]
        return opener, _gemma_call(g, tools, quote, close)
    return OPEN, (_xml_call if fmt == "xml" else _json_call)(g, tools)


def _format_rule(g: _Lark, output_format: dict) -> str:
    if output_format.get("type") == "json_schema":
        schema = output_format.get("schema") or {}
        return _json_rule(g, closed(schema) if output_format.get("strict") else schema, BOUNDED)
    return _json_rule(g, {"type": "object"}, BOUNDED)


def _why(forced: str | None, tools: bool, output_format: dict | None) -> tuple[str, str, str]:
    """(kind, reason, the request field a compile error names); kind labels /metrics and /props."""
    fmt = output_format.get("type") if output_format else None
    fmt_param = output_format.get("param", "response_format") if output_format else "tools"
    if forced == "required":
        return "tool_choice_required", "tool_choice required: one call of a declared tool", "tools"
    if forced is not None:
        return "tool_choice_named", f"tool_choice {forced}: one call of it", "tools"
    if tools:
        return ("tools_auto", "tools: text, or well-formed calls of the declared tools"
                + (f", else {fmt}" if fmt else ""), fmt_param if fmt else "tools")
    return fmt or "json_object", f"{fmt}: the answer is JSON" + (" valid for the schema" if fmt == "json_schema"
                                                                  else " (an object)"), fmt_param
