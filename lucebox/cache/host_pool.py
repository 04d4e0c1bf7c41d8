"""Host memory for KV snapshots: one bounded pool of reusable (pinned, on CUDA) buffers.

Every byte a RAM snapshot holds comes from here, so the pool's accounting is the
RAM tier's real footprint: `in_use` (buffers handed out) plus `cached` (freed
buffers kept for reuse) never exceeds `capacity`; an `acquire` that cannot fit
returns None instead of allocating. Pinned memory is slow to allocate
(`cudaHostAlloc` serializes with the device) and is what makes device<->host
copies asynchronous, so freed buffers are kept and handed out again for a
request of the same size class.

A buffer is reference counted (`retain` / `release`): the RAM entry, a disk
write in flight and a restore being enqueued each hold one. On CUDA, the last
release records an event on the releasing thread's current stream, and the
buffer is reused only once that event completed: an asynchronous host->device
copy enqueued before the release (a restore) has then read it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_MIN_CLASS = 64 << 10  # bytes: the smallest size class


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to its size class: at most 1/8 wasted, so freed buffers fit later requests."""
    n = max(int(nbytes), 1)
    step = max(_MIN_CLASS, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class HostBuffer:
    """A flat byte buffer from a `HostBufferPool`; `view` gives typed tensors over parts of it."""

    def __init__(self, pool: HostBufferPool, data: torch.Tensor) -> None:
        self.pool = pool
        self.data = data  # uint8 [nbytes], CPU (pinned when the pool pins)
        self.refs = 1
        self.event: torch.cuda.Event | None = None  # recorded at the last release (CUDA)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` over bytes `[offset, offset + size)` of the buffer."""
        n = 1
        for d in shape:
            n *= d
        size = n * torch.empty((), dtype=dtype).element_size()
        if offset % 16 or offset + size > self.nbytes:
            raise ValueError(f"a view of {size} bytes at {offset} does not fit a {self.nbytes}-byte buffer")
        return self.data[offset:offset + size].view(dtype).view(shape)

    def retain(self) -> HostBuffer:
        self.pool._retain(self)
        return self

    def release(self) -> None:
        self.pool._release(self)


@dataclass
class HostPoolStats:
    capacity: int
    in_use: int  # bytes handed out
    cached: int  # bytes of freed buffers kept for reuse
    peak: int  # highest in_use + cached seen
    allocations: int  # fresh host allocations made
    reused: int  # acquires served from a freed buffer
    refused: int  # acquires that did not fit the capacity


class HostBufferPool:
    """Bounded, reusable host buffers (thread-safe) for copies with `device`: pinned when that is a GPU."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._free: list[HostBuffer] = []  # oldest first
        self._in_use = self._cached = self._peak = 0
        self._allocations = self._reused = self._refused = 0

    def acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least `nbytes` (one reference), or None when it cannot fit the capacity."""
        want = size_class(nbytes)
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes == want and self._idle(buf):
                    del self._free[i]
                    self._cached -= want
                    self._in_use += want
                    buf.refs, buf.event = 1, None
                    self._reused += 1
                    return buf
            while self._in_use + self._cached + want > self.capacity and self._free:
                victim = next((b for b in self._free if self._idle(b)), None)
                if victim is None:
                    break  # every cached buffer is still being read by the device: do not free under it
                self._free.remove(victim)
                self._cached -= victim.nbytes
            if self._in_use + self._cached + want > self.capacity:
                self._refused += 1
                return None
            self._in_use += want
            self._allocations += 1
            self._peak = max(self._peak, self._in_use + self._cached)
        return HostBuffer(self, torch.empty(want, dtype=torch.uint8, pin_memory=self.pin))

    @staticmethod
    def _idle(buf: HostBuffer) -> bool:
        return buf.event is None or buf.event.query()

    def _retain(self, buf: HostBuffer) -> None:
        with self._lock:
            if buf.refs <= 0:
                raise RuntimeError("retain of a released host buffer")
            buf.refs += 1

    def _release(self, buf: HostBuffer) -> None:
        event = None
        if self.pin:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # after the copies this thread queued there
        with self._lock:
            if buf.refs <= 0:
                raise RuntimeError("release of a released host buffer")
            buf.refs -= 1
            if buf.refs:
                return
            buf.event = event
            self._in_use -= buf.nbytes
            self._cached += buf.nbytes
            self._free.append(buf)

    def stats(self) -> HostPoolStats:
        with self._lock:
            return HostPoolStats(self.capacity, self._in_use, self._cached, self._peak, self._allocations,
                                 self._reused, self._refused)
