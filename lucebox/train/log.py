"""Progress lines of the train-drafter command: `say` prints one line on stderr (flushed, so it interleaves
with the engine's own reports) and `hms` writes a duration the way the command's ETAs show it."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
