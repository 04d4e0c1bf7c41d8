"""The prefix cache as the engine uses it: one object over the tiers, three calls.

    hint = cache.prepare(prompt_ids)   # request thread: boundary keys, promote disk entries to RAM
    cache.attach(seq)                  # engine thread, at admission: reuse GPU blocks, restore a snapshot
    cache.commit(seq)                  # engine thread, when a request finished well: index, start its snapshots
    cache.poll()                       # engine thread, every step: publish the snapshots whose copy is done

Tier 0 (GPU blocks) shares KV without copying; tier 1 (turn boundaries) and
tier 2 (the exact prompt) restore host-RAM snapshots into fresh blocks; the
disk store persists tiers 1 and 2 across restarts. Request threads and the
engine thread both touch the RAM pools, so they are used under one lock.

A commit never waits for the device or for the host allocator. It checks the
size first (an entry the RAM budget cannot take allocates nothing), reserves
the entry's room and keeps the KV blocks it copies referenced; on CUDA it
records an event after the step that wrote the KV and hands the rest to the
copier thread, which takes a buffer from the bounded host pool (pinned: a fresh
`cudaHostAlloc` of a growing session's snapshot takes tens of milliseconds)
and starts the copy on a side stream after that event (`gather_kv_into`). `poll` (each step, and before every lookup)
publishes the entries whose copy finished, gives their blocks back and queues
their disk writes (a worker thread). Until then a lookup of that entry is a
miss: the request prefills instead of waiting. On the CPU the copy is done in
`commit`, so the same path publishes it at the next `poll`.

With a DFlash drafter (`draft_kv`), a hit must also give the drafter its context
for the cached positions. Its context K/V sit in the same blocks as the
target's (another tensor, same slots), so tier 0 shares them for free; the
snapshots of tiers 1 and 2 (RAM and disk) store them next to the target's KV
(+ drafter layers / target layers bytes: 2/30 for the shipped SmolLM2 drafter)
and a restore writes both. A snapshot without drafter KV is not used then.

A hybrid model (Qwen3.5/3.6) also needs its recurrent state at the hit's position
(state_snapshots.py): its snapshots carry the state captured where the prompt's
prefill passed the snapshot's position, a hit is only ever at such a position
(the GPU blocks below it are shared, the rest of the KV and the state restored),
and with no snapshot the prompt is computed from position 0.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox.cache.disk import DiskStore
from lucebox.cache.host_pool import HostBuffer, HostBufferPool
from lucebox.cache.markers import ChatMarkers
from lucebox.cache.prefix_index import PrefixIndex
from lucebox.cache.snapshots import (
    KVCopy,
    LocalKV,
    Snapshot,
    SnapshotPool,
    aligned,
    buffer_layout,
    gather_kv_into,
    prefix_keys,
    scatter_kv,
    snapshot_bytes,
    snapshot_shape,
    token_key,
)
from lucebox.cache.state_snapshots import StateSnapshots
from lucebox.engine.runtime.kv_cache import KVCache, OutOfBlocks
from lucebox.engine.runtime.recurrent_state import StateCapture
from lucebox.engine.runtime.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    gpu: bool = True  # tier 0: finished sequences' blocks stay indexed by prefix
    prefix_slots: int = 32  # tier 1 RAM slots (turn boundaries); 0 = off
    exact_slots: int = 4  # tier 2 RAM slots (exact prompt); 0 = off
    ram_bytes: int = 4 << 30  # bound on the RAM tiers together (--cache-ram), split evenly between the two
    min_tokens: int = 64  # smaller prefixes are not snapshotted (tier 0 still shares them)
    disk_dir: Path | None = None
    disk_budget: int = 4 << 30  # bytes
    disk_min_tokens: int = 256


@dataclass
class CacheHint:
    """What a request brings to the cache, computed off the engine thread."""

    bounds: list[int] = field(default_factory=list)  # turn boundaries in the prompt (may include len(prompt))
    keys: dict[int, str] = field(default_factory=dict)  # boundary -> SHA-1 of the prompt up to it
    exact_key: str = ""


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    committed: int = 0  # snapshots published
    too_big: int = 0  # commits refused by the size check (nothing copied)
    no_room: int = 0  # commits refused for lack of slots, host memory or copy slots (nothing copied)


MAX_COPIES = 8  # snapshot copies in flight; a commit past that is skipped (it never waits)


@dataclass(eq=False)
class PendingCopy:
    """A snapshot whose device->host copy is in flight: its blocks stay referenced until it is published."""

    tier: str
    key: str
    tokens: list[int]
    n: int  # positions copied
    blocks: list[int]
    nbytes: tuple[int, int]  # (target KV, drafter KV) bytes
    after: Any = None  # torch.cuda.Event after the steps that wrote the KV (CUDA)
    kv: Any = None  # torch.Tensor views into `buffer`, once started
    draft_kv: Any = None
    capture: StateCapture | None = None  # a hybrid model's state at position n (released once copied)
    state: Any = None  # (conv, ssm) views into `buffer`, once started
    buffer: HostBuffer | None = None  # None once started: the host pool had no room
    copies: list[KVCopy] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def done(self) -> bool:
        return self.started.is_set() and all(c.done() for c in self.copies)


class Copier:
    """One thread that takes host buffers and enqueues snapshot copies for the engine thread (CUDA)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lucebox-snapshot-copier", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stop the thread once the jobs queued before this have run."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed copy publishes nothing; the engine goes on
                log.exception("a snapshot copy failed")
            job = None  # not held while idle: the job's closure holds a snapshot's host buffer


