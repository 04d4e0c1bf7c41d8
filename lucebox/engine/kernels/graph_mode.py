"""Whether the work being launched is for a CUDA graph: captured now, or rehearsed just before a capture.

A capture records one path through the model, and some layers choose their path by it: a routed-experts
layer picks the sync-free kernel (`triton_moe.use_kernel`, `MoE.experts`), Spark the resident experts
(`LayerOffload.experts`). The eager passes that run before each capture (compiling Triton kernels, creating
cuBLAS handles: a compile inside a capture breaks it) must take that same path, or the capture meets kernels
nobody compiled. `rehearsal()` marks those passes; `for_graph(x)` is what the layers ask.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()  # captures run on the engine thread; tests may run several engines in threads


def for_graph(x: torch.Tensor) -> bool:
    """Whether work on `x` is part of a CUDA graph's step: a capture in progress on this stream, or its
    rehearsal (below)."""
    return x.is_cuda and (rehearsing() or torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """Run the eager passes before a capture as the capture will run (`for_graph` true inside)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def rehearsing() -> bool:
    """Inside `rehearsal()`: the pass runs for real but only to prepare a capture (side effects that a replay
    would have, such as Spark's miss marks, are not wanted)."""
    return getattr(_local, "depth", 0) > 0
