"""The incremental JSON scanner: checks one JSON value as it streams and says where its prefix can be closed.

The JSON call formats stream the model's own arguments text; this scanner is
what lets them cut it only at points where the text so far can still be made
valid JSON (see `JsonScan.safe`).
"""

from __future__ import annotations

import re

from lucebox.chat.toolcalls.reader import WS

_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUM_RUN = re.compile(r"[0-9eE+\-.]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class JsonScan:
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
        if c in WS:
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

