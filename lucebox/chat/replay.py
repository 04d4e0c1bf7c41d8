"""Tool-call replay (API.md, "Multi-turn replay"): the exact text the model produced for its tool calls.

A client sends an assistant tool-call turn back as structured data (ids, names,
arguments), and the template renders that data its own way: spacing, key order
and number formats rarely match what the model wrote, so the prompt's tokens
diverge from the cached KV right at that turn. Remembering the produced text per
call id and rendering it verbatim keeps the next request's prompt a token-exact
extension of the last one, which is what the prefix cache needs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ToolCallReplay:
    """A bounded LRU from tool-call id to the raw assistant text that made the call."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[str, tuple[frozenset[str], str]] = OrderedDict()
        self._lock = threading.Lock()  # render runs in worker threads
        self.replayed = 0

    def remember(self, call_ids: list[str], text: str) -> None:
        """Record `text` as the turn that made exactly these calls."""
        if not call_ids or self.capacity <= 0:
            return
        entry = (frozenset(call_ids), text)
        with self._lock:
            for cid in call_ids:
                self._texts[cid] = entry
                self._texts.move_to_end(cid)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)

    def rewrite(self, messages: list[dict]) -> list[dict]:
        """`messages` with each assistant tool-call turn we produced replaced by its raw text.

        Only a turn whose call ids are exactly the recorded set is replaced (a client
        that dropped or added a call gets the template's rendering).
        """
        out = messages
        for i, msg in enumerate(messages):
            calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
            if not calls:
                continue
            ids = [c.get("id") for c in calls if isinstance(c, dict)]
            with self._lock:
                entry = self._texts.get(ids[0]) if ids and isinstance(ids[0], str) else None
                if entry is None or entry[0] != frozenset(ids) or len(ids) != len(entry[0]):
                    continue
                for cid in ids:
                    self._texts.move_to_end(cid)
                self.replayed += 1
            if out is messages:
                out = list(messages)
            out[i] = {"role": "assistant", "content": entry[1]}
        return out
