"""Tiers 1 and 2: KV snapshots in host memory, and the copies between them and paged KV blocks.

A snapshot is the KV of a run of tokens in token-major layout
`[layers, 2, n, kv_heads, head_dim]`, contiguous on the CPU (pinned when CUDA
is there, so restoring it is an async DMA), with the token ids it covers.

- Tier 1 (`SnapshotPool(n, "prefix")`): KV at chat-turn boundaries. Key: SHA-1
  of the token ids up to the boundary (`token_key(ids[:b])`). Eviction: the
  least recently used entry that is not a prefix of another entry (a shared
  system prompt outlives the conversations that extend it).
- Tier 2 (`SnapshotPool(n, "exact")`): the KV of a whole prompt after prefill.
  Key: SHA-1 of the token ids of the prompt as the request gave it, before any
  PFlash compression (`token_key(prompt_ids)`), since ids are what the engine
  holds. Value: `tokens` = the ids the KV continues (the compressed prompt when
  PFlash ran, else the prompt) and the KV of all of them but the last: the
  engine re-prefills the last token to get the logits it samples from. Eviction:
  least recently used.

Keys hash the ids as little-endian int32 (`token_key`), so a key is the same in
RAM, on disk and across restarts.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lucebox.cache.host_pool import HostBuffer, HostBufferPool
from lucebox.engine.runtime.kv_cache import KVCache

if TYPE_CHECKING:  # state_snapshots imports this module
    from lucebox.cache.state_snapshots import StateSlots

KINDS = ("prefix", "exact")


# ---------------------------------------------------------------------------
# Keys


def _id_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def token_key(token_ids: Sequence[int] | np.ndarray) -> str:
    """SHA-1 hex of token ids (as little-endian int32): the key of both tiers."""
    return hashlib.sha1(_id_bytes(token_ids)).hexdigest()


def prefix_keys(token_ids: Sequence[int] | np.ndarray, ends: Sequence[int]) -> list[str]:
    """`token_key(token_ids[:e])` for each of the ascending `ends`, in one pass over the ids."""
    raw = _id_bytes(token_ids)
    h, done, keys = hashlib.sha1(), 0, []
    for e in ends:
        if e < done:
            raise ValueError("prefix_keys needs ascending ends")
        h.update(raw[4 * done:4 * e])
        done = e
        keys.append(h.copy().hexdigest())
    return keys


# ---------------------------------------------------------------------------
# Paged blocks <-> token-major KV


def _slot_index(kv: KVCache, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
    bs = kv.block_size
    if -(-end // bs) > len(block_table):
        raise ValueError(f"a block table of {len(block_table)} blocks does not hold {end} tokens")
    pos = torch.arange(start, end)
    table = torch.tensor(list(block_table[:-(-end // bs)]), dtype=torch.long)
    index = table[pos // bs] * bs + pos % bs
    if kv.data.device.type == "cpu":
        return index
    # From pinned memory the copy is queued on the current stream; from pageable memory it would wait for it.
    return index.pin_memory().to(kv.data.device, non_blocking=True)


def _host_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def snapshot_shape(kv: KVCache, n_tokens: int) -> tuple[int, ...]:
    """The shape of a snapshot of `n_tokens` positions of `kv`: `[layers, 2, n, kv_heads, head_dim]`."""
    d = kv.data
    return (d.shape[0], d.shape[1], n_tokens, *d.shape[3:])


def aligned(nbytes: int) -> int:
    """Where a second tensor starts in a host buffer after `nbytes` of the first (views need 16-byte alignment)."""
    return -(-nbytes // 16) * 16


def buffer_layout(kv_bytes: int, draft_bytes: int, conv_bytes: int) -> tuple[int, int, int]:
    """Offsets in a snapshot's host buffer of the drafter KV, the conv state and the ssm state (a hybrid
    model's, fp32), after the KV at 0; the buffer's size is the last offset plus the ssm state's bytes."""
    draft_at = aligned(kv_bytes)
    conv_at = aligned(draft_at + draft_bytes)
    return draft_at, conv_at, aligned(conv_at + conv_bytes)


