"""Tokenize a chat prompt one segment at a time, remembering long segments across requests.

An agent sends its whole conversation every turn: a 20K-token prompt of which
only the last messages are new. Tokenizing it whole costs tens of milliseconds
a turn. A `tokenizers` tokenizer cuts its input at special tokens before
anything else and encodes the pieces independently, so the ids of a text are
the ids of its pieces between special tokens, concatenated. Chat templates put
a special token around every message: each message is a piece, and a piece
seen before (the system prompt, earlier turns) is not encoded again.

This holds only for tokenizers that treat every piece alike (no stripping
around special tokens, no "prepend to the first piece only"); `SegmentCache.for_tokenizer`
checks that on probe texts and returns None when the two ways disagree.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

MIN_CACHED_CHARS = 256
"""Shorter pieces are encoded each time (cheap), not remembered."""
BUDGET_CHARS = 8 << 20
"""Characters of remembered pieces (least recently used dropped first): ~8 MB of text, ids kept as int32."""
LONG_PIECE = 4096
"""Pieces longer than this go through `encode_batch`, which releases the GIL."""


class SegmentCache:
    """Encodes text piece by piece between special tokens, reusing the ids of long pieces seen before."""

    def __init__(self, hf: tokenizers.Tokenizer, specials: dict[str, int]) -> None:
        self.hf = hf
        self.specials = specials
        # leftmost-longest, as `tokenizers` matches added tokens
        self._split = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, array] = OrderedDict()  # int32 ids: 4 bytes a token, not a Python int
        self._chars = 0
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, hf: tokenizers.Tokenizer) -> SegmentCache | None:
        """A cache for `hf`, or None when piecewise encoding would differ from encoding whole texts."""
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items()
                    if t.special and t.content and not (t.lstrip or t.rstrip or t.single_word)}
        if not specials:
            return None
        cache = cls(hf, specials)
        s = sorted(specials)[0]
        probes = [f"{s}user\nHi there{s}\n{s}", f"A{s} B{s}B", f" {s}  x\n\n{s}\n", f"{s}{s}héllo wörld {s}",
                  f"x{s}y", f"\t{s}\t"]
        whole = [hf.encode(p, add_special_tokens=False).ids for p in probes]
        if any(cache._encode(p, remember=False) != w for p, w in zip(probes, whole)):
            return None
        return cache

    def encode(self, text: str) -> list[int]:
        """The ids `hf.encode(text, add_special_tokens=False)` gives."""
        return self._encode(text, remember=True)

    def _encode(self, text: str, remember: bool) -> list[int]:
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:
                ids.append(self.specials[part])
            elif part:
                ids += self._piece(part, remember)
        return ids

    def _piece(self, text: str, remember: bool) -> list[int]:
        if len(text) < MIN_CACHED_CHARS or not remember:
            return self._encode_piece(text)
        with self._lock:
            ids = self._pieces.get(text)
            if ids is not None:
                self._pieces.move_to_end(text)
                self.hits += 1
                return ids.tolist()
        ids = self._encode_piece(text)
        with self._lock:
            self.misses += 1
            if text not in self._pieces and len(text) <= BUDGET_CHARS // 4:
                self._pieces[text] = array("i", ids)
                self._chars += len(text)
                while self._chars > BUDGET_CHARS:
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return ids

    def _encode_piece(self, text: str) -> list[int]:
        if len(text) > LONG_PIECE:
            return self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids
