"""A one-line progress report on stderr for long work (download, load, training)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints `label: 42% 41.0/98.0 MB 12.3 MB/s` at most a few times a second.

    On a terminal the line is redrawn in place; elsewhere (CI logs) a line is
    printed every 10% so logs stay short.
    """

    def __init__(self, label: str, total: int, unit: str = "", quiet: bool = False) -> None:
        self.label, self.total, self.unit, self.quiet = label, max(total, 1), unit, quiet
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = sys.stderr.isatty()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.quiet:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.2 or self.done >= self.total:
                self._last_draw = now
                print("\r" + self._line(now), end="", file=sys.stderr, flush=True)
        else:
            decile = min(10, self.done * 10 // self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                print(self._line(now), file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet and self._tty:
            print("\r" + self._line(time.monotonic()), file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        pct = 100 * self.done // self.total
        rate = self.done / max(now - self.start, 1e-6)
        if self.unit == "B":
            return (f"{self.label}: {pct:3d}% {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB "
                    f"{rate / 1e6:.1f} MB/s")
        return f"{self.label}: {pct:3d}% {self.done}/{self.total} {self.unit} {rate:.1f}/s".rstrip()