def snapshot_bytes(kv: KVCache, n_tokens: int) -> int:
    """Bytes of the KV of `n_tokens` positions of `kv` in a snapshot (known before any copy)."""
    d = kv.data
    return n_tokens * (d.numel() // d.shape[2]) * d.element_size()


class KVCopy:
    """A copy of snapshot KV out of the blocks; `done()` says when the host tensor holds it."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream snapshot copies of `device` run on (one per device, made on first use)."""
    with _copy_streams_lock:
        stream = _copy_streams.get(device)
        if stream is None:
            stream = _copy_streams[device] = torch.cuda.Stream(device)
        return stream


def gather_kv_into(kv: KVCache, block_table: Sequence[int], n_tokens: int, out: torch.Tensor,
                   after: torch.cuda.Event | None = None) -> KVCopy:
    """Start copying the KV of positions `[0, n_tokens)` out of a sequence's blocks into `out`.

    `out` is a CPU tensor of `snapshot_shape(kv, n_tokens)`. On CUDA the gather and
    the device->host copy run on the copy stream after `after` (an event the thread
    that ran the steps which wrote these positions recorded), else after the work
    queued so far on the current stream, and this returns at once: the caller keeps
    the blocks referenced (nobody may write them) and `out` unread until `done()`;
    `out` should be pinned, else the copy is synchronous. On the CPU it is a plain
    copy, done when this returns.
    """
    if tuple(out.shape) != snapshot_shape(kv, n_tokens) or out.dtype != kv.data.dtype or out.device.type != "cpu":
        raise ValueError(f"a host tensor {tuple(out.shape)} {out.dtype} on {out.device} cannot take the KV of "
                         f"{n_tokens} positions {snapshot_shape(kv, n_tokens)} {kv.data.dtype}")
    dev = kv.data.device
    if dev.type == "cpu":
        torch.index_select(kv.data, 2, _slot_index(kv, block_table, 0, n_tokens), out=out)
        return KVCopy(None)
    side = copy_stream(dev)
    if after is not None:
        side.wait_event(after)
    else:
        side.wait_stream(torch.cuda.current_stream(dev))  # an event on the main stream, waited for on the side one
    with torch.cuda.stream(side):
        src = kv.data.index_select(2, _slot_index(kv, block_table, 0, n_tokens))
        out.copy_(src, non_blocking=out.is_pinned())
        event = torch.cuda.Event()
        event.record(side)
    return KVCopy(event)


def gather_kv(kv: KVCache, block_table: Sequence[int], n_tokens: int, pin: bool | None = None) -> torch.Tensor:
    """Copy the KV of positions `[0, n_tokens)` of a sequence out of its blocks, and wait for it.

    Returns a new contiguous CPU tensor `[layers, 2, n_tokens, kv_heads, head_dim]`
    (pinned when the cache is on CUDA, unless `pin` says otherwise). For tools and
    tests: the engine uses `gather_kv_into`, which does not wait.
    """
    if kv.data.device.type == "cpu":
        return kv.data.index_select(2, _slot_index(kv, block_table, 0, n_tokens))
    out = _host_empty(snapshot_shape(kv, n_tokens), kv.data.dtype, True if pin is None else pin)
    gather_kv_into(kv, block_table, n_tokens, out).wait()
    return out


def scatter_kv(kv: KVCache, block_table: Sequence[int], snapshot_kv: torch.Tensor, start: int = 0,
               end: int | None = None) -> None:
    """Write positions `[start, end)` of a snapshot into a sequence's blocks (end defaults to all of it).

    `start` skips positions the sequence already has, e.g. blocks shared from the
    tier-0 index, which must never be written. From pinned memory the copy is
    asynchronous, ordered before later work on the current stream.
    """
    end = snapshot_kv.shape[2] if end is None else end
    d = kv.data
    if (snapshot_kv.dim() != 5 or snapshot_kv.shape[:2] != d.shape[:2] or snapshot_kv.shape[3:] != d.shape[3:]
            or snapshot_kv.dtype != d.dtype):
        raise ValueError(f"snapshot KV {tuple(snapshot_kv.shape)} {snapshot_kv.dtype} does not fit the KV cache "
                         f"{tuple(d.shape)} {d.dtype}")
    if not 0 <= start <= end <= snapshot_kv.shape[2]:
        raise ValueError(f"positions [{start}, {end}) are outside a snapshot of {snapshot_kv.shape[2]} tokens")
    if start == end:
        return
    part = snapshot_kv[:, :, start:end]
    if d.device.type == "cpu" or part.is_contiguous():
        src = part.to(d.device, non_blocking=snapshot_kv.is_pinned())
    else:  # one contiguous plane per layer and K/V: a strided host source would be staged through pageable memory
        src = torch.empty(part.shape, dtype=part.dtype, device=d.device)
        for layer in range(part.shape[0]):
            for kv_i in range(2):
                src[layer, kv_i].copy_(part[layer, kv_i], non_blocking=snapshot_kv.is_pinned())
    d.index_copy_(2, _slot_index(kv, block_table, start, end), src)


class LocalKV:
    """The target KV a snapshot is copied from and restored into: this process's KV cache, which holds every
    K/V head (and a hybrid's recurrent states, `states`). Under tensor parallelism each rank holds some heads:
    engine/parallel's ShardedKV (same calls) gathers every rank's into one snapshot of all heads and hands
    each rank its own back (its `states` likewise)."""

    asynchronous: bool  # copies may start on the copier thread (CUDA); else they run where they are called

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.asynchronous = kv.data.device.type == "cuda"
        self.states: StateSlots | None = kv.states  # a hybrid's recurrent states, which its snapshots hold too

    @property
    def kv_heads(self) -> int:
        """K/V heads a snapshot holds (the disk layout names them)."""
        return self.kv.data.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.data.dtype

    def shape(self, n_tokens: int) -> tuple[int, ...]:
        return snapshot_shape(self.kv, n_tokens)

    def nbytes(self, n_tokens: int) -> int:
        return snapshot_bytes(self.kv, n_tokens)

    def gather_into(self, block_table: Sequence[int], n_tokens: int, out: torch.Tensor,
                    after: torch.cuda.Event | None = None) -> KVCopy:
        return gather_kv_into(self.kv, block_table, n_tokens, out, after)

    def scatter(self, block_table: Sequence[int], snapshot_kv: torch.Tensor, start: int, end: int) -> None:
        scatter_kv(self.kv, block_table, snapshot_kv, start, end)


# ---------------------------------------------------------------------------
# The RAM pools


@dataclass(eq=False)
class Snapshot:
    key: str
    tokens: np.ndarray  # int32 token ids the KV belongs to (tier 2: KV covers all but the last)
    kv: torch.Tensor  # [layers, 2, n_kv, kv_heads, head_dim], CPU, contiguous
    created: float  # time.time()
    last_used: float
    hits: int = 0
    _order: int = 0  # recency for eviction (a counter: wall-clock times can tie)
    draft_kv: torch.Tensor | None = None  # the DFlash drafter's context KV of the same positions, if any
    buffer: HostBuffer | None = None  # the host memory kv and draft_kv live in (a HostBufferPool's), if any
    conv: torch.Tensor | None = None  # a hybrid model's recurrent state at position n_kv (state_snapshots.py)
    ssm: torch.Tensor | None = None

    @property
    def n_kv(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.draft_kv, self.conv, self.ssm) if t is not None)
        return self.kv.numel() * self.kv.element_size() + self.tokens.nbytes + extra


