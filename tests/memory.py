"""Giving a test's freed memory back to the OS (the suite must stay under 6 GB resident on a 2-core box)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from lucebox import heap


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (lucebox.heap.release).

    glibc keeps what a stopped server freed (~1 GB: fp32 weights, KV, activations, much of it allocated on
    the engine's own thread, so in that thread's arena) for reuse; the next server's engine thread gets
    another arena and cannot reuse it, so without a trim the suite's resident size grows by about a server
    per server it ever started.
    """
    heap.release()


_started = 0.0


def _status_mb(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return 0


def memory_log_start() -> None:
    """Reset this process's peak resident size (VmHWM), so the next reading is one module's peak."""
    global _started
    _started = time.monotonic()
    Path("/proc/self/clear_refs").write_text("5")


def memory_log_module(log: Path, module: str) -> None:
    """Append `worker module peak_MB anon_after_MB children_peak_MB seconds` for the module that just ended
    (LUCEBOX_MEMLOG): which modules the 6 GB budget must fit two of at once."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with log.open("a") as f:
        f.write(f"{worker} {module} {_status_mb('VmHWM')} {_status_mb('RssAnon')} {children} "
                f"{time.monotonic() - _started:.0f}\n")
