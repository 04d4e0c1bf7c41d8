"""Snapshots leave the engine thread: size-checked before any copy, copied into a bounded pool of host
buffers (pinned, on a side stream, on CUDA), blocks kept referenced until the copy is done, entries visible
only once complete; the PFlash scorer on its own stream.

On the CPU the copy is a plain one, finished inside `commit`, but the entry still goes through the same
pending state and is published by the next `poll`: so the ordering (blocks held, lookups missing, then
published and released) is checked here on the real SmolLM2 engine. Stream overlap is checked on CUDA only.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lucebox.cache.disk import DiskStore
from lucebox.cache.host_pool import HostBufferPool, size_class
from lucebox.cache.manager import CacheConfig, PrefixCache
from lucebox.cache.snapshots import gather_kv_into, scatter_kv, snapshot_bytes, snapshot_shape
from lucebox.chat.template import resolve_chat_template
from lucebox.engine.runtime.kv_cache import BlockPool, KVCache
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams

SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, prices and "
          "ingredients in one or two short sentences, and say so when you do not know.")
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sundays?"}]
TURN2 = TURN1 + [{"role": "assistant", "content": "We open at 9 am on Sundays."},
                 {"role": "user", "content": "And is the rye bread vegan?"}]


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return LLMEngine.from_path(smollm2_path, EngineConfig(device="cpu", kv_tokens=2048, block_size=16,
                                                          cuda_graphs=False), quiet=True)


@pytest.fixture(scope="module")
def template(engine):
    tok = engine.tokenizer
    return resolve_chat_template(gguf_template=engine.loaded.chat_template, bos_token=tok.bos_token,
                                 eos_token=tok.eos_token)


def render(engine: LLMEngine, template, messages: list[dict]) -> list[int]:
    return engine.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special=False)


@pytest.fixture
def make_cache(engine, template):
    """A fresh prefix cache on the shared engine (tier 0 off unless asked: the snapshot path is under test)."""
    made: list[PrefixCache] = []

    def make(with_markers: bool = True, **cfg: object) -> PrefixCache:
        engine.enable_prefix_cache(CacheConfig(**{"gpu": False, "min_tokens": 16, **cfg}),
                                   template if with_markers else None)
        made.append(engine.cache)
        return engine.cache

    yield make
    for cache in made:
        cache.clear()
        assert cache.poll() == 0
        if cache.disk is not None:
            cache.disk.close()
    engine.cache = engine.scheduler.cache = None
    assert engine.kv.pool.num_used == 0, "KV blocks leaked"


def run(engine: LLMEngine, ids: list[int], max_tokens: int = 4):
    """One greedy request to completion; returns its sequence."""
    seq = engine.new_sequence(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if engine.cache is not None:
        seq.cache_hint = engine.cache.prepare(ids)
    engine.scheduler.add(seq)
    while not seq.is_finished:
        engine.step()
    return seq


def test_the_ram_budget_bounds_both_tiers_together(make_cache):
    """`--cache-ram MB` is one budget for the turn-boundary and exact tiers (and the host buffers behind them);
    0 turns both off."""
    cache = make_cache(ram_bytes=64 << 20)
    assert cache.prefix.max_bytes + cache.exact.max_bytes == 64 << 20
    assert cache.host.stats().capacity == (64 << 20) + (8 << 20)  # size classes waste up to 1/8
    off = make_cache(ram_bytes=0)
    assert off.prefix is None and off.exact is None


def test_an_over_budget_snapshot_never_allocates_host_memory(engine, template, make_cache):
    ids = render(engine, template, TURN1)
    need = snapshot_bytes(engine.kv, len(ids) - 1)
    cache = make_cache(ram_bytes=need // 2)  # neither tier's entry fits its RAM budget
    run(engine, ids)
    assert cache.pending == [], "nothing was copied"
    h = cache.host.stats()
    assert (h.allocations, h.peak, h.in_use, h.cached) == (0, 0, 0, 0)
    assert cache.counters["exact"].too_big == 1 and cache.counters["prefix"].too_big == 1
    again = run(engine, ids)
    assert again.num_cached == 0 and len(cache.exact) == len(cache.prefix) == 0


def test_blocks_stay_referenced_until_the_copy_is_published_then_freed(engine, template, make_cache):
    cache = make_cache()
    ids = render(engine, template, TURN1)
    seq = run(engine, ids)
    key = seq.cache_hint.exact_key
    assert len(cache.pending) == 2, "an exact and a turn-boundary snapshot are in flight"
    held = {b for p in cache.pending for b in p.blocks}
    assert len(held) == engine.kv.blocks_for(len(ids) - 1), "the exact snapshot's blocks (the other's are a prefix)"
    refs = engine.kv.pool.ref_counts
    assert all(refs[b] > 0 for b in held) and engine.kv.pool.num_used == len(held), \
        "the finished sequence let go, the copies did not"
    assert engine.blocks_in_use == 0, "blocks a copy holds are the cache's, not a sequence's"
    assert key not in cache.exact and cache.exact.pending(key), "not visible before the copy is published"
    with cache._lock:
        assert cache.exact.get(key) is None, "a lookup before publication is a miss"
    assert cache.poll() == 0
    assert engine.kv.pool.num_used == 0 and all(refs[b] == 0 for b in held), "released once published"
    assert key in cache.exact and cache.counters["exact"].committed == 1


def test_a_clear_while_copying_publishes_nothing_and_frees_everything(engine, template, make_cache):
    cache = make_cache()
    run(engine, render(engine, template, TURN1))
    assert cache.pending
    cache.clear()
    assert cache.poll() == 0
    assert len(cache.exact) == len(cache.prefix) == 0 and cache.counters["exact"].committed == 0
    assert engine.kv.pool.num_used == 0 and cache.host.stats().in_use == 0


def test_a_hit_after_an_async_commit_equals_a_cold_run(engine, template, make_cache):
    p1, p2 = render(engine, template, TURN1), render(engine, template, TURN2)
    cold1, cold2 = run(engine, p1).output_ids, run(engine, p2).output_ids  # no cache at all
    cache = make_cache()
    first = run(engine, p1)
    assert first.num_cached == 0 and first.output_ids == cold1 and cache.pending
    warm = run(engine, p1)  # admission polls: the exact entry is published and restored
    assert warm.num_cached == len(p1) - 1 and cache.counters["exact"].hits == 1
    assert warm.output_ids == cold1
    nxt = run(engine, p2)  # the turn boundary snapshot of turn 1 serves turn 2
    assert 16 <= nxt.num_cached < len(p1) and cache.counters["prefix"].hits == 1
    assert nxt.output_ids == cold2


def test_many_commits_reuse_host_buffers_and_stay_bounded(engine, template, make_cache):
    cache = make_cache(with_markers=False, exact_slots=2)
    base = render(engine, template, TURN1)
    for i in range(6):
        run(engine, base[:-2] + [base[-2] + i + 1, base[-1]], 1)  # same length, another prompt
        assert cache.poll() == 0
        h = cache.host.stats()
        assert h.in_use + h.cached <= h.capacity and h.peak <= h.capacity
    h = cache.host.stats()
    assert len(cache.exact) == 2 and h.in_use == 2 * size_class(snapshot_bytes(engine.kv, len(base) - 1))
    assert h.allocations <= 3 and h.reused >= 3, f"evicted entries' buffers are reused: {h}"
    assert engine.kv.pool.num_used == 0


def test_a_disk_write_keeps_its_buffer_until_written(engine, template, make_cache, tmp_path):
    cache = make_cache(with_markers=False, disk_dir=tmp_path, disk_min_tokens=16)
    ids = render(engine, template, TURN1)
    run(engine, ids)
    cache.poll()
    entry = cache.exact.entries()[0]
    cache.disk.flush()
    assert entry.buffer.refs == 1, "the writer gave its reference back"
    kv = entry.kv.clone()
    with cache._lock:
        cache.exact.clear()
    assert cache.host.stats().in_use == 0
    stored = DiskStore(tmp_path, cache.disk.layout_id, 1 << 30).get(2, entry.key)
    assert stored is not None and torch.equal(stored.kv, kv)


def test_host_pool_reuses_by_size_class_and_refuses_past_capacity():
    pool = HostBufferPool(4 * size_class(100_000))
    a = pool.acquire(100_000)
    assert a is not None and a.nbytes == size_class(100_000) >= 100_000
    a.retain()
    a.release()
    assert pool.stats().in_use == a.nbytes, "still referenced"
    a.release()
    b = pool.acquire(99_000)
    assert b is a and pool.stats().reused == 1
    big = pool.acquire(10 * a.nbytes)
    assert big is None and pool.stats().refused == 1 and pool.stats().allocations == 1
    with pytest.raises(ValueError):
        b.view((b.nbytes,), torch.float32)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("from_copier_thread", [False, True])
def test_the_copy_runs_on_a_side_stream_after_the_step_that_wrote_the_kv(from_copier_thread):
    """Started on the engine thread (after its current stream) or on the copier thread (after the event the
    commit recorded), the copy waits for a step still running, then holds what that step wrote."""
    kv = KVCache(torch.zeros(2, 2, 64 * 16, 2, 64, device="cuda"), 16, BlockPool(64))
    table = kv.pool.allocate(8)
    n = 8 * 16
    out = torch.empty(snapshot_shape(kv, n), dtype=kv.data.dtype, pin_memory=True)
    gather_kv_into(kv, table, n, out).wait()  # a first pinned allocation of a size may sync the device: not timed
    torch.cuda._sleep(200_000_000)  # the main stream is busy (a long step) ...
    kv.data.fill_(3.0)  # ... and then writes the KV
    if from_copier_thread:
        after = torch.cuda.Event()
        after.record()
        started: dict[str, object] = {}
        worker = threading.Thread(target=lambda: started.update(copy=gather_kv_into(kv, table, n, out, after=after)))
        worker.start()
        worker.join(30)
        copy = started["copy"]
    else:
        copy = gather_kv_into(kv, table, n, out)
    assert not copy.done(), "returned without waiting for the step"
    copy.wait()
    assert bool((out == 3.0).all()), "ordered after the step that wrote the KV"


@needs_cuda
def test_a_restore_over_shared_blocks_from_pinned_memory_writes_exactly_its_positions():
    kv = KVCache(torch.zeros(2, 2, 16 * 16, 2, 8, device="cuda"), 16, BlockPool(16))
    table = kv.pool.allocate(4)
    snap = torch.randn(snapshot_shape(kv, 50)).pin_memory()
    scatter_kv(kv, table, snap, start=20, end=50)  # a strided part of the snapshot: copied plane by plane
    out = torch.empty(snapshot_shape(kv, 64), pin_memory=True)
    gather_kv_into(kv, table, 64, out).wait()
    assert bool((out[:, :, :20] == 0).all()) and bool((out[:, :, 50:] == 0).all())
    assert torch.equal(out[:, :, 20:50], snap[:, :, 20:50])


@needs_cuda
def test_the_pflash_scorer_overlaps_the_main_stream(smollm2_path):
    from lucebox.engine.pflash import PFlash, PFlashConfig
    from lucebox.engine.pflash.service import PFlashService
    from lucebox.engine.weights.loader import load_model

    loaded = load_model(smollm2_path, device=torch.device("cuda"), dtype=torch.bfloat16, quiet=True)
    service = PFlashService(PFlash.for_model(loaded, config=PFlashConfig(keep_ratio=0.5)), mode="always")
    assert service.stream is not None and service.stream != torch.cuda.current_stream()
    text = " ".join(f"item {i} is on shelf {i % 7}." for i in range(300))
    service.compress(loaded.tokenizer.encode(text), text, None)  # warm-up (kernels)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    service.compress(loaded.tokenizer.encode(text + " x"), text + " x", None)  # the same call, nothing queued
    alone = time.perf_counter() - t0
    # Work queued on the main stream for several times as long as the call takes alone (~1.9 GHz clocks).
    torch.cuda._sleep(int(max(1.0, 5 * alone) * 2_000_000_000))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (service.compress(loaded.tokenizer.encode(text + " x"), text + " x",
                                                                None), done.set()))
    worker.start()
    worker.join(60)
    assert done.is_set() and not torch.cuda.current_stream().query(), \
        f"the scorer did not finish while the main stream was busy (alone it takes {alone:.2f} s)"
    torch.cuda.synchronize()
