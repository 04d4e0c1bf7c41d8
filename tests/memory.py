"""Giving a test's freed memory back to the OS (the suite must stay under 6 GB resident on a 2-core box)."""

from __future__ import annotations

from lucebox import heap


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (lucebox.heap.release).

    glibc keeps what a stopped server freed (~1 GB: fp32 weights, KV, activations, much of it allocated on
    the engine's own thread, so in that thread's arena) for reuse; the next server's engine thread gets
    another arena and cannot reuse it, so without a trim the suite's resident size grows by about a server
    per server it ever started.
    """
    heap.release()
