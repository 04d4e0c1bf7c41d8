"""The disk tier on real files: format round trip, restart, corruption, crashes mid-write, budget, eviction."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from lucebox import procs
from lucebox.cache.disk import HEADER_SIZE, DiskStore
from lucebox.cache.snapshots import token_key

LAYOUT = "0123456789abcdef0123456789abcdef"


def entry(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[str, list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (n,), generator=g).tolist()
    return token_key(tokens), tokens, torch.randn(4, 2, n, 2, 16, generator=g).to(dtype)


def files(store: DiskStore) -> list[str]:
    return sorted(os.listdir(store.dir))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    key, tokens, kv = entry(37, dtype=dtype)
    assert store.put(1, key, tokens, kv)
    assert files(store) == [f"{key}.t1.kv"]
    got = store.get(1, key)
    assert got.tokens.tolist() == tokens and got.kv.dtype == dtype and torch.equal(got.kv, kv)
    assert store.get(2, key) is None, "tier 1 and tier 2 are different entries"
    assert not store.put(1, key, tokens, kv), "already stored"
    s = store.stats()
    assert (s.entries, s.hits, s.misses, s.written) == (1, 1, 1, 1)
    assert s.bytes == os.path.getsize(store.dir / f"{key}.t1.kv")


def test_drafter_kv_round_trips_next_to_the_kv(tmp_path):
    """With a DFlash drafter on, an entry also holds the drafter's context KV (a third tensor, whose
    table entry moves the token ids to offset 1024); both come back bit-exact after a restart."""
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    key, tokens, kv = entry(37)
    draft = torch.randn(2, 2, 37, 3, 8)
    assert store.put(2, key, tokens, kv, draft)
    key1, tokens1, kv1 = entry(20, seed=1)
    assert store.put(1, key1, tokens1, kv1)  # and one without, in the same folder
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    got = store.get(2, key)
    assert got.tokens.tolist() == tokens and torch.equal(got.kv, kv) and torch.equal(got.draft_kv, draft)
    assert store.get(1, key1).draft_kv is None
    assert store.stats().corrupt_removed == 0
    with pytest.raises(ValueError, match="drafter KV"):
        store.put(2, "f" * 40, tokens, kv, draft[:, :, :5])


def test_kv_is_memory_mapped_not_read_into_ram(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    key, tokens, kv = entry(64)
    store.put(1, key, tokens, kv)
    got = store.get(1, key)
    path = store.dir / f"{key}.t1.kv"
    # Change the file behind the tensor's back: a mapped tensor sees it (Linux shares clean private pages
    # with the page cache), a copy would not.
    size = path.stat().st_size
    nbytes = kv.numel() * 4
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, np.float32(1234.5).tobytes(), size - nbytes)
    finally:
        os.close(fd)
    assert got.kv.flatten()[0].item() == 1234.5


def test_restart_rebuilds_the_index_from_headers(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    written = [entry(10 + i, seed=i) for i in range(3)]
    for i, (key, tokens, kv) in enumerate(written):
        store.put(1 + i % 2, key, tokens, kv)
    store.get(1, written[0][0])
    store.flush()  # the hit's header update is written by the background thread
    store.close()
    again = DiskStore(tmp_path, LAYOUT, 1 << 30)
    assert again.stats().entries == 3 and again.stats().bytes == store.stats().bytes
    meta = {(e.tier, e.key): e for e in again.entries()}
    first = meta[1, written[0][0]]
    assert first.hits == 1 and first.last_used >= first.created and first.n_kv == 10
    for i, (key, tokens, kv) in enumerate(written):
        got = again.get(1 + i % 2, key)
        assert got.tokens.tolist() == tokens and torch.equal(got.kv, kv)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def one_entry(root: Path) -> tuple[DiskStore, str, Path]:
    store = DiskStore(root, LAYOUT, 1 << 30)
    key, tokens, kv = entry(300)
    store.put(2, key, tokens, kv)
    return store, key, store.dir / f"{key}.t2.kv"


# Offsets: magic, version, tier, layout id, key, token count, KV count, payload size, created, last used, hits,
# payload checksum, header checksum, tensor table, token ids, KV (start, middle, last byte).
HEADER_OFFSETS = [0, 9, 12, 20, 60, 90, 98, 106, 115, 125, 130, 150, 250]
PAYLOAD_OFFSETS = [256, 300, 520, 4096, 20000, -1]


@pytest.mark.parametrize("offset", HEADER_OFFSETS + PAYLOAD_OFFSETS)
def test_flipped_bytes_are_never_loaded(tmp_path, offset):
    _, key, path = one_entry(tmp_path)
    flip(path, offset if offset >= 0 else path.stat().st_size + offset)
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)  # restart: header damage is caught by the scan
    assert store.get(2, key) is None  # payload damage by the checksum on load
    assert not path.exists()
    s = store.stats()
    assert (s.corrupt_removed, s.entries, s.bytes, s.hits) == (1, 0, 0, 0)


def test_truncated_files_are_removed_at_scan(tmp_path):
    _, key, path = one_entry(tmp_path)
    data = path.read_bytes()
    for n in (0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 512, 4096, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:n])
        store = DiskStore(tmp_path, LAYOUT, 1 << 30)
        assert store.stats().corrupt_removed == 1 and store.stats().entries == 0, n
        assert not path.exists() and store.get(2, key) is None
    path.write_bytes(data + b"\0")  # too long is wrong too
    assert DiskStore(tmp_path, LAYOUT, 1 << 30).stats().corrupt_removed == 1


def test_a_file_of_another_layout_is_removed_and_its_own_folder_left_alone(tmp_path):
    other, key, path = one_entry(tmp_path)
    mine = DiskStore(tmp_path, "fedcba9876543210fedcba9876543210", 1 << 30)
    assert not mine.contains(2, key) and mine.get(2, key) is None
    (mine.dir / path.name).write_bytes(path.read_bytes())  # copied into the wrong folder
    mine.scan()
    assert mine.stats().corrupt_removed == 1 and mine.stats().entries == 0
    assert path.exists() and DiskStore(tmp_path, LAYOUT, 1 << 30).get(2, key) is not None


def test_garbage_and_foreign_files(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    junk = store.dir / f"{'ab' * 20}.t1.kv"
    junk.write_bytes(os.urandom(5000))
    notes = store.dir / "README.txt"
    notes.write_text("not a cache file")
    store.scan()
    assert not junk.exists() and notes.exists() and store.stats().corrupt_removed == 1


def test_an_entry_deleted_behind_the_store_is_a_miss(tmp_path):
    store, key, path = one_entry(tmp_path)
    path.unlink()
    assert store.get(2, key) is None and not store.contains(2, key)


WRITER = textwrap.dedent("""
    import sys, torch
    from lucebox.cache.disk import DiskStore
    store = DiskStore(sys.argv[1], sys.argv[2], 1 << 34)
    n = 6000
    kv = torch.ones(32, 2, n, 8, 64)  # 188 MB: long enough to be caught mid-write
    print("ready", flush=True)
    store.put(1, "c" * 40, list(range(n)), kv)
    print("done", flush=True)