@dataclass
class PoolStats:
    kind: str
    entries: int
    slots: int
    bytes: int
    hits: int
    misses: int
    evicted: int


class SnapshotPool:
    """A fixed number of KV snapshot slots in host memory, with the eviction rule of its tier.

    `max_bytes` bounds the memory too (entries are evicted until a new one fits).
    With `host`, entries live in buffers of that pool (returned to it on eviction).
    An entry is either `put` (its KV already on the host), or `reserve`d before
    its KV is copied (room is made, counted against slots and bytes, but lookups
    do not see it) and `publish`ed once the copy is complete.
    Not thread-safe: the caller serializes (`PrefixCache` holds its lock).
    """

    def __init__(self, n_slots: int, kind: str, max_bytes: int | None = None, pin: bool | None = None,
                 host: HostBufferPool | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown snapshot pool kind {kind!r} (choose from {', '.join(KINDS)})")
        if n_slots < 1:
            raise ValueError("a snapshot pool needs at least one slot")
        self.n_slots = n_slots
        self.kind = kind
        self.max_bytes = max_bytes
        self.pin = (host.pin if host is not None else torch.cuda.is_available()) if pin is None else pin
        self.host = host
        self._entries: dict[str, Snapshot] = {}
        self._reserved: dict[str, int] = {}  # key -> bytes of an entry whose copy is in flight
        self._order = 0
        self._hits = self._misses = self._evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def pending(self, key: str) -> bool:
        """Whether `key` is reserved: its copy is in flight, lookups miss it until it is published."""
        return key in self._reserved

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values()) + sum(self._reserved.values())

    def _touch(self, entry: Snapshot) -> None:
        self._order += 1
        entry._order = self._order
        entry.last_used = time.time()

    def get(self, key: str) -> Snapshot | None:
        """The entry under `key`, counted as a hit and marked used; None (a miss) if absent."""
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        entry.hits += 1
        self._touch(entry)
        return entry

    def longest_prefix(self, token_ids: Sequence[int], ends: Sequence[int],
                       keys: Sequence[str] | None = None) -> tuple[int, Snapshot] | None:
        """Tier 1 lookup: the longest `ends[i]` whose prefix `token_ids[:ends[i]]` has an entry.

        The entry's tokens are compared with the prompt's, so even a SHA-1 collision
        cannot restore the wrong KV. Counts one hit or one miss.
        """
        keys = prefix_keys(token_ids, ends) if keys is None else keys
        ids = np.asarray(token_ids, dtype=np.int32)
        for end, key in sorted(zip(ends, keys), reverse=True):
            entry = self._entries.get(key)
            if entry is not None and len(entry.tokens) == end and np.array_equal(entry.tokens, ids[:end]):
                self._hits += 1
                entry.hits += 1
                self._touch(entry)
                return end, entry
        self._misses += 1
        return None

    def reserve(self, key: str, nbytes: int) -> bool:
        """Make room for an entry of `nbytes` whose KV is still to be copied, evicting by the tier's rule.

        False, with nothing evicted, when it cannot fit: larger than `max_bytes`, or the
        slots or bytes are taken by other reservations (or `key` is reserved already).
        """
        taken = sum(self._reserved.values())
        if (key in self._reserved or len(self._reserved) >= self.n_slots
                or (self.max_bytes is not None and taken + nbytes > self.max_bytes)):
            return False
        self.remove(key)  # a put replaces the entry under the same key
        while self._entries and (len(self._entries) + len(self._reserved) >= self.n_slots
                                 or (self.max_bytes is not None and self.nbytes + nbytes > self.max_bytes)):
            self.remove(self._victim().key)
            self._evicted += 1
        self._reserved[key] = nbytes
        return True

    def unreserve(self, key: str) -> None:
        """Give up a reservation (its copy could not be made)."""
        self._reserved.pop(key, None)

    def publish(self, key: str, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
                draft_kv: torch.Tensor | None = None, buffer: HostBuffer | None = None,
                state: tuple[torch.Tensor, torch.Tensor] | None = None) -> Snapshot | None:
        """Make a reserved entry visible, its copy being complete; None if the reservation is gone (a clear).

        The entry takes over the caller's reference to `buffer` (released on eviction), unless it returns None.
        """
        if self._reserved.pop(key, None) is None:
            return None
        now = time.time()
        entry = Snapshot(key, np.array(tokens, dtype=np.int32), kv, now, now, draft_kv=draft_kv, buffer=buffer)
        if state is not None:
            entry.conv, entry.ssm = state
        self._touch(entry)
        self._entries[key] = entry
        return entry

    def put(self, key: str, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
            draft_kv: torch.Tensor | None = None, state: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> Snapshot | None:
        """Store a snapshot (replacing one under the same key), evicting by the tier's rule.

        The size is checked before anything is copied or evicted. Without a host pool, a
        CPU tensor that is contiguous (and pinned, when this pool pins) is kept as is, not
        copied: the caller must not write into it afterwards (`gather_kv`'s result is such a
        tensor); with one, the KV is copied into a buffer of it. `draft_kv` is a DFlash
        drafter's context KV of the same positions (restored with the target's, so
        speculation works on a hit), `state` a hybrid model's (conv, ssm) state at the KV's end. Returns None
        if it cannot fit.
        """
        for t in (kv, draft_kv):
            if t is not None and (t.dim() != 5 or t.shape[1] != 2):
                raise ValueError(f"a KV snapshot is [layers, 2, n, kv_heads, head_dim], not {tuple(t.shape)}")
        if draft_kv is not None and draft_kv.shape[2] != kv.shape[2]:
            raise ValueError(f"drafter KV of {draft_kv.shape[2]} positions for target KV of {kv.shape[2]}")
        kv_bytes = kv.numel() * kv.element_size()
        draft_bytes = draft_kv.numel() * draft_kv.element_size() if draft_kv is not None else 0
        state_bytes = sum(t.numel() * t.element_size() for t in state) if state is not None else 0
        if not self.reserve(key, kv_bytes + draft_bytes + state_bytes + 4 * len(tokens)):
            return None
        buffer = None
        if self.host is not None:
            at = buffer_layout(kv_bytes, draft_bytes, state[0].numel() * 4 if state is not None else 0)
            buffer = self.host.acquire(at[2] + state[1].numel() * 4 if state is not None else at[0] + draft_bytes)
            if buffer is None:
                self.unreserve(key)
                return None
            kv = buffer.view(tuple(kv.shape), kv.dtype).copy_(kv)
            if draft_kv is not None:
                draft_kv = buffer.view(tuple(draft_kv.shape), draft_kv.dtype, at[0]).copy_(draft_kv)
            if state is not None:
                state = tuple(buffer.view(tuple(t.shape), t.dtype, o).copy_(t) for t, o in zip(state, at[1:]))
        else:
            kv = self._host_copy(kv)
            draft_kv = self._host_copy(draft_kv) if draft_kv is not None else None
            state = tuple(self._host_copy(t) for t in state) if state is not None else None
        return self.publish(key, tokens, kv, draft_kv, buffer, state)

    def _host_copy(self, kv: torch.Tensor) -> torch.Tensor:
        if kv.device.type == "cpu" and kv.is_contiguous() and (kv.is_pinned() or not self.pin):
            return kv
        out = _host_empty(kv.shape, kv.dtype, self.pin)
        out.copy_(kv)
        return out

    def _victim(self) -> Snapshot:
        by_age = sorted(self._entries.values(), key=lambda e: e._order)
        if self.kind == "exact":
            return by_age[0]
        for entry in by_age:
            if not any(self._is_prefix(entry, other) for other in self._entries.values()):
                return entry
        return by_age[0]  # unreachable in practice: the longest entry is never a prefix of another

    @staticmethod
    def _is_prefix(a: Snapshot, b: Snapshot) -> bool:
        n = len(a.tokens)
        return a is not b and n < len(b.tokens) and np.array_equal(a.tokens, b.tokens[:n])

    def remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.buffer is not None:
            entry.buffer.release()

    def clear(self) -> None:
        """Drop every entry, and every reservation (a copy in flight then lands nowhere)."""
        for key in list(self._entries):
            self.remove(key)
        self._reserved.clear()

    def entries(self) -> list[Snapshot]:
        """The entries, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e._order)

    def stats(self) -> PoolStats:
        return PoolStats(self.kind, len(self), self.n_slots, self.nbytes, self._hits, self._misses, self._evicted)
