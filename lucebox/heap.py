"""Handing freed heap memory back to the OS.

glibc keeps freed blocks in its heaps for reuse (one heap per thread that allocated them), so a process that
built and dropped large temporaries (a model's dequantized and fused weights at load, a rejected 16 MB request
body, a stopped server in a test process) stays that much larger for good. `malloc_trim(0)` returns every free
page; off glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def trim() -> None:
    """Return the heaps' free pages to the OS (~0.1 s for a GB)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def release() -> None:
    """Collect garbage (what reference cycles hold), then `trim`."""
    gc.collect()
    trim()
