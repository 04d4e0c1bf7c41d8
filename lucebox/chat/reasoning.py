"""Split streamed model output into reasoning and answer text.

Reasoning models write `<think> … </think>` before the answer. Some chat
templates put the opening tag into the generation prompt themselves (Qwen3
thinking templates, DeepSeek-R1): then the output starts inside reasoning
(`start_in_reasoning=True`). Rules, the same as llama.cpp/vLLM apply:

- a reasoning block is recognised only at the start of the output (after
  whitespace); a `<think>` later in the answer is ordinary text;
- the tags themselves are never emitted, also when split across pieces;
- whitespace right after the opening tag and right before the closing tag is
  trimmed from the reasoning, and whitespace right after the closing tag is
  trimmed from the answer;
- output that ends inside reasoning (length limit) stays reasoning.

With reasoning disabled (`enabled=False`) everything is answer text, except
that an empty `<think></think>` pair (whitespace inside only) the model emits
anyway at the start is removed. A non-empty block is then kept verbatim as text:
the client asked for no reasoning, but nothing the model wrote is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.chat.events import ReasoningDelta, TextDelta

_START = "start"            # before anything: looking for the opening tag
_REASONING_START = "rstart"  # just inside reasoning: trimming leading whitespace
_REASONING = "reasoning"
_CONTENT_TRIM = "ctrim"     # just after the closing tag: trimming leading whitespace
_CONTENT = "content"


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """How a model marks its reasoning; built by the chat template layer."""

    enabled: bool = True
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    start_in_reasoning: bool = False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[len(text) - k:]):
            return k
    return 0


class ReasoningSplitter:
    """Incremental splitter: push pieces, get ReasoningDelta / TextDelta events."""

    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>", *,
                 start_in_reasoning: bool = False, enabled: bool = True) -> None:
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must be non-empty")
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.enabled = enabled
        self._state = _REASONING_START if (enabled and start_in_reasoning) else _START
        self._buf = ""
        self.saw_reasoning = False

    @classmethod
    def from_config(cls, config: ReasoningConfig) -> ReasoningSplitter:
        return cls(config.open_tag, config.close_tag, start_in_reasoning=config.start_in_reasoning,
                   enabled=config.enabled)

    @property
    def in_reasoning(self) -> bool:
        """True while the model is (still) writing reasoning; the thinking budget counts these tokens."""
        return self._state in (_REASONING_START, _REASONING)

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]:
        """Add a piece of output; return what can be decided now."""
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        """End of output: release everything held back."""
        return self._run(final=True)

    # -- state machine -------------------------------------------------------

    def _run(self, final: bool) -> list[TextDelta | ReasoningDelta]:
        out: list[TextDelta | ReasoningDelta] = []
        while True:
            state = self._state
            if state == _START:
                self._start(final)
            elif state == _REASONING_START:
                self._reasoning_start(final)
            elif state == _REASONING:
                self._reasoning(out, final)
            elif state == _CONTENT_TRIM:
                rest = self._buf.lstrip()
                self._buf = rest
                if rest:
                    self._state = _CONTENT
            else:
                if self._buf:
                    out.append(TextDelta(self._buf))
                    self._buf = ""
            if self._state == state:  # no transition: wait for more text
                return out

    def _start(self, final: bool) -> None:
        body = self._buf.lstrip()
        if body.startswith(self.open_tag):
            rest = body[len(self.open_tag):]
            if self.enabled:
                self._buf = rest
                self._state = _REASONING_START
                return
            inner = rest.lstrip()
            if inner.startswith(self.close_tag):  # empty pair while disabled: drop it
                self._buf = inner[len(self.close_tag):]
                self._state = _CONTENT_TRIM
                return
            if self.close_tag.startswith(inner) and not final:
                return  # could still be an empty pair
            self._state = _CONTENT
            return
        if self.open_tag.startswith(body) and not final:
            return  # whitespace or a partial opening tag: undecided
        self._state = _CONTENT

    def _reasoning_start(self, final: bool) -> None:
        body = self._buf.lstrip()
        self._buf = body
        if body.startswith(self.open_tag):  # the model repeated the tag the prompt already had
            self._buf = body[len(self.open_tag):]
            return self._reasoning_start(final)
        if not body and not final:
            return
        if body and self.open_tag.startswith(body) and not final:
            return
        self._state = _REASONING

    def _reasoning(self, out: list[TextDelta | ReasoningDelta], final: bool) -> None:
        buf = self._buf
        i = buf.find(self.close_tag)
        if i >= 0:
            self._emit_reasoning(out, buf[:i].rstrip())
            self._buf = buf[i + len(self.close_tag):]
            self._state = _CONTENT_TRIM
            return
        if final:
            self._emit_reasoning(out, buf.rstrip())
            self._buf = ""
            return
        # Hold a partial closing tag and the whitespace before it (it may precede the tag).
        cut = len(buf) - _partial_suffix(buf, self.close_tag)
        body = buf[:cut].rstrip()
        self._emit_reasoning(out, body)
        self._buf = buf[len(body):]

    def _emit_reasoning(self, out: list[TextDelta | ReasoningDelta], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text))
            self.saw_reasoning = True
