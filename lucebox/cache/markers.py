"""Tier 1 boundaries: where in a prompt's token ids one chat message ends and the next role starts.

Turn-boundary snapshots are only useful where the next request's prompt is
sure to share the prefix: at the start of a message's content, right after a
role header such as `<|im_start|>user\\n` (ChatML), `<start_of_turn>model\\n`
(Gemma) or `<|start_header_id|>user<|end_header_id|>\\n\\n` (Llama 3).

`ChatMarkers.from_template` learns the header tokens from the model's own
template and tokenizer instead of a table per family: it renders a probe
conversation (user, assistant, user + generation prompt) with sentinel
contents, tokenizes the text between messages, and splits the two separators
(assistant→user, user→assistant) into what they share before the role name
(message end + role start) and after it (header end). The result is checked on
the tokenized probe: every message content must start at a boundary.

A boundary is the position just after a header: the role-start marker, then
1 to `max_role_tokens` tokens of role name (4, or more where the probe's role
names took more in a small vocabulary), then the header end. Where a
message's content fuses with the header end in tokenization (content starting
with blank lines, say), that turn's boundary is missed or lands a few tokens
into the content: a worse cache point, never a wrong one, since snapshots are
keyed by the exact token ids before the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lucebox.chat.template import ChatTemplate, TemplateError
from lucebox.engine.tokenizer import Tokenizer
from lucebox.errors import LuceboxError

_PROBE = ("Lbxq", "Lbxv", "Lbxz")  # contents of the probe's user, assistant and user messages


class NoChatMarkers(LuceboxError):
    """The chat template has no turn markers made of special tokens; tier 1 cannot place boundaries."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class ChatMarkers:
    """Token ids of a chat format's turn markers (`end` + gap, `start`, role name, `header_end`)."""

    end: tuple[int, ...]  # ends a message, e.g. (<|im_end|>, "\n")
    start: tuple[int, ...]  # starts the next role's header, e.g. (<|im_start|>,)
    header_end: tuple[int, ...]  # closes the header after the role name, e.g. ("\n",); may be empty
    max_role_tokens: int = 4

    @classmethod
    def from_template(cls, template: ChatTemplate, tokenizer: Tokenizer) -> ChatMarkers:
        """Derive the markers by rendering a probe conversation; raises NoChatMarkers if there are none."""
        messages = [{"role": r, "content": c} for r, c in zip(("user", "assistant", "user"), _PROBE)]
        try:
            text = template.render(messages, add_generation_prompt=True)
        except TemplateError as e:
            raise NoChatMarkers(f"cannot probe the chat template for turn markers: {e}") from None
        at = [text.find(c) for c in _PROBE]
        if min(at) < 0 or at != sorted(at):
            raise NoChatMarkers("the chat template does not render message contents in order")
        sep_to_assistant = text[at[0] + len(_PROBE[0]):at[1]]
        sep_to_user = text[at[1] + len(_PROBE[1]):at[2]]
        ta = tokenizer.encode(sep_to_assistant, add_special=False)
        tu = tokenizer.encode(sep_to_user, add_special=False)
        pre = _common_prefix(ta, tu)
        suf = _common_prefix(ta[pre:][::-1], tu[pre:][::-1])
        shared, header_end = ta[:pre], ta[len(ta) - suf:]
        roles = (ta[pre:len(ta) - suf], tu[pre:len(tu) - suf])
        specials = [i for i, t in enumerate(shared) if t in tokenizer.special_ids]
        if not specials or not all(roles):
            raise NoChatMarkers(f"the chat template's turn separator {sep_to_user!r} has no special-token "
                                "role marker followed by a role name")
        k = specials[-1]
        # Real vocabularies spell a role in 1-2 tokens; a small one may need more.
        max_role = max(4, *(len(r) for r in roles))
        markers = cls(tuple(shared[:k]), tuple(shared[k:]), tuple(header_end), max_role)
        markers._check_probe(text, at, tokenizer)
        return markers

    def _check_probe(self, text: str, at: list[int], tokenizer: Tokenizer) -> None:
        """Every probe message's content, and the generation prompt's end, must sit on a boundary."""
        ids = tokenizer.encode(text, add_special=False)
        found = set(self.boundaries(ids))
        for pos in at:
            head = tokenizer.encode(text[:pos], add_special=False)
            if ids[:len(head)] != head or len(head) not in found:
                raise NoChatMarkers("the chat template's role headers do not tokenize the same in context")
        if len(ids) not in found:
            raise NoChatMarkers("the chat template's generation prompt does not end on a role header")

    def boundaries(self, token_ids: Sequence[int]) -> list[int]:
        """Positions just after each role header in `token_ids`, ascending (a position may equal len)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        n, s, h = len(ids), len(self.start), len(self.header_end)
        out: list[int] = []
        for p in np.flatnonzero(ids == self.start[0]).tolist():
            role_at = p + s
            if role_at > n or tuple(ids[p:role_at].tolist()) != self.start:
                continue
            if not h:
                out.append(role_at)
                continue
            for q in range(role_at + 1, min(role_at + self.max_role_tokens, n - h) + 1):
                if tuple(ids[q:q + h].tolist()) == self.header_end:
                    out.append(q + h)
                    break
        return out