class PrefixCache:
    def __init__(self, cfg: CacheConfig, kv: KVCache, markers: ChatMarkers | None, layout: str | None,
                 draft_kv: KVCache | None = None, target: LocalKV | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.target = target or LocalKV(kv)  # how the target's KV reaches a snapshot (all ranks' under -tp)
        self.draft_kv = draft_kv  # a DFlash drafter's context KV, in the same blocks as `kv`
        self.markers = markers
        self.index = PrefixIndex(kv.pool, kv.block_size) if cfg.gpu else None
        prefix_on = bool(cfg.prefix_slots) and markers is not None
        # Size classes waste up to 1/8 of a buffer: the pool's bound leaves that over the RAM budget.
        per_pool = cfg.ram_bytes // max(1, int(prefix_on) + int(bool(cfg.exact_slots)))
        self.host = HostBufferPool(cfg.ram_bytes + cfg.ram_bytes // 8, kv.data.device)
        self.states = StateSnapshots(self.target.states, self.host) if self.target.states is not None else None
        self.prefix = SnapshotPool(cfg.prefix_slots, "prefix", max_bytes=per_pool, host=self.host) \
            if prefix_on and per_pool else None
        self.exact = SnapshotPool(cfg.exact_slots, "exact", max_bytes=per_pool, host=self.host) \
            if cfg.exact_slots and per_pool else None
        self.pending: list[PendingCopy] = []  # engine thread only
        self._copier: Copier | None = None  # started at the first snapshot on CUDA
        self.disk = DiskStore(cfg.disk_dir, layout, cfg.disk_budget, cfg.disk_min_tokens) \
            if cfg.disk_dir is not None and layout is not None else None
        self._lock = threading.Lock()
        self.counters = {"gpu": TierCounters(), "prefix": TierCounters(), "exact": TierCounters()}

    # ----- request thread -----------------------------------------------------

    def prepare(self, prompt_ids: list[int], exact_key: str | None = None) -> CacheHint:
        """Keys for the prompt; disk entries it could use are loaded into the RAM pools now.

        `exact_key` (a PFlash prompt: the raw prompt's key, `prompt_ids` its compression) files the prompt
        under that key in the exact tier only; its turn boundaries mean nothing and are not used.
        """
        hint = CacheHint(exact_key=exact_key or token_key(prompt_ids))
        if self.markers is not None and exact_key is None:
            hint.bounds = self.markers.boundaries(prompt_ids)
            ends = [b for b in hint.bounds if b < len(prompt_ids)]
            hint.keys = dict(zip(ends, prefix_keys(prompt_ids, ends)))
        if self.disk is not None:
            self._promote(prompt_ids, hint)
        return hint

    def _promote(self, prompt_ids: list[int], hint: CacheHint) -> None:
        with self._lock:
            in_ram = (self.exact is not None and hint.exact_key in self.exact)
        if self.exact is not None and not in_ram and self.disk.contains(2, hint.exact_key):
            snap = self.disk.get(2, hint.exact_key)
            if snap is not None and np.array_equal(snap.tokens, np.asarray(prompt_ids, dtype=np.int32)):
                with self._lock:
                    self._put(self.exact, hint.exact_key, snap)
                return
        if self.prefix is None:
            return
        for end in sorted(hint.keys, reverse=True):
            key = hint.keys[end]
            with self._lock:
                if key in self.prefix:
                    return
            if self.disk.contains(1, key):
                snap = self.disk.get(1, key)
                if snap is not None and np.array_equal(snap.tokens, np.asarray(prompt_ids[:end], dtype=np.int32)):
                    with self._lock:
                        self._put(self.prefix, key, snap)
                    return

    def exact_tokens(self, key: str) -> list[int] | None:
        """The tokens stored under `key` in the exact tier (RAM, else disk, promoted to RAM), or None.

        PFlash looks up a raw prompt's key here to find the compressed prompt a past request stored.
        """
        if self.exact is None:
            return None
        with self._lock:
            if key in self.exact:
                return self.exact.get(key).tokens.tolist()
        if self.disk is None or not self.disk.contains(2, key):
            return None
        snap = self.disk.get(2, key)
        if snap is None:
            return None
        with self._lock:
            self._put(self.exact, key, snap)
        return snap.tokens.tolist()

    @staticmethod
    def _put(pool: SnapshotPool, key: str, snap: Any) -> None:
        """Promote a disk snapshot into a RAM pool (`put` copies the mapped file's KV into a host buffer)."""
        pool.put(key, snap.tokens, snap.kv, snap.draft_kv, snap.state)

    # ----- engine thread ------------------------------------------------------

    def attach(self, seq: Sequence) -> None:
        """At admission: start the sequence from the longest cached prefix (GPU blocks, then a snapshot)."""
        self.poll()
        tokens = seq.token_ids
        cached = 0
        if self.index is not None:
            blocks = self.index.lookup(tokens[:-1])
            self.kv.pool.incref(blocks)
            seq.block_table = list(blocks)
            cached = len(blocks) * self.kv.block_size
            if self.states is None:
                self._count("gpu", cached)
        hint = seq.cache_hint
        shared = -1  # a hybrid's: the GPU tokens kept below the restored snapshot (-1: none restored)
        if hint is not None and seq.num_output == 0 and (cached < len(tokens) - 1 or self.states is not None):
            snap, end, tier = self._find_snapshot(seq.prompt_ids, hint)
            try:
                if snap is not None and self.states is not None:  # KV only below the snapshot's state
                    cached = self._trim(seq, min(cached, end // self.kv.block_size * self.kv.block_size))
                if snap is not None and (end > cached or self.states is not None) and self._grow(seq, end):
                    self.target.scatter(seq.block_table, snap.kv, cached, end)
                    if self.draft_kv is not None:
                        scatter_kv(self.draft_kv, seq.block_table, snap.draft_kv, start=cached, end=end)
                    if self.states is not None:
                        self.states.restore(seq, snap.conv, snap.ssm)
                    self.counters[tier].restored_tokens += end - cached
                    shared, cached = cached, end
            finally:
                if snap is not None and snap.buffer is not None:
                    snap.buffer.release()  # after the restore's copy was queued: the buffer is reused after it
        if self.states is not None:
            cached = self._attach_states(seq, cached, shared)
        seq.num_cached = seq.num_computed = cached
        if self.draft_kv is not None:
            seq.draft_len = cached

    def _attach_states(self, seq: Sequence, cached: int, shared: int) -> int:
        """A hybrid's start (returned): the restored snapshot's position, else 0 (GPU blocks hold no state);
        then the captures of the positions its snapshots will need, past that start."""
        if shared < 0:
            cached = self._trim(seq, 0)
        self._count("gpu", max(shared, 0))  # blocks shared below the restored position
        hint = seq.cache_hint
        if hint is None or self.states is None:
            return cached
        positions = []
        with self._lock:
            if self.prefix is not None and len(hint.bounds) >= 2:
                b = hint.bounds[-2]
                key = hint.keys.get(b)
                if key is not None and cached < b and self.cfg.min_tokens <= b and key not in self.prefix:
                    positions.append(b)
            n = len(seq.prompt_ids) - 1
            if self.exact is not None and cached < n and self.cfg.min_tokens <= n and hint.exact_key not in self.exact:
                positions.append(n)
        self.states.plan(seq, positions)
        return cached

    def _trim(self, seq: Sequence, n_tokens: int) -> int:
        """Keep the sequence's first `n_tokens` (a whole number of blocks) and give the other blocks back."""
        keep = n_tokens // self.kv.block_size
        self.kv.pool.decref(seq.block_table[keep:])
        del seq.block_table[keep:]
        return keep * self.kv.block_size

    def _usable(self, snap: Snapshot | None) -> bool:
        """A snapshot restores only with everything the engine needs (the drafter's context too, when on; a
        hybrid's recurrent state)."""
        return snap is not None and (self.draft_kv is None or snap.draft_kv is not None) and (
            self.states is None or self.states.fits(snap.conv, snap.ssm))

    @staticmethod
    def _held(snap: Snapshot) -> Snapshot:
        """A found snapshot, its buffer retained (lock held) so that no eviction recycles it mid-restore."""
        if snap.buffer is not None:
            snap.buffer.retain()
        return snap

    def _find_snapshot(self, prompt: list[int], hint: CacheHint) -> tuple[Any, int, str]:
        """Tier 2 wins over tier 1; returns (snapshot, positions it covers, tier); the caller releases its buffer."""
        with self._lock:
            if self.exact is not None:
                snap = self.exact.get(hint.exact_key)
                if self._usable(snap) and len(snap.tokens) == len(prompt) and np.array_equal(
                        snap.tokens, np.asarray(prompt, dtype=np.int32)):
                    self.counters["exact"].hits += 1
                    return self._held(snap), len(prompt) - 1, "exact"
                self.counters["exact"].misses += 1
            if self.prefix is not None and hint.keys:
                ends = sorted(hint.keys)
                found = self.prefix.longest_prefix(prompt, ends, [hint.keys[e] for e in ends])
                if found is not None and self._usable(found[1]):
                    end, snap = found
                    self.counters["prefix"].hits += 1
                    return self._held(snap), min(end, len(prompt) - 1), "prefix"
                self.counters["prefix"].misses += 1
        return None, 0, ""

    def _grow(self, seq: Sequence, n_tokens: int) -> bool:
        need = self.kv.blocks_for(n_tokens) - len(seq.block_table)
        if need > self.kv.pool.num_free:
            self.evict(need - self.kv.pool.num_free)
        try:
            seq.block_table.extend(self.kv.pool.allocate(max(need, 0)))
        except OutOfBlocks:
            return False
        return True

    def _count(self, tier: str, tokens: int) -> None:
        c = self.counters[tier]
        if tokens:
            c.hits += 1
            c.restored_tokens += tokens
        else:
            c.misses += 1

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` GPU blocks that only the index holds (LRU), after finished copies gave theirs."""
        self.poll()
        if self.index is None or n_blocks <= 0:
            return 0
        # Each index eviction scans every indexed block, and a full pool asks for one block at a time (a sequence
        # crossing a block boundary): free a 1/64 of the pool at once so the scan is paid once per many steps
        # (it was ~10% of the engine thread at 64 streams on a full pool), the coldest leaves only.
        return len(self.index.evict(max(n_blocks, self.kv.pool.num_blocks // 64)))

    @property
    def blocks_held(self) -> int:
        """Blocks the cache keeps alive beyond any sequence: indexed ones, and ones a snapshot copy still reads."""
        copying = Counter(b for p in self.pending for b in p.blocks)
        indexed = self.index.blocks() if self.index is not None else set()
        refs = self.kv.pool.ref_counts
        return sum(1 for b in indexed | copying.keys() if refs[b] == (b in indexed) + copying[b])

    def _valid(self, seq: Sequence) -> int:
        """Positions of the sequence whose KV (and drafter context, when on) is complete."""
        n = min(seq.num_computed, len(seq.token_ids))
        return min(n, seq.draft_len) if self.draft_kv is not None else n

    def index_prefix(self, seq: Sequence) -> None:
        """Tier 0 only (a preempted sequence): keep its computed blocks findable."""
        valid = self._valid(seq)
        if self.index is not None and valid:
            self.index.insert(seq.token_ids[:valid], seq.block_table)

    def commit(self, seq: Sequence) -> None:
        """A request finished well (it produced tokens, the client stayed): index its blocks, start its snapshots.

        Never waits for the device: the snapshots are published by a later `poll`."""
        self.poll()
        self.index_prefix(seq)
        hint = seq.cache_hint
        if hint is None:
            return
        prompt = seq.prompt_ids
        computed = self._valid(seq)
        # A hybrid's states captured on the way (position -> capture); a snapshot needs the one at its end.
        captures = self.states.take(seq) if self.states is not None else {}
        if self.prefix is not None and len(hint.bounds) >= 2:
            b = hint.bounds[-2]  # everything before the newest turn's content
            key = hint.keys.get(b)
            if key is not None and self.cfg.min_tokens <= b <= computed and (self.states is None or b in captures):
                self._start_copy(seq, "prefix", key, prompt[:b], b, captures.pop(b, None))
        n = len(prompt) - 1
        if self.exact is not None and self.cfg.min_tokens <= n <= computed and (self.states is None or n in captures):
            self._start_copy(seq, "exact", hint.exact_key, prompt, n, captures.pop(n, None))
        for capture in captures.values():
            capture.release()

    def _start_copy(self, seq: Sequence, tier: str, key: str, tokens: list[int], n: int,
                    capture: StateCapture | None = None) -> None:
        """Snapshot positions [0, n) of `seq` under `key` (with a hybrid's state at n, `capture`, released
        here or once copied): size check, room, host buffer, then the async copy."""
        pool = self.prefix if tier == "prefix" else self.exact
        assert pool is not None
        kv_bytes = self.target.nbytes(n)
        draft_bytes = snapshot_bytes(self.draft_kv, n) if self.draft_kv is not None else 0
        state_bytes = self.states.nbytes if capture is not None and self.states is not None else 0
        size = kv_bytes + draft_bytes + state_bytes + 4 * len(tokens)
        counters = self.counters[tier]
        with self._lock:
            room = False
            if any(p.key == key and p.tier == tier for p in self.pending) or key in pool or pool.pending(key):
                pass  # present, or in flight (perhaps from before a clear, so no longer reserved)
            elif pool.max_bytes is not None and size > pool.max_bytes:
                counters.too_big += 1
            elif len(self.pending) >= MAX_COPIES or not pool.reserve(key, size):
                counters.no_room += 1
            else:
                room = True
        if not room:
            if capture is not None:
                capture.release()
            return
        blocks = list(seq.block_table[:self.kv.blocks_for(n)])
        self.kv.pool.incref(blocks)  # nobody writes them (they stay allocated) until the copy is done
        p = PendingCopy(tier, key, list(tokens), n, blocks, (kv_bytes, draft_bytes), capture=capture)
        self.pending.append(p)
        dev = self.kv.data.device
        if not self.target.asynchronous:
            self._copy(p)
            return
        p.after = torch.cuda.Event()
        p.after.record(torch.cuda.current_stream(dev))
        if self._copier is None:
            self._copier = Copier()
        self._copier.submit(lambda: self._copy_on(dev, p))

    def _copy_on(self, dev: torch.device, p: PendingCopy) -> None:
        with torch.cuda.device(dev):
            self._copy(p)

    def _copy(self, p: PendingCopy) -> None:
        """Take the host buffer and start the copies of `p` (the copier thread on CUDA, else the engine's)."""
        kv_bytes, draft_bytes = p.nbytes
        states = self.states if p.capture is not None else None
        at = buffer_layout(kv_bytes, draft_bytes, states.conv_bytes if states is not None else 0)
        buffer = None
        try:
            buffer = self.host.acquire(at[1] + states.nbytes if states is not None else aligned(kv_bytes) + draft_bytes)
            if buffer is None:
                return
            p.kv = buffer.view(self.target.shape(p.n), self.target.dtype)
            p.copies.append(self.target.gather_into(p.blocks, p.n, p.kv, after=p.after))
            if self.draft_kv is not None:
                p.draft_kv = buffer.view(snapshot_shape(self.draft_kv, p.n), self.draft_kv.data.dtype, at[0])
                p.copies.append(gather_kv_into(self.draft_kv, p.blocks, p.n, p.draft_kv, after=p.after))
            if states is not None and p.capture is not None:  # host to host, once the capture's copy is done
                p.capture.wait()
                p.state = tuple(view.copy_(src) for view, src in zip(states.views(buffer, at[1]),
                                                                     (p.capture.conv, p.capture.ssm)))
            p.buffer, buffer = buffer, None
        finally:
            if buffer is not None:  # the copy did not start: nothing reads the buffer
                p.copies.clear()
                buffer.release()
            if p.capture is not None:
                p.capture.release()
                p.capture = None
            p.started.set()

    def poll(self) -> int:
        """Engine thread: publish the snapshots whose copy finished, give their blocks back, queue disk writes.

        Returns how many copies are still in flight."""
        if not self.pending:
            return 0
        still = []
        for p in self.pending:
            if not p.done():
                still.append(p)
                continue
            self.kv.pool.decref(p.blocks)
            pool = self.prefix if p.tier == "prefix" else self.exact
            assert pool is not None
            if p.buffer is None:  # the host pool had no room (or the copy failed to start)
                with self._lock:
                    pool.unreserve(p.key)
                self.counters[p.tier].no_room += 1
                continue
            with self._lock:
                entry = pool.publish(p.key, p.tokens, p.kv, p.draft_kv, p.buffer, p.state)
            if entry is None:  # cleared while copying
                p.buffer.release()
                continue
            self.counters[p.tier].committed += 1
            if self.disk is not None:
                p.buffer.retain()  # the writer thread reads it; an eviction meanwhile must not recycle it
                if not self.disk.put_async(1 if p.tier == "prefix" else 2, p.key, p.tokens, p.kv, p.draft_kv,
                                           done=p.buffer.release, state=p.state):
                    p.buffer.release()
        self.pending = still
        return len(still)

    def close(self, timeout: float = 30.0) -> None:
        """Engine thread, at shutdown: publish the copies in flight, then write out every queued disk job
        (a snapshot made just before a stop is on disk for the next start) and stop the cache's threads."""
        deadline = time.monotonic() + timeout
        while self.poll() and time.monotonic() < deadline:
            time.sleep(0.002)
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        if self.disk is not None:
            self.disk.close()

    # ----- admin and stats ----------------------------------------------------

    def clear(self) -> dict[str, int]:
        """Engine thread (admin): drop every tier; copies in flight then publish nothing."""
        with self._lock:
            freed = len(self.index.clear()) if self.index is not None else 0
            for pool in (self.prefix, self.exact):
                if pool is not None:
                    pool.clear()
        removed = self.disk.clear() if self.disk is not None else 0
        return {"gpu_blocks_freed": freed, "disk_entries_removed": removed}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": {**self.counters["gpu"].__dict__, "enabled": self.index is not None,
                                       "blocks": len(self.index) if self.index is not None else 0}}
        with self._lock:
            for name, pool in (("prefix", self.prefix), ("exact", self.exact)):
                s = pool.stats() if pool is not None else None
                out[name] = {**self.counters[name].__dict__, "enabled": pool is not None,
                             "slots": s.slots if s else 0, "entries": s.entries if s else 0,
                             "bytes": s.bytes if s else 0}
        h = self.host.stats()
        out["host"] = {"capacity": h.capacity, "in_use": h.in_use, "cached": h.cached, "peak": h.peak,
                       "allocations": h.allocations, "reused": h.reused, "refused": h.refused,
                       "copies_in_flight": len(self.pending)}
        if self.disk is not None:
            d = self.disk.stats()
            out["disk"] = {"dir": str(self.cfg.disk_dir), "entries": d.entries, "bytes": d.bytes,
                           "budget": d.budget, "hits": d.hits, "misses": d.misses,
                           "corrupt_removed": d.corrupt_removed, "written": d.written, "evicted": d.evicted}
        else:
            out["disk"] = {"dir": None, "entries": 0, "bytes": 0, "budget": 0}
        return out
