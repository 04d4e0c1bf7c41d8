"""Stop sequences matched on streamed text, with a hold-back window.

A stop string can arrive split across several detokenizer pieces ("</an" +
"swer>"), so the tail of the text that could still grow into a stop string is
held back until the next piece decides it. Nothing of a matched stop string,
and nothing after it, is ever released. Work per push is proportional to the
piece plus the longest stop string, never to the whole output.
"""

from __future__ import annotations


class StopMatcher:
    """Cuts a text stream at the first stop string."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = sorted({s for s in stops if s}, key=len)
        # Every proper prefix of a stop string: a held-back tail must be one of these.
        self._prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        """True once a stop string matched; later text is discarded."""
        return self.matched is not None

    def push(self, text: str) -> tuple[str, str | None]:
        """Add a piece; return (text safe to emit, the stop string matched by this piece or None)."""
        if self.matched is not None:
            return "", None
        if not self._stops:
            return text, None
        buf = self._held + text
        hit = self._first_match(buf)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return buf[:start], stop
        hold = self._hold_len(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def flush(self) -> str:
        """Release the held-back tail at the end of generation (nothing after a match)."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        # The stop that *ends* first is the one a piece-by-piece reader would see first;
        # among those ending at the same place, the longest (earliest start) wins.
        # Only the held tail plus the new piece is searched: the held tail holds no
        # complete stop, so any match ends inside the new piece.
        best: tuple[int, int] | None = None  # (end, start)
        best_stop = ""
        for stop in self._stops:
            i = buf.find(stop)
            if i < 0:
                continue
            key = (i + len(stop), i)
            if best is None or key < best:
                best, best_stop = key, stop
        return None if best is None else (best[1], best_stop)

    def _hold_len(self, buf: str) -> int:
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[len(buf) - k:] in self._prefixes:
                return k
        return 0
