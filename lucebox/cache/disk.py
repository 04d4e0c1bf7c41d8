"""Persistence: KV snapshots as memory-mapped files under a byte budget, kept across restarts.

One file per entry, `<root>/<layout_id>/<key>.t<tier>.kv` (tier 1: turn-boundary
prefix, tier 2: exact prompt; the same SHA-1 can name one entry of each):

    offset 0     header, 256 bytes, little-endian (`_HEADER`): magic, version,
                 header size, tier, layout id, key, token count, KV token count,
                 payload bytes, created / last-used times (unix seconds), hit
                 count, BLAKE2b-256 of the payload, and at [240, 256) a
                 BLAKE2b-128 of the header bytes before it
    offset 256   payload: tensor table (count, then name, dtype, shape, file
                 offset, byte length of each tensor: "tokens", "kv" and, when
                 a DFlash drafter is on, "draft_kv"; for a hybrid model its
                 recurrent state at the KV's end, "conv" and "ssm", fp32)
    offset 512   token ids, int32 (at 1024 when the table has a third tensor)
    4 KiB aligned raw KV `[layers, 2, n_kv, kv_heads, head_dim]`, C order
    4 KiB aligned the drafter's context KV of the same positions (if stored)
    4 KiB aligned conv, then ssm (if stored)

Writes go to a temp file in the same folder (`.<name>.<pid>.<rand>.tmp`),
fsync'd, then renamed over the final name and the folder fsync'd: a crash
mid-write leaves a temp file (removed by the next `scan`), never an entry.
Reads map the file (`numpy.memmap`, copy-on-write) and wrap the KV bytes as a
tensor without reading the file into RAM first; the payload checksum is
verified on every load (hashlib releases the GIL, so do loads in a worker
thread). `scan` rebuilds the index from headers alone. Any file with a bad
header, size, layout, checksum or table is deleted and counted, never loaded.

Only complete entries count against the budget. Eviction removes the lowest
value first, value = (hits + 1) * 0.5 ** (idle / half_life) * tokens / bytes,
and never an entry younger than `protect_s`; an entry that cannot fit without
evicting protected ones is not written. One process per layout folder: a
second one's temp files could be taken for a dead writer's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"LBXKV\r\n\x1a"  # the PNG trick: line-ending or text-mode mangling shows as a bad magic
VERSION = 1
HEADER_SIZE = 256
_HEADER = struct.Struct("<8sHHB3x32s40sQQQddQ32s")  # up to the payload checksum; zeros up to byte 240
_HEADER_SUM_AT = 240
_TABLE_COUNT = struct.Struct("<I4x")
_TABLE_ENTRY = struct.Struct("<16s16sI4x6QQQ")  # name, dtype, ndim, shape[6], file offset, byte length
_TOKENS_AT = 512  # where the token ids start, unless the table needs more room (then the next 512 multiple)
_KV_ALIGN = 4096
_CHUNK = 16 << 20  # bytes per write call
_TEMP_MAX_AGE = 24 * 3600.0

_KEY = re.compile(r"[0-9a-f]{40}")
_LAYOUT = re.compile(r"[0-9A-Za-z_-]{1,32}")
_NAME = re.compile(r"([0-9a-f]{40})\.t([12])\.kv")
_TEMP = re.compile(r"\.[0-9a-f]{40}\.t[12]\.kv\.(\d+)\.[0-9a-f]+\.tmp")
_TENSORS = {"tokens", "kv", "draft_kv", "conv", "ssm"}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.uint8,
    torch.float8_e4m3fn, torch.float8_e5m2)}


class CorruptEntry(Exception):
    """A cache file failed a check; the message says which."""


@dataclass
class DiskEntry:
    """What the index knows about one file (from its header)."""

    tier: int
    key: str
    path: Path
    n_tokens: int
    n_kv: int
    size: int  # file bytes
    created: float
    last_used: float
    hits: int

    def value(self, now: float, half_life_s: float) -> float:
        """Eviction value: recency-decayed hits x tokens per byte (lowest goes first)."""
        decay = 0.5 ** (max(0.0, now - self.last_used) / half_life_s)
        return (self.hits + 1) * decay * self.n_kv / self.size


@dataclass
class DiskSnapshot:
    """A loaded entry: tokens copied out, KV still backed by the mapped file."""

    tier: int
    key: str
    tokens: np.ndarray  # int32
    kv: torch.Tensor  # [layers, 2, n_kv, kv_heads, head_dim]
    draft_kv: torch.Tensor | None = None  # [drafter layers, 2, n_kv, heads, head_dim], if stored
    conv: torch.Tensor | None = None  # a hybrid model's recurrent state at position n_kv, if stored
    ssm: torch.Tensor | None = None

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.conv is None or self.ssm is None else (self.conv, self.ssm)


@dataclass
class DiskStats:
    entries: int
    bytes: int
    budget: int
    hits: int
    misses: int
    corrupt_removed: int
    temp_removed: int
    written: int
    evicted: int
    dropped: int  # put_async calls refused because the write queue was full
    skipped: int  # entries not written: below min_tokens, or no room under the budget
    write_errors: int


def _tokens_at(n_tensors: int) -> int:
    """File offset of the token ids: after the header and a table of `n_tensors` entries."""
    table_end = HEADER_SIZE + _TABLE_COUNT.size + n_tensors * _TABLE_ENTRY.size
    return max(_TOKENS_AT, -(-table_end // 512) * 512)


def _pad(b: bytes, n: int) -> bytes:
    return b.ljust(n, b"\0")


def _text(b: bytes) -> str:
    return b.rstrip(b"\0").decode("ascii", "replace")


def _header_sum(head: bytes) -> bytes:
    return hashlib.blake2b(head[:_HEADER_SUM_AT], digest_size=16).digest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskStore:
    """The disk tier of one KV layout: an index of entry files, a budget, a background writer."""

    def __init__(self, root: str | Path, layout_id: str, budget_bytes: int, min_tokens: int = 0, *,
                 protect_s: float = 60.0, half_life_s: float = 3600.0, queue_size: int = 4) -> None:
        if not _LAYOUT.fullmatch(layout_id):
            raise ValueError(f"layout id {layout_id!r} must be 1-32 characters of [0-9A-Za-z_-]")
        self.root = Path(root)
        self.layout_id = layout_id
        self.dir = self.root / layout_id
        self.budget_bytes = int(budget_bytes)
        self.min_tokens = int(min_tokens)
        self.protect_s = protect_s
        self.half_life_s = half_life_s
        self._index: dict[tuple[int, str], DiskEntry] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # the index and counters
        self._io_lock = threading.Lock()  # header reads vs in-place header rewrites
        self._write_lock = threading.Lock()  # one write at a time, so the budget check holds
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._pending: set[tuple[int, str]] = set()
        self._writer: threading.Thread | None = None
        self._n = dict(hits=0, misses=0, corrupt_removed=0, temp_removed=0, written=0, evicted=0, dropped=0,
                       skipped=0, write_errors=0)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.scan()

    # ----- index -------------------------------------------------------------

    def _path(self, tier: int, key: str) -> Path:
        return self.dir / f"{key}.t{tier}.kv"

    def scan(self) -> None:
        """Rebuild the index from the headers in the folder; clear dead writers' temp files and bad files."""
        found: dict[tuple[int, str], DiskEntry] = {}
        for path in sorted(self.dir.iterdir()):
            temp = _TEMP.fullmatch(path.name)
            if temp is not None:
                self._clear_temp(path, int(temp.group(1)))
                continue
            name = _NAME.fullmatch(path.name)
            if name is None or not path.is_file():
                continue  # not ours: leave it alone
            key, tier = name.group(1), int(name.group(2))
            try:
                with self._io_lock, open(path, "rb") as f:
                    head, size = f.read(HEADER_SIZE), os.fstat(f.fileno()).st_size
                found[tier, key] = self._check_header(head, size, tier, key, path)
            except CorruptEntry as e:
                self._drop_corrupt(path, str(e))
            except OSError as e:
                log.warning("KV cache: cannot read %s: %s", path, e)
        with self._lock:
            self._index = found
            self._bytes = sum(e.size for e in found.values())

    def _clear_temp(self, path: Path, pid: int) -> None:
        try:
            age = time.time() - path.stat().st_mtime
            if pid == os.getpid() or (_pid_alive(pid) and age < _TEMP_MAX_AGE):
                return  # a write in progress
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._n["temp_removed"] += 1
        log.info("KV cache: removed %s, left by an interrupted write", path.name)

    def _check_header(self, head: bytes, size: int, tier: int, key: str, path: Path) -> DiskEntry:
        if len(head) < HEADER_SIZE:
            raise CorruptEntry(f"truncated header ({len(head)} bytes)")
        if head[:8] != MAGIC:
            raise CorruptEntry("bad magic")
        if _header_sum(head) != head[_HEADER_SUM_AT:HEADER_SIZE]:
            raise CorruptEntry("header checksum mismatch")
        (_, version, header_size, h_tier, layout, h_key, n_tokens, n_kv, payload, created, last_used, hits,
         _) = _HEADER.unpack_from(head)
        if version != VERSION or header_size != HEADER_SIZE:
            raise CorruptEntry(f"format version {version} (header {header_size} bytes) is not {VERSION}")
        if _text(layout) != self.layout_id:
            raise CorruptEntry(f"layout {_text(layout)!r} is not this store's {self.layout_id!r}")
        if h_tier != tier or _text(h_key) != key:
            raise CorruptEntry("tier or key in the header does not match the file name")
        if size != HEADER_SIZE + payload:
            raise CorruptEntry(f"file is {size} bytes, header says {HEADER_SIZE + payload}")
        if n_kv > n_tokens:
            raise CorruptEntry(f"{n_kv} KV tokens for {n_tokens} token ids")
        return DiskEntry(tier, key, path, n_tokens, n_kv, size, created, last_used, hits)

    def _drop_corrupt(self, path: Path, why: str) -> None:
        log.warning("KV cache: removed %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        with self._lock:
            self._n["corrupt_removed"] += 1

    def _forget(self, entry: DiskEntry) -> None:
        """Drop an entry from the index (lock held) and delete its file."""
        if self._index.get((entry.tier, entry.key)) is entry:
            del self._index[entry.tier, entry.key]
            self._bytes -= entry.size
        entry.path.unlink(missing_ok=True)

    def contains(self, tier: int, key: str) -> bool:
        with self._lock:
            return (tier, key) in self._index

    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._index.values())

    # ----- reads -------------------------------------------------------------

    def get(self, tier: int, key: str) -> DiskSnapshot | None:
        """Load an entry (checksum verified; KV memory-mapped); None on a miss or a bad file (deleted)."""
        with self._lock:
            entry = self._index.get((tier, key))
            if entry is None:
                self._n["misses"] += 1
                return None
        try:
            snap = self._load(entry)
        except (CorruptEntry, OSError) as e:
            with self._lock:
                self._forget(entry)
                self._n["misses"] += 1
                if isinstance(e, CorruptEntry):
                    self._n["corrupt_removed"] += 1
            log.warning("KV cache: removed %s: %s", entry.path.name, e)
            return None
        with self._lock:
            self._n["hits"] += 1
            entry.hits += 1
            entry.last_used = time.time()
        self._enqueue(("touch", entry))
        return snap

    def _load(self, entry: DiskEntry) -> DiskSnapshot:
        try:
            return self._load_checked(entry)
        except (ValueError, struct.error, RuntimeError) as e:  # an empty file, a table that lies, ...
            raise CorruptEntry(f"{type(e).__name__}: {e}") from None

    def _load_checked(self, entry: DiskEntry) -> DiskSnapshot:
        with self._io_lock:
            raw = np.memmap(entry.path, dtype=np.uint8, mode="c")
            head = bytes(raw[:HEADER_SIZE])
        self._check_header(head, len(raw), entry.tier, entry.key, entry.path)
        payload_sum = _HEADER.unpack_from(head)[-1]
        if hashlib.blake2b(raw[HEADER_SIZE:], digest_size=32).digest() != payload_sum:
            raise CorruptEntry("payload checksum mismatch")
        tensors = self._read_table(raw)
        names = set(tensors)
        if not {"tokens", "kv"} <= names <= _TENSORS or ("conv" in names) != ("ssm" in names):
            raise CorruptEntry(f"tensor table holds {sorted(tensors)}, not tokens and kv (and draft_kv, conv + ssm)")
        tokens, kv, draft_kv = tensors["tokens"], tensors["kv"], tensors.get("draft_kv")
        if tokens.dtype != torch.int32 or tuple(tokens.shape) != (entry.n_tokens,):
            raise CorruptEntry("token table entry does not match the header")
        for name, t in (("KV", kv), ("drafter KV", draft_kv)):
            if t is not None and (t.dim() != 5 or t.shape[1] != 2 or t.shape[2] != entry.n_kv):
                raise CorruptEntry(f"{name} shape {tuple(t.shape)} does not match the header")
        return DiskSnapshot(entry.tier, entry.key, tokens.numpy().copy(), kv, draft_kv, tensors.get("conv"),
                            tensors.get("ssm"))

    @staticmethod
    def _read_table(raw: np.ndarray) -> dict[str, torch.Tensor]:
        (count,) = _TABLE_COUNT.unpack_from(raw, HEADER_SIZE)
        at = HEADER_SIZE + _TABLE_COUNT.size
        table_end = at + count * _TABLE_ENTRY.size
        if count > 8 or table_end > len(raw):
            raise CorruptEntry(f"tensor table of {count} entries")
        out = {}
        for i in range(count):
            name, dtype, ndim, *rest = _TABLE_ENTRY.unpack_from(raw, at + i * _TABLE_ENTRY.size)
            shape, offset, nbytes = rest[:ndim], rest[6], rest[7]
            torch_dtype = _DTYPES.get(_text(dtype))
            if torch_dtype is None or ndim > 6:
                raise CorruptEntry(f"tensor {_text(name)!r}: dtype {_text(dtype)!r}, {ndim} dims")
            itemsize = torch.empty((), dtype=torch_dtype).element_size()
            if (int(np.prod(shape, dtype=np.int64)) * itemsize != nbytes or offset % itemsize
                    or offset < max(table_end, _TOKENS_AT) or offset + nbytes > len(raw)):
                raise CorruptEntry(f"tensor {_text(name)!r} does not fit the file")
            flat = torch.from_numpy(raw[offset:offset + nbytes])
            out[_text(name)] = flat.view(torch_dtype).view(tuple(shape))
        return out

    # ----- writes ------------------------------------------------------------

    def put(self, tier: int, key: str, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
            draft_kv: torch.Tensor | None = None, state: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Write an entry now (in the calling thread); False if skipped (present, small, no room, error).

        `draft_kv` (a DFlash drafter's context KV of the same positions) is stored after the KV, then
        `state` (a hybrid model's conv and ssm states at the KV's end)."""
        if tier not in (1, 2) or not _KEY.fullmatch(key):
            raise ValueError(f"a disk entry needs tier 1 or 2 and a SHA-1 hex key, not {tier}, {key!r}")
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] > len(tokens):
            raise ValueError(f"KV {tuple(kv.shape)} is not [layers, 2, n <= {len(tokens)}, kv_heads, head_dim]")
        if draft_kv is not None and (draft_kv.dim() != 5 or draft_kv.shape[1] != 2
                                     or draft_kv.shape[2] != kv.shape[2]):
            raise ValueError(f"drafter KV {tuple(draft_kv.shape)} does not cover the KV's {kv.shape[2]} positions")
        with self._write_lock:
            if self.contains(tier, key):
                return False
            if kv.shape[2] < self.min_tokens:
                self._count("skipped")
                return False
            toks = np.ascontiguousarray(tokens, dtype="<i4")
            blobs = [("kv", kv.detach().to("cpu").contiguous())]
            if draft_kv is not None:
                blobs.append(("draft_kv", draft_kv.detach().to("cpu").contiguous()))
            if state is not None:
                blobs += [(name, t.detach().to("cpu").contiguous()) for name, t in zip(("conv", "ssm"), state)]
            tokens_at = _tokens_at(1 + len(blobs))
            placed, size = [], tokens_at + toks.nbytes
            for name, t in blobs:
                at = -(-size // _KV_ALIGN) * _KV_ALIGN
                placed.append((name, t, at))
                size = at + t.numel() * t.element_size()
            if not self._make_room(size):
                self._count("skipped")
                return False
            try:
                entry = self._write(tier, key, toks, tokens_at, placed, size)
            except OSError as e:
                log.warning("KV cache: could not write %s: %s", self._path(tier, key).name, e)
                self._count("write_errors")
                return False
            with self._lock:
                self._index[tier, key] = entry
                self._bytes += entry.size
                self._n["written"] += 1
            return True

    def _count(self, name: str) -> None:
        with self._lock:
            self._n[name] += 1

    def _make_room(self, size: int) -> bool:
        """Evict (lowest value first, unprotected only) until `size` more bytes fit the budget."""
        with self._lock:
            now = time.time()
            while self._bytes + size > self.budget_bytes:
                free = [e for e in self._index.values() if now - e.created >= self.protect_s]
                if size > self.budget_bytes or not free:
                    return False
                self._forget(min(free, key=lambda e: e.value(now, self.half_life_s)))
                self._n["evicted"] += 1
            return True

    def _write(self, tier: int, key: str, toks: np.ndarray, tokens_at: int,
               placed: list[tuple[str, torch.Tensor, int]], size: int) -> DiskEntry:
        """Write tokens and the `(name, tensor, file offset)` blobs (ascending offsets) to a new entry file."""
        rows = [("tokens", "int32", toks.shape, tokens_at, toks.nbytes)]
        for name, t, at in placed:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"KV dtype {t.dtype} cannot be stored")
            rows.append((name, dtype, tuple(t.shape), at, t.numel() * t.element_size()))
        table = _TABLE_COUNT.pack(len(rows))
        for name, dt, shape, at, nbytes in rows:
            dims = list(shape) + [0] * (6 - len(shape))
            table += _TABLE_ENTRY.pack(name.encode(), dt.encode(), len(shape), *dims, at, nbytes)
        final = self._path(tier, key)
        temp = self.dir / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        digest = hashlib.blake2b(digest_size=32)
        try:
            with open(temp, "wb") as f:
                f.write(bytes(HEADER_SIZE))

                def emit(b: bytes | np.ndarray) -> None:
                    digest.update(b)
                    f.write(b)

                emit(_pad(table, tokens_at - HEADER_SIZE))
                emit(toks.tobytes())
                end = tokens_at + toks.nbytes
                for _, t, at in placed:
                    emit(bytes(at - end))
                    raw = t.reshape(-1).view(torch.uint8).numpy()
                    for i in range(0, len(raw), _CHUNK):
                        emit(raw[i:i + _CHUNK])
                    end = at + len(raw)
                n_kv = placed[0][1].shape[2]
                now = time.time()
                f.seek(0)
                f.write(self._pack_header(tier, key, len(toks), n_kv, size - HEADER_SIZE, now, now, 0,
                                          digest.digest()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self._fsync_dir()
        return DiskEntry(tier, key, final, len(toks), n_kv, size, now, now, 0)

    def _pack_header(self, tier: int, key: str, n_tokens: int, n_kv: int, payload: int, created: float,
                     last_used: float, hits: int, payload_sum: bytes) -> bytes:
        head = _pad(_HEADER.pack(MAGIC, VERSION, HEADER_SIZE, tier, _pad(self.layout_id.encode(), 32),
                                 key.encode(), n_tokens, n_kv, payload, created, last_used, hits, payload_sum),
                    _HEADER_SUM_AT)
        return head + _header_sum(head)

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.dir, os.O_RDONLY)
        except OSError:
            return  # platforms without directory fds
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _touch(self, entry: DiskEntry) -> None:
        """Rewrite an entry's header with its in-memory hits and last-used time (not fsync'd)."""
        with self._io_lock:
            try:
                with open(entry.path, "r+b") as f:
                    head = f.read(HEADER_SIZE)
                    if len(head) < HEADER_SIZE or _header_sum(head) != head[_HEADER_SUM_AT:]:
                        return  # let the next load find and count it
                    fields = list(_HEADER.unpack_from(head))
                    fields[10], fields[11] = entry.last_used, entry.hits
                    f.seek(0)
                    f.write(self._pack_header(fields[3], fields[5].decode(), *fields[6:12], fields[12]))
            except FileNotFoundError:
                return

    # ----- the background writer ---------------------------------------------

    def put_async(self, tier: int, key: str, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
                  draft_kv: torch.Tensor | None = None, done: Callable[[], None] | None = None,
                  state: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Queue a write for the background thread; never blocks. False if not queued
        (already stored or queued, below min_tokens, or the queue is full).

        `tokens` and `kv` are written later, as they are then: pass a RAM snapshot's, which nobody
        writes into (a CPU tensor; a device tensor would be copied in the writer thread). `done` is
        called once the job no longer reads them (written, skipped, failed or dropped by `clear`),
        only when this returns True."""
        if kv.shape[2] < self.min_tokens:
            self._count("skipped")
            return False
        with self._lock:
            if (tier, key) in self._index or (tier, key) in self._pending:
                return False
            self._pending.add((tier, key))
        if not self._enqueue(("put", tier, key, tokens, kv, draft_kv, done, state)):
            with self._lock:
                self._pending.discard((tier, key))
            self._count("dropped")
            return False
        return True

    def _enqueue(self, job: tuple) -> bool:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._run, name="lucebox-kv-disk", daemon=True)
            self._writer.start()
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job[0] == "stop":
                    return
                self._do(job)
            except Exception:  # noqa: BLE001 - the writer must outlive any one bad job
                log.exception("KV cache: background write failed")
                self._count("write_errors")
            finally:
                job = None  # not held while idle: a put holds a RAM snapshot's KV, which an eviction must free
                self._queue.task_done()

    def _do(self, job: tuple) -> None:
        if job[0] == "touch":
            self._touch(job[1])
            return
        _, tier, key, tokens, kv, draft_kv, done, state = job
        try:
            self.put(tier, key, tokens, kv, draft_kv, state)
        finally:
            with self._lock:
                self._pending.discard((tier, key))
            if done is not None:
                done()

    def flush(self) -> None:
        """Wait until every queued job is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued jobs and stop the writer thread."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(("stop",))
            self._writer.join()
        self._writer = None

    # ----- admin -------------------------------------------------------------

    def clear(self) -> int:
        """Delete every entry (admin); returns how many. Jobs still queued are dropped; the one the writer
        is in the middle of is waited for (else its entry would land after the clear)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job[0] == "put":
                with self._lock:
                    self._pending.discard((job[1], job[2]))
                if job[6] is not None:
                    job[6]()
            self._queue.task_done()
        self._queue.join()
        with self._lock:
            entries = list(self._index.values())
            for entry in entries:
                self._forget(entry)
        return len(entries)

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(entries=len(self._index), bytes=self._bytes, budget=self.budget_bytes, **self._n)
