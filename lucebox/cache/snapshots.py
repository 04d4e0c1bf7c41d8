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
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lucebox.engine.kv_cache import KVCache

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
    return (table[pos // bs] * bs + pos % bs).to(kv.data.device)


def _host_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def gather_kv(kv: KVCache, block_table: Sequence[int], n_tokens: int, pin: bool | None = None) -> torch.Tensor:
    """Copy the KV of positions `[0, n_tokens)` of a sequence out of its blocks.

    Returns a new contiguous CPU tensor `[layers, 2, n_tokens, kv_heads, head_dim]`
    (pinned when the cache is on CUDA, unless `pin` says otherwise), complete when
    this returns: a device cache is copied after the work already queued on the
    current stream, which includes the forward passes that wrote these positions.
    """
    src = kv.data.index_select(2, _slot_index(kv, block_table, 0, n_tokens))
    if src.device.type == "cpu":
        return src
    pin = True if pin is None else pin
    out = _host_empty(src.shape, src.dtype, pin)
    out.copy_(src, non_blocking=pin)
    if pin:
        torch.cuda.current_stream(src.device).synchronize()
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
    src = snapshot_kv[:, :, start:end].to(d.device, non_blocking=snapshot_kv.is_pinned())
    d.index_copy_(2, _slot_index(kv, block_table, start, end), src)


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

    @property
    def n_kv(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        extra = self.draft_kv.numel() * self.draft_kv.element_size() if self.draft_kv is not None else 0
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
    Not thread-safe: one thread (the engine's) uses a pool.
    """

    def __init__(self, n_slots: int, kind: str, max_bytes: int | None = None, pin: bool | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown snapshot pool kind {kind!r} (choose from {', '.join(KINDS)})")
        if n_slots < 1:
            raise ValueError("a snapshot pool needs at least one slot")
        self.n_slots = n_slots
        self.kind = kind
        self.max_bytes = max_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._entries: dict[str, Snapshot] = {}
        self._order = 0
        self._hits = self._misses = self._evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

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

    def put(self, key: str, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
            draft_kv: torch.Tensor | None = None) -> Snapshot | None:
        """Store a snapshot (replacing one under the same key), evicting by the tier's rule.

        A CPU tensor that is contiguous (and pinned, when this pool pins) is kept as
        is, not copied: the caller must not write into it afterwards (`gather_kv`'s
        result is such a tensor). `draft_kv` is a DFlash drafter's context KV of the
        same positions (restored with the target's, so speculation works on a hit).
        Returns None if it cannot fit `max_bytes` at all.
        """
        kv = self._host_copy(kv)
        if draft_kv is not None:
            draft_kv = self._host_copy(draft_kv)
            if draft_kv.shape[2] != kv.shape[2]:
                raise ValueError(f"drafter KV of {draft_kv.shape[2]} positions for target KV of {kv.shape[2]}")
        now = time.time()
        entry = Snapshot(key, np.array(tokens, dtype=np.int32), kv, now, now, draft_kv=draft_kv)
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            return None
        self._entries.pop(key, None)
        while self._entries and (len(self._entries) >= self.n_slots
                                 or (self.max_bytes is not None and self.nbytes + entry.nbytes > self.max_bytes)):
            self.remove(self._victim().key)
            self._evicted += 1
        self._touch(entry)
        self._entries[key] = entry
        return entry

    def _host_copy(self, kv: torch.Tensor) -> torch.Tensor:
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"a KV snapshot is [layers, 2, n, kv_heads, head_dim], not {tuple(kv.shape)}")
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
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def entries(self) -> list[Snapshot]:
        """The entries, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e._order)

    def stats(self) -> PoolStats:
        return PoolStats(self.kind, len(self), self.n_slots, self.nbytes, self._hits, self._misses, self._evicted)
