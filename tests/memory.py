"""Giving a test's freed memory back to the OS (the suite must stay under 6 GB resident on a 2-core box)."""

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


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS.

    glibc keeps what a stopped server freed (~1 GB: fp32 weights, KV, activations, much of it allocated on
    the engine's own thread, so in that thread's arena) for reuse; the next server's engine thread gets
    another arena and cannot reuse it, so without a trim the suite's resident size grows by about a server
    per server it ever started.
    """
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