""")


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path):
    proc = procs.spawn([sys.executable, "-c", WRITER, str(tmp_path), LAYOUT], stdout=subprocess.PIPE, text=True)
    folder = tmp_path / LAYOUT
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        temp = None
        while time.monotonic() < deadline and temp is None:
            temp = next((p for p in folder.iterdir() if p.name.endswith(".tmp") and p.stat().st_size > 1 << 20),
                        None)
            time.sleep(0.001)
        assert temp is not None, "the writer never started its temp file"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert temp.exists(), "the kill must land mid-write"
    assert not (folder / f"{'c' * 40}.t1.kv").exists()
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    s = store.stats()
    assert (s.entries, s.temp_removed, s.corrupt_removed) == (0, 1, 0)
    assert os.listdir(folder) == []


def test_budget_holds_under_churn(tmp_path):
    unit = DiskStore(tmp_path / "probe", LAYOUT, 1 << 30)
    key, tokens, kv = entry(40)
    unit.put(1, key, tokens, kv)
    size = unit.stats().bytes
    budget = 5 * size
    store = DiskStore(tmp_path, LAYOUT, budget, protect_s=0)
    rng = np.random.default_rng(0)
    for i in range(40):
        key, tokens, kv = entry(int(rng.integers(10, 80)), seed=i)
        if i % 3:
            store.put_async(1, key, tokens, kv)
            store.flush()
        else:
            store.put(2, key, tokens, kv)
        if i % 4 == 0 and store.entries():
            e = store.entries()[0]
            store.get(e.tier, e.key)
        on_disk = sum(p.stat().st_size for p in store.dir.iterdir())
        assert on_disk == store.stats().bytes <= budget
    s = store.stats()
    assert s.evicted > 10 and s.written == 40 - s.skipped
    # After a restart the same files are found.
    assert DiskStore(tmp_path, LAYOUT, budget).stats().bytes == s.bytes


def test_eviction_takes_the_lowest_value_first(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30, protect_s=0)
    a, b, c, d, e = (entry(32, seed=i) for i in range(5))
    for k, t, kv in (a, b, c):
        store.put(1, k, t, kv)
    store.budget_bytes = store.stats().bytes  # full
    for _ in range(3):
        store.get(1, a[0])
    store.get(1, c[0])
    store.put(1, *d)
    assert not store.contains(1, b[0]), "no hits: lowest value"
    store.get(1, d[0])
    store.get(1, d[0])
    store.put(1, *e)
    assert not store.contains(1, c[0]) and store.contains(1, a[0]), "one hit goes before three"


def test_hits_decay_with_idle_time(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30, protect_s=0, half_life_s=0.05)
    a, b, c = (entry(32, seed=i) for i in range(3))
    store.put(1, *a)
    for _ in range(5):
        store.get(1, a[0])
    time.sleep(0.6)  # a's 6 (hits + 1) decay by 2**-12
    store.put(1, *b)
    store.budget_bytes = store.stats().bytes
    store.put(1, *c)
    assert not store.contains(1, a[0]) and store.contains(1, b[0])


def test_young_entries_are_protected_and_a_new_one_that_cannot_fit_is_skipped(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)  # protect_s = 60
    a, b, c = (entry(32, seed=i) for i in range(3))
    store.put(1, *a)
    store.put(1, *b)
    store.budget_bytes = store.stats().bytes
    assert not store.put(1, *c)
    s = store.stats()
    assert (s.entries, s.skipped, s.evicted) == (2, 1, 0)
    assert store.contains(1, a[0]) and store.contains(1, b[0])


def test_min_tokens_and_budget_smaller_than_an_entry(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30, min_tokens=20)
    assert not store.put(1, *entry(19)) and not store.put_async(1, *entry(19, seed=1))
    assert store.put(1, *entry(20))
    tiny = DiskStore(tmp_path / "tiny", LAYOUT, 1000)
    assert not tiny.put(1, *entry(20))
    assert tiny.stats().skipped == 1 and os.listdir(tiny.dir) == []


def test_put_async_never_blocks_and_drops_when_the_queue_is_full(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 34, queue_size=1)
    big = [entry(4000, seed=i) for i in range(6)]  # 4 MB of KV each
    start = time.monotonic()
    store.put(1, *big[0])
    one_write = time.monotonic() - start
    start = time.monotonic()
    queued = [store.put_async(1, *e) for e in big[1:]]
    enqueue_time = time.monotonic() - start
    assert enqueue_time < one_write, "queueing five writes took longer than doing one"
    assert not all(queued) and store.stats().dropped == queued.count(False)
    store.flush()
    assert store.stats().entries == 1 + queued.count(True)
    assert not store.put_async(1, *big[0]), "already on disk"
    store.close()


def test_the_idle_writer_holds_no_snapshot_and_close_writes_what_is_queued(tmp_path):
    """Once written, a snapshot's KV is the caller's alone (the writer kept its last job: a RAM snapshot evicted
    meanwhile stayed in memory); `close` writes every queued job before the thread ends (a server's stop)."""
    store = DiskStore(tmp_path, LAYOUT, 1 << 30, min_tokens=1)
    key, tokens, kv = entry(64)
    assert store.put_async(1, key, tokens, kv)
    store.flush()
    gone = weakref.ref(kv)
    del kv
    assert gone() is None, "the idle writer thread still holds the last snapshot it wrote"
    queued = [entry(16, seed=s) for s in range(1, 4)]
    assert all(store.put_async(2, k, t, v) for k, t, v in queued)
    store.close()
    assert files(store) == sorted([f"{key}.t1.kv"] + [f"{k}.t2.kv" for k, _, _ in queued])


def test_clear_removes_everything(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    for i in range(4):
        store.put(1, *entry(16, seed=i))
    assert store.clear() == 4
    assert os.listdir(store.dir) == [] and store.stats().entries == 0 and store.stats().bytes == 0


def test_clear_leaves_nothing_behind_from_a_write_in_flight(tmp_path, monkeypatch):
    """The writer is held inside a real write while clear() runs: that entry must not appear afterwards."""
    store = DiskStore(tmp_path, LAYOUT, 1 << 30)
    started, release = threading.Event(), threading.Event()
    put = store.put

    def held_put(*args):
        started.set()
        release.wait(10)
        return put(*args)

    monkeypatch.setattr(store, "put", held_put)
    assert store.put_async(1, *entry(64, seed=1)) and store.put_async(1, *entry(64, seed=2))
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    store.clear()
    store.flush()
    assert store.stats().entries == 0 and [f for f in os.listdir(store.dir) if not f.startswith(".")] == []
    store.close()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError):
        DiskStore(tmp_path, "../escape", 1 << 20)
    store = DiskStore(tmp_path, LAYOUT, 1 << 20)
    key, tokens, kv = entry(8)
    with pytest.raises(ValueError):
        store.put(3, key, tokens, kv)
    with pytest.raises(ValueError):
        store.put(1, "../../etc/passwd", tokens, kv)
    with pytest.raises(ValueError):
        store.put(1, key, tokens[:4], kv)
