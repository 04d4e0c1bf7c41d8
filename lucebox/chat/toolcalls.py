"""Tool calls recognised in the model's streamed answer text.

Recognised forms (API.md, "Tools"):

1. Qwen3 / coder XML, with or without the `<tool_call>` wrapper::

       <tool_call>
       <function=get_weather>
       <parameter=city>
       Paris
       </parameter>
       </function>
       </tool_call>

2. Hermes JSON: `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`
   (`"parameters"` is accepted for `"arguments"`, and arguments given as a JSON string are decoded).
3. A bare JSON call object, or a JSON list of them, when the answer starts with it.
4. `<tool_code>…</tool_code>` and Markdown fences "```tool_code … ```" (Google's
   Gemma function-calling guide has the model wrap calls in these), holding a
   JSON call, a Gemma call, or Python-style calls `get_weather(city="Paris")`
   (one per line, or a list).
5. Gemma's `call:get_weather{city:<escape>Paris<escape>}`, bare or wrapped in
   FunctionGemma's `<start_function_call>` … `<end_function_call>`, and Gemma 4's
   `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>`.
6. Gemma 3's documented prompt format `[get_weather(city="Paris"), …]` when the
   answer starts with it (only when it begins with `[` + a declared tool + `(`).

Parameter values of the XML, Gemma and Python forms are converted with the
tool's JSON schema (`convert_param`); the JSON forms keep the model's JSON as
written. The markers must reach this parser as text: the detokenizer must not
drop them as special tokens.

Streaming rules:

- Text that might be the start of a marker is held back until it is decided.
- A call *commits* (ToolCallStart) as soon as its name is known and the tool is
  declared. Anything that fails before that — an undeclared tool, text that is
  not a call after all — is released as TextDelta of exactly the original text.
- Arguments stream as they arrive: the XML and Gemma forms emit one piece per
  finished parameter (`{"city": "Paris"`, `, "days": 3`, `}`), and string
  parameters of the XML form stream their text while it is written; the JSON
  forms stream the model's own arguments text, checked by an incremental JSON
  validator and cut only where the text so far can still be closed. (Python
  calls, and JSON calls whose arguments come before the name, are emitted
  whole once read.)
- A committed call that breaks later (bad JSON, output ends inside it) cannot be
  taken back: it is closed with the shortest text that makes its arguments valid
  JSON (`"`, `}`, `]`), and the raw text that the arguments do not hold goes
  back into the text stream. So every ToolCallStart gets a ToolCallEnd whose
  arguments are valid JSON and equal the concatenated ArgsDelta pieces, and no
  output text is lost.
- Whitespace between text and a call, between calls and after the last call is
  dropped (a lone "\\n" text block confuses clients).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from lucebox.chat.events import (
    Event,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
    new_call_id,
)
from lucebox.errors import LuceboxError

_WS = " \t\r\n"
_MAX_NAME = 256  # longest function/parameter name we wait for before deciding it is not one
_MAX_BUFFERED = 1 << 20  # a body we must see whole before deciding (Python-style calls)


class _Fail(Exception):
    """Internal signal: the text under the reader is not (or no longer) a well-formed call."""


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


class _Tags:
    """A set of tags, to find how much of a text's end could still grow into one of them."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self.longest = max(len(t) for t in tags)
        self.firsts = tuple({t[0] for t in tags})

    def partial_suffix(self, text: str, ok: Any = None) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a tag.

        `ok(tag, start)` may veto a candidate. This runs on every piece, so the
        candidates (a tag's first character near the end) are found with str.find.
        """
        start = max(0, len(text) - self.longest + 1)
        cands = []
        for c in self.firsts:
            j = text.find(c, start)
            while j >= 0:
                cands.append(j)
                j = text.find(c, j + 1)
        for j in sorted(cands):
            tail = text[j:]
            for t in self.tags:
                if len(t) > len(tail) and t.startswith(tail) and (ok is None or ok(t, j)):
                    return len(text) - j
        return 0


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _loads(text: str) -> Any:
    """json.loads for text the validator passed; anything it still rejects is not a call."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _Fail from e


# --------------------------------------------------------------------------- schemas


def normalize_tools(tools: list[dict]) -> dict[str, dict]:
    """Map tool name -> JSON schema of its parameters.

    Accepts `{"name", "description", "parameters"}` and the OpenAI wrapper
    `{"type": "function", "function": {...}}`.
    """
    out: dict[str, dict] = {}
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LuceboxError(f"tools[{n}] must be an object")
        if isinstance(tool.get("function"), dict):
            tool = tool["function"]
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise LuceboxError(f"tools[{n}] has no name")
        params = tool.get("parameters")
        out[name] = params if isinstance(params, dict) else {}
    return out


_SCHEMA_DEPTH = 32
"""anyOf/oneOf nesting followed when reading a schema's types; deeper alternatives count as unknown."""


def _schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a schema admits (type, type lists, anyOf/oneOf, enum); empty if unknown.

    The schema is the client's JSON, any shape: members of the wrong type are ignored, never an error.
    """
    if not isinstance(schema, dict) or depth > _SCHEMA_DEPTH:
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            types |= _schema_types(sub, depth + 1)
    if not types and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            types.add("string" if isinstance(v, str) else "boolean" if isinstance(v, bool)
                      else "integer" if isinstance(v, int) else "number" if isinstance(v, float)
                      else "null" if v is None else "object")
    return types


def _param_schema(params: dict, key: str) -> dict | None:
    props = params.get("properties")
    if isinstance(props, dict) and isinstance(props.get(key), dict):
        return props[key]
    return None


def _is_plain_string(schema: dict | None) -> bool:
    return _schema_types(schema) == {"string"}


def _best_effort(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past what the parser follows: keep the text
        return raw


def convert_param(raw: str, schema: dict | None) -> Any:
    """Turn a parameter's raw text into a JSON value the tool's schema expects.

    A string parameter keeps the raw text; integer, number, boolean and null are
    parsed; object/array are parsed as JSON (Python literals accepted); a value
    that does not fit, or a parameter the schema does not declare, is parsed as
    JSON when it is JSON and kept as text otherwise.
    """
    types = _schema_types(schema)
    if not types:
        return _best_effort(raw)
    s = raw.strip()
    if "null" in types and s in ("null", "None"):
        return None
    if "string" in types:
        return raw
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types and re.fullmatch(r"[+-]?\d+", s):
        return int(s)
    if "number" in types or "integer" in types:
        try:
            v = float(s)
        except ValueError:
            v = None
        if v is not None and math.isfinite(v):
            return int(v) if v.is_integer() and re.fullmatch(r"[+-]?\d+(\.0*)?", s) else v
    if "object" in types or "array" in types:
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(v, (dict, list)):
                return v
    return _best_effort(raw)


# --------------------------------------------------------------------------- JSON validation

_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUM_RUN = re.compile(r"[0-9eE+\-.]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _JsonScan:
    """Incremental syntax check of one JSON value.

    `feed` consumes text until the value is complete (`done`) or invalid
    (`error`). `safe` is the length of the longest prefix fed so far that
    `safe_closer` turns into valid JSON: inside a string value, right after an
    opening bracket, or right after a complete element. Cutting only there is
    what lets a streamed prefix always be closed.
    """

    def __init__(self) -> None:
        self.n = 0
        self.done = False
        self.error = False
        self.safe = 0
        self.safe_closer = ""
        self._stack: list[str] = []
        self._closer = ""  # closing brackets of the open containers, innermost first
        self._expect = "value"  # value | first_value | first_key | key | colon | after
        self._str: str | None = None  # "key" or "value" while inside a string
        self._esc = 0  # -1 right after a backslash, 1..4 hex digits still due in \\uXXXX
        self._tok = ""  # number or literal being read

    def feed(self, text: str) -> int:
        """Consume from `text`; return how many characters were used."""
        i, n = 0, len(text)
        while i < n and not self.done and not self.error:
            if self._str is not None:
                i = self._string(text, i)
            elif self._tok:
                i = self._token(text, i)
            else:
                i = self._structure(text, i)
        self.n += i
        return i

    def _mark(self, i: int) -> None:
        self.safe = self.n + i
        self.safe_closer = ('"' if self._str == "value" else "") + self._closer

    def _value_done(self, i: int) -> None:
        if self._stack:
            self._expect = "after"
        else:
            self.done = True
        self._mark(i)

    def _string(self, text: str, i: int) -> int:
        if self._esc:
            c = text[i]
            if self._esc == -1:
                self._esc = 4 if c == "u" else 0
                if c != "u" and c not in '"\\/bfnrt':
                    self.error = True
                    return i
            elif c in _HEX:
                self._esc -= 1
            else:
                self.error = True
                return i
            if not self._esc and self._str == "value":
                self._mark(i + 1)
            return i + 1
        m = _STR_RUN.match(text, i)
        if m:
            if self._str == "value":
                self._mark(m.end())
            return m.end()
        c = text[i]
        if c == "\\":
            self._esc = -1
        elif c == '"':
            kind, self._str = self._str, None
            if kind == "key":
                self._expect = "colon"
            else:
                self._value_done(i + 1)
        else:  # a raw control character
            self.error = True
            return i
        return i + 1

    def _token(self, text: str, i: int) -> int:
        word = _LITERALS.get(self._tok[0])
        if word is not None:
            cand = self._tok + text[i]
            if not word.startswith(cand):
                self.error = True
                return i
            self._tok = cand
            if cand == word:
                self._tok = ""
                self._value_done(i + 1)
            return i + 1
        m = _NUM_RUN.match(text, i)
        if m:
            self._tok += m.group()
            i = m.end()
            if i == len(text):
                return i  # the number may go on
        if not _NUMBER.fullmatch(self._tok):
            self.error = True
            return i
        self._tok = ""
        self._value_done(i)
        return i

    def _structure(self, text: str, i: int) -> int:
        c = text[i]
        if c in _WS:
            return i + 1
        expect = self._expect
        if expect in ("value", "first_value"):
            if c == "]" and expect == "first_value":
                return self._pop(i)
            if c in "{[":
                self._stack.append(c)
                self._closer = ("}" if c == "{" else "]") + self._closer
                self._expect = "first_key" if c == "{" else "first_value"
                self._mark(i + 1)
            elif c == '"':
                self._str = "value"
                self._mark(i + 1)
            elif c == "-" or (c.isdigit() and c.isascii()) or c in _LITERALS:
                self._tok = c
            else:
                self.error = True
                return i
            return i + 1
        if expect in ("first_key", "key"):
            if c == "}" and expect == "first_key":
                return self._pop(i)
            if c != '"':
                self.error = True
                return i
            self._str = "key"
            return i + 1
        if expect == "colon":
            if c != ":":
                self.error = True
                return i
            self._expect = "value"
            return i + 1
        # after a value inside a container
        if c == ",":
            self._expect = "key" if self._stack[-1] == "{" else "value"
            return i + 1
        if c == self._closer[0]:
            return self._pop(i)
        self.error = True
        return i

    def _pop(self, i: int) -> int:
        self._stack.pop()
        self._closer = self._closer[1:]
        self._value_done(i + 1)
        return i + 1


# --------------------------------------------------------------------------- readers

_AGAIN = object()  # a reader state changed: run the next state at once


class _Reader:
    """Reads one marked region (a call or a wrapper holding calls) from `raw`.

    `raw` is everything after `marker`; the parser appends new text to it.
    `step(final)` returns None (need more text), ("become", reader) or
    ("done", rest), where `rest` is the text after the region, which goes back
    to the text scanner; or it raises _Fail, which `fail()` turns into
    ("rescan", None) when nothing was committed (the marker is text after all)
    or ("rest", text the committed calls do not hold).
    """

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int = 0, close: str | None = None) -> None:
        self.p = parser
        self.marker = marker
        self.raw = raw
        self.i = i
        self.close = close
        self.emitted_any = False  # a call of this region was committed: no way back to plain text
        self.represented = 0      # raw[:represented] is held by committed calls
        self.call: tuple[int, str, str] | None = None  # open call: (index, call_id, name)
        self.args: list[str] = []  # pieces of arguments text emitted so far for the open call
        self.args_len = 0
        self.state = "start"

    def step(self, final: bool) -> tuple[str, Any] | None:
        while True:
            r = getattr(self, "_" + self.state)(final)
            if r is not _AGAIN:
                return r

    def need(self, final: bool) -> None:
        """Called when the reader waits for more text: at the end of output that is a failure."""
        if final:
            raise _Fail

    # -- call bookkeeping shared by all forms --

    def start_call(self, name: str) -> None:
        self.call = self.p._begin_call(name)
        self.args, self.args_len = [], 0
        self.emitted_any = True

    def emit_args(self, text: str) -> None:
        if text:
            self.args.append(text)
            self.args_len += len(text)
            self.p._out.append(ToolCallArgsDelta(self.call[0], text))

    def end_call(self) -> None:
        index, call_id, name = self.call
        self.p._out.append(ToolCallEnd(index, call_id, name, "".join(self.args)))
        self.call = None
        self.represented = self.i

    def repair(self) -> tuple[str, int]:
        """For a committed call that broke: (text that closes its arguments, raw index it represents)."""
        return ("}" if self.args_len else "{}"), self.i

    def fail(self) -> tuple[str, Any]:
        if self.call is not None:
            closer, represented = self.repair()
            self.emit_args(closer)
            self.end_call()
            self.represented = represented
        if self.emitted_any:
            return "rest", self.raw[self.represented:]
        return "rescan", None

    def closing(self, final: bool) -> tuple[str, Any] | None:
        """After the last call of the region: consume the closing tag when it is there (lenient if not)."""
        if self.close is None:
            return "done", self.raw[self.i:]
        j = _skip_ws(self.raw, self.i)
        if self.raw.startswith(self.close, j):
            return "done", self.raw[j + len(self.close):]
        if not final and self.close.startswith(self.raw[j:]):
            return None
        return "done", self.raw[self.i:]


class _Wrapper(_Reader):
    """`<tool_call>`, `<tool_code>`, a ```tool_code fence or `<start_function_call>`: pick the body's form."""

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, close: str, forms: tuple[str, ...]) -> None:
        super().__init__(parser, marker, raw, 0, close)
        self.forms = forms

    def _start(self, final: bool) -> tuple[str, Any] | None:
        j = _skip_ws(self.raw, 0)
        tail = self.raw[j:]
        p, close = self.p, self.close
        if "xml" in self.forms and tail.startswith("<function="):
            return "become", _XmlCall(p, self.marker, self.raw, j + len("<function="), close)
        if "gemma" in self.forms and tail.startswith("call:"):
            return "become", _GemmaCall(p, self.marker, self.raw, j + len("call:"), close)
        first = tail[:1]
        if first == "[":  # a JSON list of calls, or a Python list `[f(a=1), g()]`
            k = _skip_ws(tail, 1)
            if k == len(tail):
                self.need(final)
                return None
            first = "{" if tail[k] == "{" else "p"
        if "json" in self.forms and first == "{":
            return "become", _JsonCall(p, self.marker, self.raw, j, close)
        if not final and (not tail or any(pre.startswith(tail) for pre in ("<function=", "call:"))):
            return None
        if "python" in self.forms and tail and (first == "p" or first.isalpha() or first == "_"):
            return "become", _PythonCalls(p, self.marker, self.raw, j, close)
        raise _Fail


class _XmlCall(_Reader):
    """`NAME>` then `<parameter=KEY>VALUE</parameter>`… `</function>` (raw starts after `<function=`)."""

    _TERMS = ("</parameter>", "<parameter=", "</function>")

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.state = "name"
        self.terms = self._TERMS + ((close,) if close else ())
        self.term_tags = _Tags(self.terms)
        self.nparams = 0
        self.streamed: int | None = None  # raw index up to which a string value has been streamed

    def _read_name(self, at: int, final: bool) -> tuple[str, int] | None:
        """`NAME>` at raw[at]: (name, index after `>`), None to wait; _Fail if it is no name."""
        j = self.raw.find(">", at)
        if j < 0:
            tail = self.raw[at:]
            if len(tail) > _MAX_NAME or "\n" in tail or "<" in tail:
                raise _Fail
            self.need(final)
            return None
        name = self.raw[at:j].strip()
        if not name or "\n" in name or "<" in name:
            raise _Fail
        return name, j + 1

    def _name(self, final: bool) -> Any:
        got = self._read_name(self.i, final)
        if got is None:
            return None
        name, self.i = got
        if name not in self.p._tools:
            raise _Fail
        self.start_call(name)
        self.nparams = 0
        self.state = "params"
        return _AGAIN

    def _params(self, final: bool) -> Any:
        raw = self.raw
        self.i = i = _skip_ws(raw, self.i)
        if raw.startswith("<parameter=", i):
            got = self._read_name(i + len("<parameter="), final)
            if got is None:
                return None
            self.key, self.i = got
            self.param_start = i
            self.schema = _param_schema(self.p._tools[self.call[2]], self.key)
            self.vstart = self.scan_from = self.i
            self.streamed = None
            if _is_plain_string(self.schema):
                self.emit_args(self._member_prefix() + '"')
                self.streamed = self.vstart
            self.state = "value"
            return _AGAIN
        if raw.startswith("</function>", i):
            self.i = i + len("</function>")
            self._finish_call()
            self.state = "after"
            return _AGAIN
        if self.close and raw.startswith(self.close, i):  # `</function>` missing: the wrapper ends the call
            self.i = i + len(self.close)
            self._finish_call()
            return "done", raw[self.i:]
        tail = raw[i:]
        if not final and any(t.startswith(tail) for t in ("<parameter=", "</function>", self.close or "")):
            return None
        raise _Fail

    def _value(self, final: bool) -> Any:
        raw = self.raw
        k, term = -1, ""
        for t in self.terms:
            j = raw.find(t, self.scan_from)
            if j >= 0 and (k < 0 or j < k):
                k, term = j, t
        if k < 0:
            self.need(final)
            self.scan_from = max(self.vstart, len(raw) - self.term_tags.longest + 1)
            if self.streamed is not None:
                self._stream(len(raw) - self.term_tags.partial_suffix(raw), hold_newline=True)
            return None
        start = self.vstart + 1 if raw.startswith("\n", self.vstart) else self.vstart
        end = k - 1 if k - 1 >= start and raw[k - 1] == "\n" else k
        if self.streamed is not None:
            self._stream(end, hold_newline=False)
            self.emit_args('"')
        else:
            value = convert_param(raw[start:end], self.schema)
            self.emit_args(self._member_prefix() + _dumps(value))
        self.nparams += 1
        self.streamed = None
        self.i = k + len(term) if term == "</parameter>" else k
        self.state = "params"
        return _AGAIN

    def _stream(self, upto: int, hold_newline: bool) -> None:
        """Emit the string value's text up to `upto` (JSON-escaped, so pieces concatenate).

        The newline right after `<parameter=K>` is not part of the value; one right
        before `</parameter>` is not either, so a trailing newline waits.
        """
        raw = self.raw
        if self.streamed == self.vstart:
            if len(raw) == self.vstart:
                return
            if raw[self.vstart] == "\n":
                self.streamed += 1
        if hold_newline and upto > self.streamed and raw[upto - 1] == "\n":
            upto -= 1
        if upto > self.streamed:
            self.emit_args(_dumps(raw[self.streamed:upto])[1:-1])
            self.streamed = upto

    def _after(self, final: bool) -> Any:
        if self.close is None:
            return "done", self.raw[self.i:]
        j = _skip_ws(self.raw, self.i)
        if self.raw.startswith("<function=", j):  # several functions in one wrapper
            self.i = j + len("<function=")
            self.state = "name"
            return _AGAIN
        if not final and "<function=".startswith(self.raw[j:]):
            return None
        return self.closing(final)

    def _member_prefix(self) -> str:
        return ("{" if self.nparams == 0 else ", ") + _dumps(self.key) + ": "

    def _finish_call(self) -> None:
        self.emit_args("}" if self.nparams else "{}")
        self.end_call()

    def repair(self) -> tuple[str, int]:
        if self.state == "value" and self.streamed is not None:
            return '"}', self.streamed
        at = self.param_start if self.state == "value" else self.i
        return ("}" if self.nparams else "{}"), at


class _JsonCall(_Reader):
    """`{"name": …, "arguments": {…}}` or a list of them; raw[i] is the `{` or `[`.

    With `opened`, the marker itself was the opening bracket (a bare call at the
    start of the answer) and raw starts after it.
    """

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None,
                 opened: str | None = None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.in_list = opened == "["
        self.state = {"{": "member", "[": "elem"}.get(opened or "", "open")
        self.scan: _JsonScan | None = None
        self._new_object()

    def _new_object(self) -> None:
        self.name: str | None = None
        self.key = ""
        self.args_seen = False
        self.args_text: str | None = None  # arguments read before the name was known
        self.args_start = -1
        self.streaming = False

    def _char(self, final: bool) -> str | None:
        self.i = _skip_ws(self.raw, self.i)
        if self.i < len(self.raw):
            return self.raw[self.i]
        self.need(final)
        return None

    def _scan_value(self, final: bool) -> str | None:
        """Continue reading the JSON value at `self.vstart`; its raw text once complete."""
        if self.scan is None:
            self.scan, self.vstart, self.fed = _JsonScan(), self.i, self.i
        self.fed += self.scan.feed(self.raw[self.fed:])
        if self.scan.error:
            raise _Fail
        if not self.scan.done:
            self.need(final)
            return None
        self.scan = None
        self.i = self.fed
        return self.raw[self.vstart:self.fed]

    def _open(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        self.i += 1
        if c == "[" and not self.in_list:
            self.in_list = True
            self.state = "elem"
        elif c == "{":
            self.state = "member"
        else:
            raise _Fail
        return _AGAIN

    def _elem(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != "{":
            raise _Fail
        self.i += 1
        self._new_object()
        self.state = "member"
        return _AGAIN

    def _member(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != '"':
            raise _Fail
        self.state = "key"
        return _AGAIN

    def _key(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        self.key = _loads(text)
        if self.call is None and self.key not in ("name", "arguments", "parameters"):
            raise _Fail  # not a call object (or not one we can read)
        self.state = "colon"
        return _AGAIN

    def _colon(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c != ":":
            raise _Fail
        self.i += 1
        self.state = "value"
        return _AGAIN

    def _value(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if self.key == "name" and self.name is None:
            if c != '"':
                raise _Fail
            self.state = "name"
        elif self.key in ("arguments", "parameters") and not self.args_seen:
            if c == "{":
                self.args_start = self.i
                self.streaming = self.call is not None
                self.state = "args"
            elif c == '"':
                self.state = "args_string"
            else:
                raise _Fail
        else:
            self.state = "skip"
        return _AGAIN

    def _name(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        name = _loads(text)
        if name not in self.p._tools:
            raise _Fail
        self.name = name
        self.start_call(name)
        if self.args_text is not None:
            self.emit_args(self.args_text)
        self.state = "after"
        return _AGAIN

    def _args(self, final: bool) -> Any:
        text = self._scan_value(final)
        if self.streaming:  # emit up to the last point where the text so far can be closed
            safe = len(text) if text is not None else self.scan.safe
            self.emit_args(self.raw[self.args_start + self.args_len:self.args_start + safe])
        if text is None:
            return None
        self.args_seen = True
        if not self.streaming:
            self.args_text = text
        self.state = "after"
        return _AGAIN

    def _args_string(self, final: bool) -> Any:
        text = self._scan_value(final)
        if text is None:
            return None
        inner = _loads(text).strip()
        if not isinstance(_loads(inner), dict):
            raise _Fail
        self.args_seen = True
        if self.call is not None:
            self.emit_args(inner)
        else:
            self.args_text = inner
        self.state = "after"
        return _AGAIN

    def _skip(self, final: bool) -> Any:
        if self._scan_value(final) is None:
            return None
        self.state = "after"
        return _AGAIN

    def _after(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        self.i += 1
        if c == ",":
            self.state = "member"
            return _AGAIN
        if c != "}" or self.call is None:
            self.i -= 1
            raise _Fail
        if not self.args_seen:
            self.emit_args("{}")
        self.end_call()
        self.state = "next" if self.in_list else "end"
        return _AGAIN

    def _next(self, final: bool) -> Any:
        c = self._char(final)
        if c is None:
            return None
        if c == ",":
            self.i += 1
            self.state = "elem"
            return _AGAIN
        if c != "]":
            raise _Fail
        self.i += 1
        self.represented = self.i
        self.state = "end"
        return _AGAIN

    def _end(self, final: bool) -> Any:
        return self.closing(final)

    def repair(self) -> tuple[str, int]:
        if self.state == "args" and self.streaming and self.scan is not None:
            safe = self.args_start + self.scan.safe
            return self.raw[self.args_start + self.args_len:safe] + self.scan.safe_closer, safe
        return ("" if self.args_len else "{}"), self.i


_GEMMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_ESCAPES = ("<escape>", '<|"|>')  # string delimiters: FunctionGemma, Gemma 4


def _escape_at(s: str, i: int) -> str | None:
    """The string delimiter starting at s[i], if any."""
    for d in _ESCAPES:
        if s.startswith(d, i):
            return d
    return None


def _gemma_value_end(raw: str, j: int) -> int | None:
    """End index of the Gemma value starting at raw[j], or None if it is not complete yet."""
    d = _escape_at(raw, j)
    if d:
        k = raw.find(d, j + len(d))
        return None if k < 0 else k + len(d)
    if raw[j] in "{[":
        depth, k = 0, j
        while k < len(raw):
            d = _escape_at(raw, k)
            if d:
                e = raw.find(d, k + len(d))
                if e < 0:
                    return None
                k = e + len(d)
                continue
            c = raw[k]
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return k + 1
            k += 1
        return None
    ends = [k for k in (raw.find(",", j), raw.find("}", j)) if k >= 0]
    return min(ends) if ends else None


def _gemma_parse(text: str) -> Any:
    """Parse one complete Gemma value: an escaped string, {k:v,…}, […] or a bare token."""
    try:
        return _gemma_parse_at(text.strip(), 0)[0]
    except RecursionError as e:  # the model nested deeper than the parser follows: not a call
        raise _Fail from e


def _gemma_parse_at(s: str, i: int) -> tuple[Any, int]:
    i = _skip_ws(s, i)
    d = _escape_at(s, i)
    if d:
        k = s.find(d, i + len(d))
        if k < 0:
            raise _Fail
        return s[i + len(d):k], k + len(d)
    if i < len(s) and s[i] in "{[":
        close = "}" if s[i] == "{" else "]"
        obj: Any = {} if close == "}" else []
        i = _skip_ws(s, i + 1)
        while i < len(s) and s[i] != close:
            if close == "}":
                colon = s.find(":", i)
                if colon < 0:
                    raise _Fail
                key = s[i:colon].strip().strip('"')
                value, i = _gemma_parse_at(s, colon + 1)
                obj[key] = value
            else:
                value, j = _gemma_parse_at(s, i)
                if j == i:
                    raise _Fail  # a stray closing bracket: no progress possible
                i = j
                obj.append(value)
            i = _skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i = _skip_ws(s, i + 1)
        if i >= len(s):
            raise _Fail
        return obj, i + 1
    k = i
    while k < len(s) and s[k] not in ",}]":
        k += 1
    return _best_effort(s[i:k].strip()), k


class _GemmaCall(_Reader):
    """`NAME{key:value,…}` (raw starts after `call:`); strings between `<escape>` (or `<|"|>`) delimiters."""

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.state = "name"
        self.nparams = 0

    def _name(self, final: bool) -> Any:
        m = _GEMMA_NAME.match(self.raw, self.i)
        if not m or m.end() == len(self.raw):
            if (m and len(m.group()) > _MAX_NAME) or (not m and self.i < len(self.raw)):
                raise _Fail
            self.need(final)
            return None
        if self.raw[m.end()] != "{" or m.group() not in self.p._tools:
            raise _Fail
        self.start_call(m.group())
        self.i = m.end() + 1
        self.state = "member"
        return _AGAIN

    def _member(self, final: bool) -> Any:
        raw = self.raw
        i = _skip_ws(raw, self.i)
        if i >= len(raw):
            self.need(final)
            return None
        if raw[i] == "}":
            self.i = i + 1
            self.emit_args("}" if self.nparams else "{}")
            self.end_call()
            self.state = "end"
            return _AGAIN
        if self.nparams and raw[i] == ",":
            i = _skip_ws(raw, i + 1)
        colon = raw.find(":", i)
        if colon < 0 or any(c in raw[i:colon] for c in "{},<"):
            if colon >= 0 or len(raw) - i > _MAX_NAME or any(c in raw[i:] for c in "{}<"):
                raise _Fail
            self.need(final)
            return None
        key = raw[i:colon].strip().strip('"')
        j = _skip_ws(raw, colon + 1)
        end = _gemma_value_end(raw, j) if j < len(raw) else None
        if end is None:
            self.need(final)
            return None
        text = raw[j:end]
        schema = _param_schema(self.p._tools[self.call[2]], key)
        d = _escape_at(text, 0)
        if d or text[:1] not in ("{", "["):
            inner = text[len(d):-len(d)] if d else text.strip()
            if inner[:1] == '"':  # a JSON-quoted value (the <escape> tokens were not shown)
                try:
                    inner = str(json.loads(inner))
                except ValueError:
                    pass
            value = convert_param(inner, schema)
        else:
            value = _gemma_parse(text)
        self.emit_args(("{" if self.nparams == 0 else ", ") + _dumps(key) + ": " + _dumps(value))
        self.nparams += 1
        self.i = end
        return _AGAIN

    def _end(self, final: bool) -> Any:
        return self.closing(final)


def _python_calls(body: str, tools: dict[str, dict]) -> list[tuple[str, dict]] | None:
    """Calls written as Python, `f(a=1)` one per line or `[f(a=1), g()]`; keyword literals only.

    None when `body` is not valid Python (it may be incomplete); _Fail when it is
    valid Python but not only calls of declared tools.
    """
    try:
        tree = ast.parse(body.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes: list[ast.expr] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise _Fail
        value = stmt.value
        nodes.extend(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            raise _Fail
        if node.func.id not in tools:
            raise _Fail
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise _Fail
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
                raise _Fail from e
        try:
            json.dumps(args)
        except (TypeError, ValueError) as e:
            raise _Fail from e  # sets, bytes, complex numbers: not JSON
        calls.append((node.func.id, args))
    if not calls:
        raise _Fail
    return calls


class _PythonCalls(_Reader):
    """Python-style calls, read whole and then emitted.

    Inside `<tool_code>` or a ```tool_code fence the body ends at the closing tag.
    Without a closing tag (`close=None`) the body is Gemma 3's documented list
    `[get_weather(city="Paris"), …]` at the start of the answer; raw starts after
    its `[` and it ends at the first `]` that completes valid Python.
    """

    def __init__(self, parser: ToolCallParser, marker: str, raw: str, i: int, close: str | None) -> None:
        super().__init__(parser, marker, raw, i, close)
        self.scan_from = i

    def _start(self, final: bool) -> Any:
        end = self.close or "]"
        while True:
            k = self.raw.find(end, self.scan_from)
            if k < 0:
                if len(self.raw) - self.i > _MAX_BUFFERED:
                    raise _Fail
                self.need(final)
                self.scan_from = max(self.i, len(self.raw) - len(end) + 1)
                return None
            self.scan_from = k + 1
            if self.close:
                calls = _python_calls(self.raw[self.i:k], self.p._tools)
                if calls is None:
                    raise _Fail
                break
            calls = _python_calls("[" + self.raw[self.i:k + 1], self.p._tools)
            if calls is not None:
                break
        self.i = k + len(end)
        for name, args in calls:
            self.start_call(name)
            self.emit_args(_dumps(args))
            self.end_call()
        return "done", self.raw[self.i:]


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _BareList(_Reader):
    """A `[` opening the answer: a JSON list of calls, or a Python list `[tool(…), …]` of declared tools."""

    def _start(self, final: bool) -> Any:
        j = _skip_ws(self.raw, 0)
        if j == len(self.raw):
            self.need(final)
            return None
        if self.raw[j] == "{":
            return "become", _JsonCall(self.p, self.marker, self.raw, 0, None, opened="[")
        m = _IDENT.match(self.raw, j)
        if not m or m.end() == len(self.raw):
            if m is None:
                raise _Fail
            self.need(final)
            return None
        if self.raw[m.end()] != "(" or m.group() not in self.p._tools:
            raise _Fail
        return "become", _PythonCalls(self.p, self.marker, self.raw, 0, None)


# --------------------------------------------------------------------------- the parser

# marker -> (closing tag, forms allowed inside); "<function=" and "call:" start a call directly.
_WRAPPERS = {
    "<tool_call>": ("</tool_call>", ("xml", "json")),
    "<tool_code>": ("</tool_code>", ("json", "gemma", "python")),
    "```tool_code": ("```", ("json", "gemma", "python")),
    "<start_function_call>": ("<end_function_call>", ("gemma",)),
    "<|tool_call>": ("<tool_call|>", ("gemma",)),
}
_MARKERS = tuple(_WRAPPERS) + ("<function=", "call:")
_MARKER_TAGS = _Tags(_MARKERS)


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class ToolCallParser:
    """Incremental tool-call recognition over answer text (never over reasoning).

    `push(text)` and `finish()` return events: TextDelta for plain text and
    ToolCallStart / ToolCallArgsDelta / ToolCallEnd for calls. With
    `enabled=False` (tool_choice "none") everything is text.
    """

    def __init__(self, tools: list[dict], *, enabled: bool = True) -> None:
        self._tools = normalize_tools(tools)
        self.enabled = enabled and bool(self._tools)
        self.num_calls = 0
        self._out: list[Event] = []
        self._buf = ""
        self._reader: _Reader | None = None
        self._at_start = True     # nothing but whitespace seen: a bare JSON call may begin
        self._pending_ws = ""     # trailing whitespace of the text, held in case a call follows
        self._after_call = False  # the last thing was a call: following whitespace is dropped
        self._prev = ""           # last text character released (word boundary for `call:`)
        self._finished = False

    def push(self, text: str) -> list[Event]:
        """Add a piece of answer text; return the events it decides."""
        if self._finished:
            raise RuntimeError("ToolCallParser.push after finish")
        if not self.enabled:
            return [TextDelta(text)] if text else []
        self._buf += text
        self._run(final=False)
        out, self._out = self._out, []
        return merge_events(out)

    def finish(self) -> list[Event]:
        """End of output: decide everything held back."""
        if self._finished:
            return []
        self._finished = True
        if not self.enabled:
            return []
        self._run(final=True)
        if self._pending_ws:
            self._out.append(TextDelta(self._pending_ws))
            self._pending_ws = ""
        out, self._out = self._out, []
        return merge_events(out)

    # -- driving the readers --

    def _run(self, final: bool) -> None:
        while True:
            reader = self._reader
            if reader is None:
                if not self._scan_text(final):
                    return
                continue
            # Append without copying the whole region each time: with the attribute
            # cleared, `raw` holds the only reference and CPython grows it in place.
            raw, reader.raw = reader.raw, ""
            raw += self._buf
            reader.raw, self._buf = raw, ""
            try:
                result = reader.step(final)
            except _Fail:
                result = reader.fail()
            if result is None:
                if not final:
                    return
                result = reader.fail()  # readers fail rather than wait at the end; be safe regardless
            kind, value = result
            if kind == "become":
                self._reader = value
                continue
            self._reader = None
            if kind == "rescan":  # not a call after all: the marker is text, the rest is read again
                self._emit_text(reader.marker)
                self._buf = reader.raw
            else:  # "done" or "rest": calls were emitted; what follows is text again
                self._after_call = True
                self._prev = ""
                self._buf = value

    def _begin_call(self, name: str) -> tuple[int, str, str]:
        index, call_id = self.num_calls, new_call_id()
        self.num_calls += 1
        self._pending_ws = ""
        self._out.append(ToolCallStart(index, call_id, name))
        return index, call_id, name

    def _scan_text(self, final: bool) -> bool:
        """Text mode: release text, start a reader at a marker. Returns whether a reader started."""
        buf = self._buf
        if not buf:
            return False
        if self._at_start:
            body = buf.lstrip()
            if not body:
                if final:
                    self._emit_text(buf)
                    self._buf = ""
                return False
            self._at_start = False
            if body[0] in "{[":
                self._pending_ws += buf[:len(buf) - len(body)]
                if body[0] == "{":
                    self._reader = _JsonCall(self, "{", body[1:], 0, None, opened="{")
                else:
                    self._reader = _BareList(self, "[", body[1:])
                self._buf = ""
                return True
        pos, marker = self._find_marker(buf)
        if marker:
            self._emit_text(buf[:pos])
            raw = buf[pos + len(marker):]
            if marker in _WRAPPERS:
                close, forms = _WRAPPERS[marker]
                self._reader = _Wrapper(self, marker, raw, close, forms)
            elif marker == "<function=":
                self._reader = _XmlCall(self, marker, raw, 0, None)
            else:
                self._reader = _GemmaCall(self, marker, raw, 0, None)
            self._buf = ""
            return True
        hold = 0 if final else self._hold_len(buf)
        self._emit_text(buf[:len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _boundary(self, buf: str, pos: int) -> bool:
        before = buf[pos - 1] if pos > 0 else self._prev
        return not (before and _word_char(before))

    def _find_marker(self, buf: str) -> tuple[int, str]:
        best, best_marker = -1, ""
        for marker in _MARKERS:
            pos = buf.find(marker)
            while marker == "call:" and pos >= 0 and not self._boundary(buf, pos):
                pos = buf.find(marker, pos + 1)
            if pos >= 0 and (best < 0 or pos < best):
                best, best_marker = pos, marker
        return best, best_marker

    def _hold_len(self, buf: str) -> int:
        return _MARKER_TAGS.partial_suffix(buf, lambda marker, at: marker != "call:" or self._boundary(buf, at))

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        self._prev = text[-1]
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        self._out.append(TextDelta(self._pending_ws + body))
        self._pending_ws = text[len(body):]
